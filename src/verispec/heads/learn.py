"""The EAGLE-3 training math, pure torch (no engine): a fresh head shaped like its target (`init_head`), its draft
vocabulary (`choose_vocab`), the training-time test (`ttt_logits`, `ttt_loss`) and the published layout
(`save_eagle3`). `verispec train-draft` (`training.heads`) trains on sampled data; `heads.online` on what the engine
verifies.

The training-time test: unroll step s > 0 reads the head's own outputs of step s - 1 and attends to the target-fed
keys up to where drafting began and its own after, exactly as when it drafts s + 1 deep. Loss: cross-entropy of q
against p restricted to the draft vocabulary (renormalized), weighted decay**s.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from transformers import LlamaConfig

from .modules import PairHead

__all__ = [
    "choose_vocab",
    "default_aux_layers",
    "head_config",
    "init_head",
    "save_eagle3",
    "ttt_logits",
    "ttt_loss",
]


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: the inputs of layers 2, L // 2 and L - 3 (distinct for L >= 7)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) < 3 or num_layers < 7:
        raise ValueError(f"EAGLE-3's default aux layers need a target of >= 7 layers, this one has {num_layers}")
    return ids


def choose_vocab(seqs: list[list[int]], starts: list[int], vocab: int, size: int) -> Tensor:
    """The `size` most frequent token ids of the continuations (seqs[k][starts[k]:]), then of the prompts, then the
    lowest ids; sorted ascending [size]."""
    size = min(size, vocab)
    counts = torch.zeros(vocab, dtype=torch.float64)
    prompt_counts = torch.zeros(vocab, dtype=torch.float64)
    for s, n in zip(seqs, starts):
        ids = torch.as_tensor(s, dtype=torch.int64)
        counts.index_add_(0, ids[n:], torch.ones(len(ids) - n, dtype=torch.float64))
        prompt_counts.index_add_(0, ids[:n], torch.ones(n, dtype=torch.float64))
    score = counts * 1e9 + prompt_counts * 1e3 - torch.arange(vocab, dtype=torch.float64) * 1e-6
    return score.topk(size).indices.sort().values


def init_head(target, vocab_ids: Tensor, aux: tuple[int, ...], intermediate: int | None = None) -> PairHead:
    """A fresh one-layer EAGLE-3 head shaped like the target's layers (hidden size, heads, RoPE; MLP width
    `intermediate`, default the target's)."""
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps")
    cfg = LlamaConfig(
        **{k: getattr(tc, k) for k in keys},
        intermediate_size=intermediate or tc.intermediate_size,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        num_hidden_layers=1,
        vocab_size=len(vocab_ids),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rope_parameters=copy.deepcopy(getattr(tc, "rope_parameters", None)),
    )
    head = PairHead("eagle3", cfg, len(aux) * tc.hidden_size, len(vocab_ids), layers=aux)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
        norm = target.get_decoder().norm.weight
        head.norm.weight.copy_(norm)
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
    head.embed = target.get_input_embeddings().weight.detach()
    return head.to(head.embed.device)


