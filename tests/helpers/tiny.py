"""Tiny random models and a locally built tokenizer for engine tests (no downloads)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from verispec.model.loading import LoadedModel

V = 32
LONG_CONTEXT = 1 << 15  # the context of the long tiny target (tests/conftest.py: tiny_long_target)
WORDS = ["<unk>", "<s>", "</s>"] + [chr(97 + i) for i in range(26)] + ["x0", "x1", "x2"]  # 32 tokens
EOS = 2


def make_tokenizer(words=WORDS) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}x0{% endif %}"
    )
    return tok


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def make_model(
    seed: int,
    family: str = "llama",
    layers: int = 2,
    scale: float = 4.0,
    vocab: int = V,
    max_positions: int = 256,
    dtype=torch.float32,
    **extra,
) -> torch.nn.Module:
    """A random 2-layer model; `scale` sharpens the output layer so distributions are far from uniform.
    family: llama, qwen2 (q/k/v biases), qwen3 (q/k norms), mistral; `extra` goes to the config."""
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=EOS,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        kw["head_dim"] = 8
    config_cls, model_cls = FAMILIES[family]
    model = model_cls(config_cls(**kw, **extra))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model.to(dtype).eval()


def noisy_copy(model, eps: float, seed: int = 0) -> torch.nn.Module:
    """The same model with Gaussian noise on every weight: a draft that agrees often, not always."""
    import copy

    g = torch.Generator().manual_seed(seed)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(eps * torch.randn(p.shape, generator=g) * p.std())
    return twin


def loaded(seed: int, family: str = "llama", layers: int = 2, **kw) -> LoadedModel:
    return LoadedModel(make_model(seed, family, layers, **kw), make_tokenizer(), f"tiny-{family}-{seed}")


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int, eos: int | None = EOS) -> list[int]:
    """Plain greedy decoding with full forwards and no cache: independent of verispec's runner."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        if t == eos:
            break
        out.append(t)
        seq.append(t)
    return out
