"""The fast runner: verispec's own forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), over the weights
transformers loaded. Only the forward body differs from `HFRunner`: q/k/v and gate/up fused (the model's parameters
become views of them), every linear layer through `verispec.model.linear`, the output layer only for the shared
vocabulary, the model's own rotary embedding and `F.scaled_dot_product_attention`. In float32 its logits match
transformers' to ~1e-5 (tests: 1e-4): the target does not change. Quantized runners (bfloat16) are for drafts only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .linear import QUANT_MODES, Linear, make_linear, onednn_available
from .protocol import Runner
from .runner import HFRunner

__all__ = ["RUNNER_KINDS", "SUPPORTED_MODEL_TYPES", "FastRunner", "fast_path_unsupported", "make_runner"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _llamacpp_runner(model, vocab_size, runner, quant):
    from .llamacpp import LlamaCppRunner

    if not hasattr(model, "n_vocab"):
        raise ValueError("runner 'llamacpp' runs a GGUF file loaded by llama.cpp (load_model(..., backend='llamacpp'))")
    if runner not in ("auto", "llamacpp"):
        raise ValueError(f"a model loaded by llama.cpp runs on runner 'llamacpp', not {runner!r}")
    if quant is not None:
        raise ValueError("quant quantizes torch weights; a llama.cpp model runs in its GGUF file's own quantization")
    return LlamaCppRunner(model, vocab_size)


def fast_path_unsupported(model) -> str | None:
    """Why the fast runner cannot run this model (None when it can)."""
    if not isinstance(model, torch.nn.Module):
        return "it is a llama.cpp model"
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        return f"model type {mtype!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    base = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, attr):
            return f"the decoder has no {attr!r}"
    llama = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    if any(not hasattr(getattr(x, part, None), n) for x in base.layers for part, ns in llama.items() for n in ns):
        return "a decoder layer does not have the Llama layout (q/k/v/o_proj, gate/up/down_proj)"
    return None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class _Layer:
    ln_attn: Tensor  # [H]
    ln_mlp: Tensor  # [H]
    qkv: Linear  # H -> (n_heads + 2 n_kv) * D
    o: Linear  # n_heads * D -> H
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H
    q_norm: Tensor | None  # [D] (Qwen3)
    k_norm: Tensor | None
    mask_key: str  # "full_attention" | "sliding_attention"


@torch.no_grad()
def _fuse(modules, share: bool) -> tuple[Tensor, Tensor | None]:
    """The weights (and biases) of linear modules concatenated along the output dimension; `share` re-points the
    modules' parameters at views of it (nothing stored twice), which a second runner on the model then reuses."""
    cached = getattr(modules[0], "_verispec_fused", None)
    sizes = [m.weight.shape[0] for m in modules]
    if cached is not None and sum(sizes) == cached[0].shape[0]:
        views = cached[0].split(sizes)
        if all(m.weight.data_ptr() == v.data_ptr() and m.weight.shape == v.shape for m, v in zip(modules, views)):
            return cached
    weight = torch.cat([m.weight for m in modules])  # [sum N, K]
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, modules)]
        )
    if share:
        for m, w, b in zip(
            modules, weight.split(sizes), bias.split(sizes) if bias is not None else [None] * len(sizes)
        ):
            m.weight.data = w
            if m.bias is not None:
                m.bias.data = b
        object.__setattr__(modules[0], "_verispec_fused", (weight, bias))  # not a registered submodule / param
    return weight, bias


