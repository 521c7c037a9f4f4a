"""Hidden-state draft heads as pure torch forwards (cache, masks and positions come through `attend`): EAGLE-3,
EAGLE-1/2 and MTP ("pair heads") and Medusa. A pair head at position i reads (e_{i+1}, h_i): the embedding of x_{i+1}
and the target's hidden state at x_i (`project`) where computed, else the head's own output at i (`step`'s second
output); its logits are the draft distribution of x_{i+2} (EAGLE-3: over `draft_vocab_size` ids, target id i + d2t[i]).

  EAGLE-3 (Li et al. 2025):  g = fc([h_low; h_mid; h_high]),  a = Attn([norm_in(e); norm_h(g)]) + g,
                             o = MLP(norm_post(a)) + a,  logits = lm_head(norm(o)),  fed back: o
  EAGLE-1/2:                 x = fc([e; h]) (with bias), o = decoder layers(x) (layer 0 without its input norm),
                             logits = target lm_head(o),  fed back: o
  MTP (DeepSeek-V3 / Qwen3-Next):  x = eh_proj([enorm(e); hnorm(h)]),  o = decoder layer(x),
                             logits = head(norm(o)) (the target's head where the layer has none),  fed back: o
                             (DeepSeek-V3) or norm(o) (Qwen3-Next), as vLLM's MTP drafters do
  Medusa (Cai et al. 2024):  head k on h_t: lm_head_k(ResBlocks_k(h_t)) is the distribution of x_{t+k+2}.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

__all__ = ["Attend", "MedusaHeads", "PairHead", "rms_norm", "rotate"]

Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]  # (layer, q, k, v [B, heads, T, D]) -> [B, nh, T, D]
PAIR_KINDS = ("eagle3", "eagle", "mtp")


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """LlamaRMSNorm (weight None: no norm)."""
    if weight is None:
        return x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [B, heads, T, D] with cos / sin [B, 1, T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Layer(nn.Module):
    """One Llama-layout decoder layer; `in_features` is 2H for EAGLE-3's first layer (q/k/v read [e; h])."""

    def __init__(self, cfg: LlamaConfig, in_features: int, input_norm: bool, hidden_norm: bool):
        super().__init__()
        H, nh, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or H // nh
        bias = bool(getattr(cfg, "attention_bias", False))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(in_features, nh * D, bias=bias)
        self.self_attn.k_proj = nn.Linear(in_features, nkv * D, bias=bias)
        self.self_attn.v_proj = nn.Linear(in_features, nkv * D, bias=bias)
        self.self_attn.o_proj = nn.Linear(nh * D, H, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.input_layernorm = _Norm(H) if input_norm else None
        self.hidden_norm = _Norm(H) if hidden_norm else None
        self.post_attention_layernorm = _Norm(H)
        self.shape = (nh, nkv, D)
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, index: int, residual: Tensor) -> Tensor:
        """x [B, T, in_features] (already normed where the layout norms it), residual [B, T, H] -> [B, T, H]."""
        B, T, _ = x.shape
        nh, nkv, D = self.shape
        att = self.self_attn
        q = att.q_proj(x).view(B, T, nh, D)
        k = att.k_proj(x).view(B, T, nkv, D)
        v = att.v_proj(x).view(B, T, nkv, D)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        a = attend(index, rotate(q, cos, sin), rotate(k, cos, sin), v)  # [B, nh, T, D]
        h = residual + att.o_proj(a.transpose(1, 2).reshape(B, T, nh * D))
        m = self.mlp
        y = rms_norm(h, self.post_attention_layernorm.weight, self.eps)
        return h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))


