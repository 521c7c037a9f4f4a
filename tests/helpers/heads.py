"""Random-weight heads saved in the published layouts (as vLLM's own tests build them): EAGLE-3 (SafeAILab /
SpecForge and `speculators`), EAGLE-1, Medusa (FasterDecoding and vLLM) and MTP layers in a target checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, HEADS, KV, INTER = 32, 4, 2, 64  # the tiny target's sizes (tests/helpers/tiny.py)


def _rand(*shape, scale=0.2, g=None):
    return torch.randn(*shape, generator=g) * scale


def _layer(prefix: str, in_features: int, g, input_norm: bool = True) -> dict:
    D = H // HEADS
    t = {
        f"{prefix}self_attn.q_proj.weight": _rand(HEADS * D, in_features, g=g),
        f"{prefix}self_attn.k_proj.weight": _rand(KV * D, in_features, g=g),
        f"{prefix}self_attn.v_proj.weight": _rand(KV * D, in_features, g=g),
        f"{prefix}self_attn.o_proj.weight": _rand(H, HEADS * D, g=g),
        f"{prefix}mlp.gate_proj.weight": _rand(INTER, H, g=g),
        f"{prefix}mlp.up_proj.weight": _rand(INTER, H, g=g),
        f"{prefix}mlp.down_proj.weight": _rand(H, INTER, g=g),
        f"{prefix}post_attention_layernorm.weight": 1 + _rand(H, scale=0.1, g=g),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + _rand(H, scale=0.1, g=g)
    return t


def llama_config(vocab: int, **extra) -> dict:
    return dict(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        vocab_size=vocab,
        **extra,
    )


def draft_vocab_map(vocab: int, draft_vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [V_d] offsets: target id = i + d2t[i], t2d [V] bool) for a random sorted subset of the target's ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab), t2d


def eagle3_tensors(vocab: int, draft_vocab: int, n_aux: int = 3, seed: int = 0, scale: float = 3.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = draft_vocab_map(vocab, draft_vocab, seed)
    t = {"fc.weight": _rand(H, n_aux * H, g=g)}
    t.update(_layer("midlayer.", 2 * H, g))
    t["midlayer.hidden_norm.weight"] = 1 + _rand(H, scale=0.1, g=g)
    t["norm.weight"] = 1 + _rand(H, scale=0.1, g=g)
    t["lm_head.weight"] = _rand(draft_vocab, H, scale=scale, g=g)
    t["d2t"], t["t2d"] = d2t, t2d
    return t


def save_eagle3(folder: Path, vocab: int, draft_vocab: int = 24, aux=(0, 2, 4), seed: int = 0, **cfg) -> Path:
    """An EAGLE-3 head in the SafeAILab / SpecForge layout (config.json + model.safetensors)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(
        vocab, architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=draft_vocab
    )
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    config.update(cfg)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        eagle3_tensors(vocab, draft_vocab, 3 if aux is None else len(aux), seed), str(folder / "model.safetensors")
    )
    return folder


def save_speculators_eagle3(folder: Path, vocab: int, draft_vocab: int = 24, aux=(0, 2, 4), seed: int = 0) -> Path:
    """The same head in vLLM's `speculators` layout (transformer_layer_config, layers.0.*)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": llama_config(vocab, model_type="llama"),
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(aux),
        "norm_before_residual": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    t = eagle3_tensors(vocab, draft_vocab, len(aux), seed)
    t = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in t.items()}
    save_file(t, str(folder / "model.safetensors"))
    return folder


def save_eagle1(folder: Path, vocab: int, layers: int = 1, seed: int = 0) -> Path:
    """An EAGLE-1 head: a Llama config, fc [H, 2H] with bias, layers.{i}.* (layer 0 without input norm)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    config = llama_config(vocab, architectures=["LlamaForCausalLM"], model_type="llama")
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    t = {"fc.weight": _rand(H, 2 * H, g=g), "fc.bias": _rand(H, g=g)}
    for i in range(layers):
        t.update(_layer(f"layers.{i}.", H, g, input_norm=i > 0))
    save_file(t, str(folder / "model.safetensors"))
    return folder
