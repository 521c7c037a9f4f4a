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
    if aux is not None:  # aux: the inputs of these layers; SafeAILab / SpecForge name the outputs before them
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
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


# --- Medusa and MTP (tests/heads/test_medusa.py, test_mtp.py) -------------------------------------------------------


def medusa_tensors(vocab: int, heads: int = 3, layers: int = 1, seed: int = 0, scale: float = 1.0) -> dict:
    """FasterDecoding's names: head k = `{k}.{j}.linear.*` (ResBlocks: x + SiLU(W x + b)), `{k}.{layers}.weight`."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for k in range(heads):
        for j in range(layers):
            t[f"{k}.{j}.linear.weight"] = _rand(H, H, g=g)
            t[f"{k}.{j}.linear.bias"] = _rand(H, g=g)
        t[f"{k}.{layers}.weight"] = _rand(vocab, H, scale=scale, g=g)
    return t


def save_medusa(
    folder: Path,
    vocab: int,
    heads: int = 3,
    layers: int = 1,
    layout: str = "fasterdecoding",
    seed: int = 0,
    scale: float = 1.0,
    tensors: dict | None = None,
    weights: str = "safetensors",
    bias: bool = True,
) -> Path:
    """Medusa heads, FasterDecoding's layout (config.json with `medusa_num_heads` / `medusa_num_layers`,
    `medusa_lm_head.safetensors` (weights="pt": `medusa_lm_head.pt`) with `{k}.{j}.linear.*`, `{k}.{layers}.weight`)
    or vLLM's (`model_type: medusa`, `num_heads`, `blocks.{k}.layers.{j}.*`, `lm_heads.{k}.weight`; bias False:
    `medusa_fc_bias: false` and no biases). tensors: the FasterDecoding-named tensors to save instead of random ones."""
    folder.mkdir(parents=True, exist_ok=True)
    t = dict(tensors) if tensors is not None else medusa_tensors(vocab, heads, layers, seed, scale)
    if not bias:
        t = {k: v for k, v in t.items() if not k.endswith(".bias")}
    if layout == "fasterdecoding":
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    elif layout == "vllm":
        config = {
            "architectures": ["MedusaModel"],
            "model_type": "medusa",
            "hidden_size": H,
            "vocab_size": vocab,
            "num_heads": heads,
            "num_hidden_layers": layers,
            "medusa_fc_bias": bias,
        }
        renamed = {}
        for k, v in t.items():
            p = k.split(".")
            if len(p) == 4:  # {k}.{j}.linear.{weight,bias}
                renamed[f"blocks.{p[0]}.layers.{p[1]}.{p[3]}"] = v
            else:  # {k}.{layers}.weight
                renamed[f"lm_heads.{p[0]}.weight"] = v
        t = renamed
    else:
        raise ValueError(f"layout must be fasterdecoding or vllm, got {layout!r}")
    (folder / "config.json").write_text(json.dumps(config))
    if weights == "pt":
        torch.save(t, folder / "medusa_lm_head.pt")
    else:
        save_file(
            t, str(folder / ("medusa_lm_head.safetensors" if layout == "fasterdecoding" else "model.safetensors"))
        )
    return folder


def mtp_layer_tensors(vocab: int, seed: int = 0, head: bool = True) -> dict:
    """One MTP layer in DeepSeek-V3's names (without the `model.layers.{L}.` prefix): enorm, hnorm, eh_proj
    [H, 2H], a Llama-layout decoder layer, shared_head.norm and (head) shared_head.head [V, H]."""
    g = torch.Generator().manual_seed(seed)
    t = {
        "enorm.weight": 1 + _rand(H, scale=0.1, g=g),
        "hnorm.weight": 1 + _rand(H, scale=0.1, g=g),
        "eh_proj.weight": _rand(H, 2 * H, g=g),
    }
    t.update(_layer("", H, g))
    t["shared_head.norm.weight"] = 1 + _rand(H, scale=0.1, g=g)
    if head:
        t["shared_head.head.weight"] = _rand(vocab, H, scale=1.0, g=g)
    return t


def _save_target(folder: Path, model, config_extra: dict, tensors: dict) -> Path:
    """model saved with save_pretrained (and the tiny tokenizer), then `tensors` added to its safetensors file and
    `config_extra` to its config.json (what transformers ignores at load)."""
    from safetensors.torch import load_file

    from .tiny import make_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer().save_pretrained(folder)
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files
    saved = load_file(str(files[0]))
    saved.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(saved, str(files[0]), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config_extra)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def save_mtp_deepseek(
    folder: Path, model, seed: int = 0, tensors: dict | None = None, embed: torch.Tensor | None = None
) -> Path:
    """A target checkpoint (the tiny Llama `model`, save_pretrained) with a DeepSeek-V3-style MTP layer:
    `num_nextn_predict_layers: 1` in config.json, tensors `model.layers.{L}.*` (L = the target's layer count;
    `mtp_layer_tensors`, or `tensors` in those names; embed: the layer's own `embed_tokens` [V, H])."""
    L = model.config.num_hidden_layers
    t = dict(tensors) if tensors is not None else mtp_layer_tensors(model.config.vocab_size, seed)
    if embed is not None:
        t["embed_tokens.weight"] = embed
    return _save_target(
        folder, model, {"num_nextn_predict_layers": 1}, {f"model.layers.{L}.{k}": v for k, v in t.items()}
    )


def save_mtp_qwen3next(folder: Path, model, seed: int = 0, tensors: dict | None = None) -> Path:
    """A target checkpoint (the tiny Llama `model`) with a Qwen3-Next-style MTP layer: `mtp_num_hidden_layers: 1`,
    tensors `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm` (logits
    through the target's lm_head). tensors: DeepSeek-named ones (`mtp_layer_tensors`, renamed here)."""
    t = dict(tensors) if tensors is not None else mtp_layer_tensors(model.config.vocab_size, seed, head=False)
    names = {
        "eh_proj.weight": "fc.weight",
        "enorm.weight": "pre_fc_norm_embedding.weight",
        "hnorm.weight": "pre_fc_norm_hidden.weight",
        "shared_head.norm.weight": "norm.weight",
    }
    out = {}
    for k, v in t.items():
        if k == "shared_head.head.weight":
            continue
        out["mtp." + (names[k] if k in names else "layers.0." + k)] = v
    return _save_target(folder, model, {"mtp_num_hidden_layers": 1}, out)