def head_config(head: PairHead, vocab: int, target_layers: int | None = None) -> dict:
    """config.json of the SafeAILab / SpecForge layout (the default aux layers of a target of `target_layers` layers
    are left implicit, as vLLM and SGLang both read them)."""
    L, c = target_layers or 0, head.config
    out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}
    out |= {
        k: getattr(c, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    }
    out |= {"head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, "num_hidden_layers": 1}
    out |= {k: getattr(c, k) for k in ("rms_norm_eps", "max_position_embeddings")}
    out |= {"vocab_size": vocab, "draft_vocab_size": int(head.lm_head.weight.shape[0])}
    out |= {"target_hidden_size": head.fc.in_features // len(head.layers_read), "hidden_act": "silu"}
    out["tie_word_embeddings"] = False
    if not L or head.layers_read != (2, L // 2, L - 3):  # SafeAILab / SpecForge name the outputs before the layers read
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.layers_read]}
    rope = getattr(c, "rope_parameters", None)
    if rope:
        out["rope_parameters"] = dict(rope)
        if "rope_theta" in rope:
            out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":  # older vLLM / SGLang read rope_scaling
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def save_eagle3(head: PairHead, folder: Path, vocab: int, target_layers: int | None = None) -> None:
    """Write the head as config.json + model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in head.state_dict().items():
        if k.startswith("rotary."):
            continue
        k = "midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k
        tensors[k] = v.detach().contiguous().cpu()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(len(head.d2t)) + head.d2t.cpu()] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(head_config(head, vocab, target_layers), indent=2) + "\n")


# --- the training-time test ------------------------------------------------------------------------------------


def _ttt_masks(n: int, steps: int, lengths: Tensor) -> list[Tensor]:
    """Additive masks per unroll step s: [B, 1, n, (s + 1) n]. Query slot j at step s sees step-0 keys at slots
    1..j - s (target-fed) and step-t keys at slot j - s + t (its own drafts, t = 1..s); slot 0 and padding never."""
    j = torch.arange(n, device=lengths.device)
    key, query = j.view(1, -1), j.view(-1, 1)  # [1, n] key slots, [n, 1] query slots
    real = j.view(1, 1, -1) < lengths.view(-1, 1, 1)  # [B, 1, n]: real key slots
    masks = []
    for s in range(steps):
        blocks = [((key <= query - s) & (key >= 1)).unsqueeze(0) & real]
        blocks += [(key == query - s + t).unsqueeze(0) & real for t in range(1, s + 1)]
        visible = torch.cat(blocks, -1)  # [B, n, (s + 1) n]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        masks.append(mask.masked_fill(~visible, torch.finfo(torch.float32).min).unsqueeze(1))
    return masks


def ttt_logits(head: PairHead, ids: Tensor, lengths: Tensor, aux: Tensor, steps: int):
    """The training-time test's unrolled forwards: yields each step s's logits [B, n, V_d], in order. Slot j of step s
    is what the head gives drafting s + 1 tokens deep: the target has computed x_0..x_{j-s-1} (its hidden states feed
    step 0 at slots <= j - s), and x_{j-s+1}..x_j were fed as the head's own drafts, each reading the head's output at
    the slot before (ids [B, n] right-padded, lengths [B], aux [B, n, F]: the target's aux hidden states)."""
    B, n = ids.shape
    masks = _ttt_masks(n, steps, lengths)
    positions = torch.arange(n, device=ids.device).unsqueeze(0).expand(B, n)
    g = head.project(aux)  # [B, n, H]: the target's hidden state for position j
    hidden = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], 1)  # slot j reads h_{j - 1}
    keys: dict[int, list[Tensor]] = {}  # layer -> keys of each unroll step so far [B, nkv, n, D]
    values: dict[int, list[Tensor]] = {}
    for s in range(steps):
        mask = masks[s]

        def attend(i, q, k, v, mask=mask):
            keys.setdefault(i, []).append(k)
            values.setdefault(i, []).append(v)
            K, V = torch.cat(keys[i], 2), torch.cat(values[i], 2)
            return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

        logits, out = head.step(ids, hidden, positions, attend)  # [B, n, V_d], [B, n, H]
        yield logits
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)  # step s + 1 reads o^s_{j - 1}


def ttt_loss(head: PairHead, ids: Tensor, lengths: Tensor, aux: Tensor, p: Tensor, steps: int, decay: float):
    """ids [B, n] (right-padded), lengths [B], aux [B, n, F] (the target's aux hidden states at each token), p [B, n,
    V_d] (the target's next-token distribution on the draft vocabulary) -> (loss, per-step top-1 agreement list)."""
    n = ids.shape[1]
    total, agree = 0.0, []
    slots = torch.arange(n, device=ids.device)
    for s, logits in enumerate(ttt_logits(head, ids, lengths, aux, steps)):
        w = ((slots.view(1, -1) >= s + 1) & (slots.view(1, -1) < lengths.view(-1, 1))).float()  # p_j: x_{j+1}'s law
        logq = logits.float().log_softmax(-1)
        ce = -(p * logq).sum(-1)  # [B, n]
        total = total + decay**s * (ce * w).sum() / w.sum().clamp_min(1)
        agree.append(float(((logq.argmax(-1) == p.argmax(-1)).float() * w).sum() / w.sum().clamp_min(1)))
    return total, agree
