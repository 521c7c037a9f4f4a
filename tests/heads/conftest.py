"""Fixtures of the head tests: the tiny 4-layer target (tests/helpers/tiny.py, seed 0), EAGLE-3 heads saved for it in
the published layouts (tests/helpers/heads.py), and an EAGLE-3 reference written from the paper's equations
(`Reference`, `target_features`: independent of verispec's loading and modules), which also distils a head that
agrees with the target (`trained_head_dir`)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from verispec.model.loading import LoadedModel

from ..helpers.heads import eagle3_tensors, llama_config, save_eagle3
from ..helpers.tiny import V, make_model, make_tokenizer

TARGET_LAYERS = 4
AUX = (0, 2, 4)  # the input of layers 0 and 2, the last layer's output before the final norm (id L)
DRAFT_VOCAB = 24
FLAT = 0.03  # flat_head_dir: the random head's output layer scaled by this


def four_layer_target(name: str = "tiny-4l") -> LoadedModel:
    """A fresh copy of the 4-layer tiny target (tests that change weights build their own)."""
    return LoadedModel(make_model(0, layers=TARGET_LAYERS), make_tokenizer(), name)


# --- the reference ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def target_features(model, ids, layers=AUX) -> torch.Tensor:
    """[B, T, len(layers) * H] (ids [B, T]; a flat list: [T, ...]): the target's hidden states at `layers` (id i < L:
    the input of layer i; id L: the last layer's output, before the final norm), one full forward with hooks."""
    single = not isinstance(ids[0], (list, tuple)) and not (torch.is_tensor(ids) and ids.dim() == 2)
    ids = torch.as_tensor([ids] if single else ids)
    L = model.config.num_hidden_layers
    grabbed: dict[int, torch.Tensor] = {}
    blocks = model.model.layers

    def before(i):
        def hook(module, args, kwargs):
            grabbed[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    def after(module, args, out):
        grabbed[L] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    hooks = [blocks[i].register_forward_pre_hook(before(i), with_kwargs=True) for i in set(layers) if i < L]
    hooks += [blocks[L - 1].register_forward_hook(after)] if L in layers else []
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    out = torch.cat([grabbed[i] for i in layers], -1)
    return out[0] if single else out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [..., heads, T, D] at positions 0..T-1 (rotate-half RoPE)."""
    D, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin


class Reference:
    """The EAGLE-3 head (one layer) of a SafeAILab checkpoint's raw tensors `w` and config: EAGLE-3's equations."""

    def __init__(self, w: dict, cfg: dict, embed: torch.Tensor):
        self.w = w
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.embed = embed.detach()

    @classmethod
    def read(cls, folder: Path, embed: torch.Tensor) -> Reference:
        return cls(
            load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text()), embed
        )

    @property
    def ids(self) -> torch.Tensor:
        """Draft id j -> target id j + d2t[j]."""
        return torch.arange(len(self.w["d2t"])) + self.w["d2t"]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """g = fc([h_low; h_mid; h_high])."""
        return features @ self.w["fc.weight"].T

    def pairs(self, g: torch.Tensor, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs (g[..., i, :], tokens[..., i]) in order, causal -> (draft-vocabulary logits [..., n, V_d], prenorm
        outputs o [..., n, H]). g [n, H] or [B, n, H]."""
        w, p = self.w, "midlayer."
        *lead, n, H = g.shape
        nh, nkv = self.heads, self.kv
        D = H // nh
        e = self.embed[torch.as_tensor(tokens)]
        x = torch.cat([_rms(e, w[p + "input_layernorm.weight"]), _rms(g, w[p + "hidden_norm.weight"])], -1)

        def heads(W, k):
            return (x @ W.T).view(*lead, n, k, D).transpose(-3, -2)  # [..., k, n, D]

        q = _rope(heads(w[p + "self_attn.q_proj.weight"], nh))
        k = _rope(heads(w[p + "self_attn.k_proj.weight"], nkv)).repeat_interleave(nh // nkv, -3)
        v = heads(w[p + "self_attn.v_proj.weight"], nkv).repeat_interleave(nh // nkv, -3)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(-3, -2).reshape(*lead, n, nh * D)
        a = att @ w[p + "self_attn.o_proj.weight"].T + g  # the residual: g itself
        y = _rms(a, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        o = a + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return _rms(o, w["norm.weight"]) @ w["lm_head.weight"].T, o

    @torch.no_grad()
    def unrolled(self, g: torch.Tensor, tokens: list[int], drafts: list[int]) -> torch.Tensor:
        """Logits [n + len(drafts), V_d]: the target-fed pairs, then each draft paired with its parent's output o."""
        g, tokens = g.clone(), list(tokens)
        logits, o = self.pairs(g, tokens)
        for d in drafts:
            g, tokens = torch.cat([g, o[-1:]]), tokens + [d]
            logits, o = self.pairs(g, tokens)
        return logits


# --- heads on disk ----------------------------------------------------------------------------------------------------
def scale_output_layer(folder: Path, factor: float) -> Path:
    """Multiply a saved EAGLE-3 head's `lm_head` by factor (in place)."""
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * factor
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@torch.no_grad()
def _target_samples(model, n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of `length` tokens sampled from the target at temperature 1 after a random first token (no EOS),
    and the target's probabilities at every position [n, length, V]."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(3, V, (n, 1), generator=g)
    for _ in range(length - 1):
        logits = model(seqs).logits[:, -1]
        logits[:, 2] = float("-inf")
        seqs = torch.cat([seqs, torch.multinomial(logits.softmax(-1), 1, generator=g)], 1)
    return seqs, model(seqs).logits.softmax(-1)


def distil_eagle3(folder: Path, target: LoadedModel, steps: int = 60, seed: int = 0) -> Path:
    """An EAGLE-3 head trained for `steps` Adam steps to match the target's next-but-one distribution from
    target-fed pairs (the reference forward, soft labels over the draft vocabulary: the DRAFT_VOCAB ids the target
    samples most, as EAGLE-3 picks them), saved in the SafeAILab layout: it agrees with the target often."""
    torch.manual_seed(seed)
    model = target.model
    seqs, probs = _target_samples(model, 128, 12, seed)
    counts = torch.bincount(seqs.flatten(), minlength=V).float() + probs.sum((0, 1))
    ids = counts.topk(DRAFT_VOCAB).indices.sort().values
    w = eagle3_tensors(V, DRAFT_VOCAB, len(AUX), seed, scale=0.2)
    w["d2t"], w["t2d"] = ids - torch.arange(DRAFT_VOCAB), torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)
    cfg = llama_config(V, architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=DRAFT_VOCAB)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX]}  # layer outputs
    params = {k: v.clone().requires_grad_(True) for k, v in w.items() if v.is_floating_point()}
    ref = Reference(params, cfg, model.get_input_embeddings().weight)
    feats = target_features(model, seqs)  # [n, T, 3H]
    # pair i = (g_i, x_{i+1}) predicts x_{i+2}: the target's distribution at position i + 1 (on the draft ids)
    labels = probs[:, 1:, ids]
    labels = labels / labels.sum(-1, keepdim=True)
    opt = torch.optim.Adam(params.values(), lr=2e-2)
    for _ in range(steps):
        logits, _ = ref.pairs(ref.project(feats[:, :-1]), seqs[:, 1:])
        loss = -(labels * logits.log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    out = {k: params[k].detach().contiguous() if k in params else v for k, v in w.items()}
    save_file(out, str(folder / "model.safetensors"))
    return folder


# --- fixtures ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def one_thread():
    """Session fixtures run before tests/conftest.py's per-test `torch.set_num_threads(1)`: a second thread costs
    far more than it gives on these tiny models on a busy machine (see TEST_THREADS there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def target() -> LoadedModel:
    """The 4-layer tiny target, shared: tests must not change its weights."""
    return four_layer_target()


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory) -> Path:
    """A random EAGLE-3 head (SafeAILab layout, draft vocabulary 24 of 32, aux layers (0, 2, 4)): sharp logits."""
    return save_eagle3(tmp_path_factory.mktemp("eagle3") / "head", V, DRAFT_VOCAB, AUX)


@pytest.fixture(scope="session")
def flat_head_dir(tmp_path_factory) -> Path:
    """The random head with its output layer scaled by FLAT: q close to uniform over the 24 draft ids, drafts
    accepted about half the time at temperature 1, and a zero-filled row (`head-full-vocab`) gives the 8 ids outside
    the draft vocabulary ~25% of its mass."""
    return scale_output_layer(save_eagle3(tmp_path_factory.mktemp("eagle3-flat") / "head", V, DRAFT_VOCAB, AUX), FLAT)


@pytest.fixture(scope="session")
def trained_head_dir(tmp_path_factory, target) -> Path:
    """A head distilled from the target (`distil_eagle3`): greedy drafts accepted often."""
    with one_thread():
        return distil_eagle3(tmp_path_factory.mktemp("eagle3-trained") / "head", target)