class FastRunner(HFRunner):
    """`HFRunner`'s interface and cache, with verispec's own Llama-family forward.

    quant: None, "int8" or "int4" — weight-only quantized copies of every linear layer including the output
    layer (the model's own weights are untouched; use for drafts, e.g. a self-draft from the target's
    weights). group_size: int4 group size (default: the largest of 128, 64, 32 dividing every layer's input).
    """

    verify_slope = 0.25  # memory-bound on CPUs (fp32) and GPUs: extra tokens cost a fraction of a step (engine.costs)

    def __init__(
        self, model, vocab_size: int | None = None, *, quant: str | None = None, group_size: int | None = None
    ):
        reason = fast_path_unsupported(model)
        if reason:
            raise ValueError(f"the fast runner does not support this model: {reason}")
        if quant is not None and quant not in QUANT_MODES:
            raise ValueError(f"quant must be None or one of {', '.join(QUANT_MODES)}, got {quant!r}")
        super().__init__(model, vocab_size)
        cfg = self.config
        self.quant, self.weight_dtype = quant, self.dtype
        if quant is not None:
            # torch's weight-only kernels are fast with bfloat16 activations only, on every CPU (measured on AVX2,
            # torch 2.13: float32 activations take a path 5-14x slower than the dense layer): the quantized layers
            # compute in bfloat16 and hand back the runner's dtype, which is bfloat16 only where the rest of the
            # forward is fast in it too (CUDA, or a CPU whose oneDNN has bf16)
            fast_bf16 = self.device.type == "cuda" or onednn_available(torch.bfloat16)
            self.dtype = torch.bfloat16 if fast_bf16 else torch.float32
        self.num_heads = cfg.num_attention_heads
        self.eps = getattr(cfg, "rms_norm_eps", 1e-6)
        base = self._base
        self.scaling = getattr(base.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        inputs = {self.hidden_size, self.num_heads * self.head_dim, cfg.intermediate_size}
        if quant == "int4" and group_size is None:
            group_size = next((g for g in (128, 64, 32) if all(k % g == 0 for k in inputs)), None)
            if group_size is None:
                raise ValueError(f"int4 needs layer input sizes {sorted(inputs)} divisible by 32")
        self.group_size = group_size

        def lin(weight, bias=None):
            return make_linear(weight, bias, quant=quant, act_dtype=torch.bfloat16, group_size=group_size or 128)

        self.layers = [self._layer(i, layer, lin, share=quant is None) for i, layer in enumerate(base.layers)]
        self.intermediate = cfg.intermediate_size
        self.final_norm = self._cast(base.norm.weight)
        self.embed = base.embed_tokens.weight  # [V_rows, H], gathered then cast (never copied)
        head = self._head
        head_bias = None if getattr(head, "bias", None) is None else head.bias[: self.vocab_size]
        self.head = lin(head.weight[: self.vocab_size], head_bias)  # only the shared vocabulary's rows
        self.rotary = base.rotary_emb

    def _cast(self, t: Tensor) -> Tensor:
        return t.detach().to(self.dtype)

    def _layer(self, i: int, layer, lin, share: bool) -> _Layer:
        """Decoder layer i with fused q/k/v and gate/up weights (share: dense, the model's parameters become views of
        the fused weights; quantized: only the quantized copies remain)."""
        cfg = self.config
        types = list(getattr(cfg, "layer_types", None) or [])
        window = getattr(cfg, "sliding_window", None)
        att, mlp = layer.self_attn, layer.mlp
        qkv_w, qkv_b = _fuse([att.q_proj, att.k_proj, att.v_proj], share)
        gu_w, gu_b = _fuse([mlp.gate_proj, mlp.up_proj], share)
        kind = types[i] if i < len(types) else ("sliding_attention" if window else "full_attention")
        return _Layer(
            ln_attn=self._cast(layer.input_layernorm.weight),
            ln_mlp=self._cast(layer.post_attention_layernorm.weight),
            qkv=lin(qkv_w, qkv_b),
            o=lin(att.o_proj.weight, att.o_proj.bias),
            gate_up=lin(gu_w, gu_b),
            down=lin(mlp.down_proj.weight, mlp.down_proj.bias),
            q_norm=self._cast(att.q_norm.weight) if hasattr(att, "q_norm") else None,
            k_norm=self._cast(att.k_norm.weight) if hasattr(att, "k_norm") else None,
            mask_key=kind,
        )

    @property
    def kernels(self) -> dict[str, int]:
        """Which matmul kernels run, with counts (e.g. {"onednn": 113})."""
        return dict(Counter(lin.kernel for lin in self._linears()))

    def _linears(self) -> list[Linear]:
        return [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (linear layers, norms; one embedding row is negligible)."""
        norms = sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.ln_attn, layer.ln_mlp))
        return sum(lin.nbytes for lin in self._linears()) + norms

    def _body(self, ids: Tensor, masks, position_ids: Tensor) -> Tensor:
        B, T = ids.shape
        nh, nkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        h = F.embedding(ids, self.embed).to(self.dtype)  # [B, T, H]
        cos, sin = self.rotary(h, position_ids)  # [B, T, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        if not isinstance(masks, dict):
            masks = {"full_attention": masks, "sliding_attention": masks}
        cache, grab = self.cache, self.capture  # hidden states to keep (`capture_hidden`): grabbed here, no hooks
        self._grabbed = {}
        for i, layer in enumerate(self.layers):
            if i in grab:
                self._grabbed[i] = h
            x = _rms_norm(h, layer.ln_attn, self.eps)
            q, k, v = layer.qkv(x).split([nh * D, nkv * D, nkv * D], dim=-1)
            q, k, v = q.view(B, T, nh, D), k.view(B, T, nkv, D), v.view(B, T, nkv, D)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm, self.eps), _rms_norm(k, layer.k_norm, self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.update(k, v, i)  # [B, nkv, L, D]: the used prefix, this chunk included
            a = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=masks[layer.mask_key], scale=self.scaling, enable_gqa=nh != nkv
            )  # [B, nh, T, D]
            h = h + layer.o(a.transpose(1, 2).reshape(B, T, nh * D))
            x = _rms_norm(h, layer.ln_mlp, self.eps)
            gate, up = layer.gate_up(x).split([self.intermediate, self.intermediate], dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        if len(self.layers) in grab:
            self._grabbed[len(self.layers)] = h
        return _rms_norm(h, self.final_norm, self.eps)

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden).float()  # [..., vocab_size]


RUNNER_KINDS = ("auto", "fast", "hf", "llamacpp")


def make_runner(model, vocab_size: int | None = None, *, runner: str = "auto", quant: str | None = None) -> Runner:
    """The runner for a model. runner: "auto" (llama.cpp for a model loaded with backend="llamacpp"; else the fast
    runner where the architecture is supported, else the transformers forward), "fast" (an error if unsupported),
    "hf" or "llamacpp" (a model loaded with backend="llamacpp"). quant (drafts only) needs the fast runner."""
    if runner not in RUNNER_KINDS:
        raise ValueError(f"runner must be one of {', '.join(RUNNER_KINDS)}, got {runner!r}")
    if quant is not None and quant not in QUANT_MODES:
        raise ValueError(f"quant must be None or one of {', '.join(QUANT_MODES)}, got {quant!r}")
    on_llamacpp = not isinstance(model, torch.nn.Module)
    if on_llamacpp or runner == "llamacpp":
        return _llamacpp_runner(model, vocab_size, runner, quant)
    if runner == "hf":
        if quant is not None:
            raise ValueError("quantized drafts need the fast runner (runner='hf' was asked for)")
        return HFRunner(model, vocab_size)
    reason = fast_path_unsupported(model)
    if reason is None:
        return FastRunner(model, vocab_size, quant=quant)
    if runner == "fast" or quant is not None:
        what = "quantized drafts need the fast runner, which" if quant is not None else "the fast runner"
        raise ValueError(f"{what} does not support this model: {reason}")
    return HFRunner(model, vocab_size)