class _Norm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class PairHead(nn.Module):
    """EAGLE-3, EAGLE-1/2 or MTP (`kind`): see the module docstring. cfg: the head's transformer config (hidden
    size, heads, layers, rope); feature_size: the width of what `project` reads (EAGLE-3: len(aux layers) x the
    target's hidden size); draft_vocab: its output ids (EAGLE-3: draft_vocab_size; else the target's vocabulary,
    or 0 for a head that uses the target's output layer, given as `target_head`)."""

    def __init__(self, kind: str, cfg: LlamaConfig, feature_size: int, draft_vocab: int, *, layers: tuple[int, ...]):
        super().__init__()
        if kind not in PAIR_KINDS:
            raise ValueError(f"kind must be one of {', '.join(PAIR_KINDS)}, got {kind!r}")
        H = cfg.hidden_size
        self.kind, self.config, self.layers_read = kind, cfg, tuple(layers)
        self.aux_ids = tuple(layers) or None  # EAGLE-3: the checkpoint's ids (None: the default, set per target)
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        if kind == "eagle3":
            self.fc = nn.Linear(feature_size, H, bias=False)
            first = _Layer(cfg, 2 * H, input_norm=True, hidden_norm=True)
        elif kind == "eagle":
            self.fc = nn.Linear(2 * H, H, bias=True)
            first = _Layer(cfg, H, input_norm=False, hidden_norm=False)
        else:
            self.enorm, self.hnorm = _Norm(H), _Norm(H)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
            first = _Layer(cfg, H, input_norm=True, hidden_norm=False)
        rest = [_Layer(cfg, H, input_norm=True, hidden_norm=False) for _ in range(cfg.num_hidden_layers - 1)]
        self.layers = nn.ModuleList([first, *rest])
        self.norm = _Norm(H) if kind != "eagle" else None
        self.lm_head = nn.Linear(H, draft_vocab, bias=False) if draft_vocab else None
        eagle3 = kind == "eagle3"  # (only EAGLE-3 checkpoints carry d2t)
        self.register_buffer("d2t", torch.zeros(draft_vocab if eagle3 else 0, dtype=torch.int64), persistent=eagle3)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.embed: Tensor | None = None  # [V, H]: the target's input embedding (shared), set by the loader
        self.target_head: nn.Module | None = None  # the target's output layer where the head has none
        self.feed_normed = False  # MTP: feed back norm(o) instead of o (Qwen3-Next; DeepSeek-V3 feeds o)
        self.norm_before_residual = False  # EAGLE-3: the residual around attention is norm_h(g), not g

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(kv heads, head dim) of every layer's cache."""
        _, nkv, D = self.layers[0].shape
        return nkv, D

    def project(self, features: Tensor) -> Tensor:
        """The target's captured hidden states [..., feature_size] -> the head's hidden input [..., H]."""
        return self.fc(features) if self.kind == "eagle3" else features

    def step(self, tokens: Tensor, hidden: Tensor, positions: Tensor, attend: Attend) -> tuple[Tensor, Tensor]:
        """tokens [B, T] (x_{i+1}), hidden [B, T, H] (for position i), positions [B, T] -> (draft logits [B, T, V_d],
        the hidden state fed back [B, T, H])."""
        e = F.embedding(tokens, self.embed).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        first, eps = self.layers[0], self.eps
        if self.kind == "eagle3":
            g = rms_norm(hidden, first.hidden_norm.weight, eps)
            x = torch.cat([rms_norm(e, first.input_layernorm.weight, eps), g], -1)
            h = first(x, cos, sin, attend, 0, g if self.norm_before_residual else hidden)
        elif self.kind == "eagle":
            x = self.fc(torch.cat([e, hidden], -1))
            h = first(x, cos, sin, attend, 0, x)
        else:
            pair = [rms_norm(e, self.enorm.weight, eps), rms_norm(hidden, self.hnorm.weight, eps)]
            x = self.eh_proj(torch.cat(pair, -1))
            h = first(rms_norm(x, first.input_layernorm.weight, eps), cos, sin, attend, 0, x)
        for i, layer in enumerate(self.layers[1:], 1):
            h = layer(rms_norm(h, layer.input_layernorm.weight, eps), cos, sin, attend, i, h)
        out = rms_norm(h, self.norm.weight if self.norm is not None else None, eps)
        if self.lm_head is not None:
            logits = self.lm_head(out)
        else:  # the target's output layer, in the target's dtype
            logits = self.target_head(out.to(self.target_head.weight.dtype))
        return logits, out if self.feed_normed else h


class MedusaHeads(nn.Module):
    """K Medusa heads on the target's last (normed) hidden state: head k = `num_layers` residual blocks
    (x + SiLU(W x + b)) and an output layer; its softmax is the distribution of the token k + 2 ahead."""

    def __init__(self, hidden_size: int, vocab: int, num_heads: int, num_layers: int, bias: bool = True):
        super().__init__()
        blocks = [[nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)] for _ in range(num_heads)]
        self.blocks = nn.ModuleList([nn.ModuleList(b) for b in blocks])
        self.lm_heads = nn.ModuleList([nn.Linear(hidden_size, vocab, bias=False) for _ in range(num_heads)])
        self.layers_read = (-1,)  # the final norm's output (NORMED)
        self.logit_scale = 1.0  # vLLM's `logit_scale`

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    def head(self, k: int, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> head k's logits [..., V]."""
        x = hidden
        for lin in self.blocks[k]:
            x = x + F.silu(lin(x))
        logits = self.lm_heads[k](x)
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale
