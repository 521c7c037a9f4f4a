"""EAGLE-1/2 heads: the forward against the paper's equations, greedy equality with plain decoding, the target's law at
temperature 1 (slow tier; the MTP and Medusa tests hold the default tier's), and bad checkpoints.

Reference (Li et al. 2024, "EAGLE", §4 and SafeAILab's `cnets.py`), from the checkpoint's raw tensors: the pair at
position i reads e = E(x_{i+1}) (the target's embedding, or the checkpoint's own `embed_tokens`) and f_i, the target's
final normed hidden state (what its lm_head reads); x = fc([e; f]) (with its bias), o = the decoder layers over x
(layer 0 without an input norm: attention reads x itself), logits = the target's lm_head(o), no final norm. Drafting
unrolls the head on its own o. Checkpoints: `model.safetensors` or `pytorch_model.bin`, names with or without
`model.`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import load_draft
from verispec.heads import HeadLoadError, LoadedHead, head_kind, load_head
from verispec.sampling import SamplingParams

from ..helpers.heads import H, save_eagle1
from ..helpers.tiny import V, make_model
from .hidden_ref import (
    RUNNERS,
    bigram_target,
    check_law,
    check_pair_head,
    decoder_layer,
    embed,
    exact_law,
    greedy_reference,
    greedy_run,
    loaded,
    sample,
    session_run,
    tensors,
)


def rewrite(folder: Path, change=None, bin_file: bool = False, prefix: str = "") -> Path:
    """Edit a saved head's tensors in place (change(t)), with names under `prefix`, as pytorch_model.bin if asked."""
    f = folder / "model.safetensors"
    t = load_file(str(f))
    if change:
        change(t)
    t = {prefix + k: v for k, v in t.items()}
    if bin_file:
        f.unlink()
        torch.save(t, folder / "pytorch_model.bin")
    else:
        save_file(t, str(f))
    return folder


@pytest.fixture(scope="module")
def model():
    return make_model(0, layers=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("eagle1")
    own = torch.randn(V, H, generator=torch.Generator().manual_seed(5)) * 0.5
    return {
        "one-layer": save_eagle1(base / "one", V, seed=1),
        "two-layers-bin": rewrite(save_eagle1(base / "two", V, layers=2, seed=2), bin_file=True, prefix="model."),
        "own-embedding": rewrite(
            save_eagle1(base / "emb", V, seed=3), lambda t: t.update({"embed_tokens.weight": own})
        ),
    }


def reference(folder: Path, model):
    if (folder / "pytorch_model.bin").exists():
        w = {k.removeprefix("model."): v.double() for k, v in torch.load(folder / "pytorch_model.bin").items()}
    else:
        w = tensors(folder)
    layers = 1 + max(int(k.split(".")[1]) for k in w if k.startswith("layers."))
    lm = model.lm_head.weight.detach().double()

    def forward(e, f, pos):
        o = torch.cat([e, f], -1) @ w["fc.weight"].T + w["fc.bias"]
        o = decoder_layer(w, "layers.0.", o, pos, input_norm=False)
        for i in range(1, layers):
            o = decoder_layer(w, f"layers.{i}.", o, pos)
        return o @ lm.T, o

    return forward, (w["embed_tokens.weight"] if "embed_tokens.weight" in w else embed(model))


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", ["one-layer", "two-layers-bin", "own-embedding"])
def test_forward_matches_the_reference(layout, runner, dirs, model):
    forward, E = reference(dirs[layout], model)
    check_pair_head(model, dirs[layout], runner, forward, E)


def test_load_model_gives_the_head(dirs):
    for layout, embedded in (("one-layer", False), ("two-layers-bin", False), ("own-embedding", True)):
        assert head_kind(dirs[layout]) == "eagle"
        head = load_draft(str(dirs[layout]))
        assert isinstance(head, LoadedHead) and head.kind == "eagle" and head.embedded == embedded
    assert load_head(dirs["two-layers-bin"]).model.num_layers == 2


# --- a head that agrees with the target -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """`bigram_target` and an EAGLE-1 head that mostly agrees with it: fc passes the embedding on (scaled to unit
    RMS, and a little of f), the layer adds little: logits ~ the target's lm_head at x_{i+1}'s embedding."""
    model = bigram_target()
    E = model.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(0)

    def agree(t):
        t["fc.weight"] = torch.cat([torch.eye(H) / E.pow(2).mean().sqrt(), 0.05 * torch.randn(H, H, generator=g)], 1)
        t["fc.bias"] = torch.zeros(H)
        t["layers.0.self_attn.o_proj.weight"] = t["layers.0.self_attn.o_proj.weight"] * 0.1
        t["layers.0.mlp.down_proj.weight"] = t["layers.0.mlp.down_proj.weight"] * 0.1

    folder = rewrite(save_eagle1(tmp_path_factory.mktemp("eagle1-agree") / "head", V), agree)
    return model, load_head(folder)


PROMPTS = [[3, 17, 8, 22, 5, 11], [9], [9, 4, 30], [3, 17, 8, 22, 5, 11], [14, 6, 25, 7, 19, 12, 28, 10]]


@pytest.mark.parametrize("runner", RUNNERS)
def test_greedy_equals_plain_decoding(runner, bigram):
    """Chains (gamma 3) and a static tree (2-2) over a batch of prompts of different lengths (one of a single token,
    one twice), then a session of at most two rows where rows leave and join: plain decoding's tokens, with many
    drafts accepted and some rejected."""
    model, head = bigram
    n = 16
    want = [greedy_reference(model, p, n) for p in PROMPTS]
    for spec in (dict(gamma=3), dict(tree="2-2")):
        gen = SpeculativeGenerator(loaded(model), head, config=SpecConfig(draft="model", runner=runner, **spec))
        assert greedy_run(gen, PROMPTS, n) == want, spec
        s = gen.last_stats
        assert 0.3 * s.drafted < s.accepted < s.drafted, (spec, s.drafted, s.accepted)
    gen = SpeculativeGenerator(loaded(model), head, config=SpecConfig(draft="model", gamma=3, runner=runner))
    budgets = [10, 4, 12, 6, 8]
    assert session_run(gen, PROMPTS, budgets, max_batch=2) == [w[:b] for w, b in zip(want, budgets)]


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize(
    "spec, n",
    [
        ("draft=model,gamma=3,stop_below=none,random=stream", 20_000),
        ("draft=model,tree=2-2,verify=iid,random=stream", 3000),
        ("draft=model,tree=dynamic-3-2-6,random=stream", 3000),
    ],
)
def test_law(spec, n, bigram):
    """Temperature 1: the outputs follow the target's law; the chain at N = 20 000 (the head's one full-power law
    test: detectable TV 0.08), the trees at N = 3000 (TV 0.14; test_medusa.py's test_power, the same target and
    prompt)."""
    model, head = bigram
    prompt = [3, 17, 8]
    law = exact_law(model, prompt, SamplingParams(temperature=1.0))
    gen = SpeculativeGenerator(loaded(model), head, config=SpecConfig.parse(spec))
    check_law(gen, sample(gen, prompt, n), law, spec)


# --- bad checkpoints ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("fc.bias"), r"missing tensor\(s\) fc\.bias"),
        (lambda t: t.pop("layers.0.mlp.up_proj.weight"), r"missing tensor\(s\) layers\.0\.mlp\.up_proj\.weight"),
        (
            lambda t: t.update({"fc.weight": torch.zeros(H, H)}),
            r"'fc\.weight' has shape \[32, 32\], expected \[32, 64\]",
        ),
        (
            lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(H)}),
            r"unexpected tensor\(s\) layers\.0\.input_layernorm\.weight",
        ),
        (lambda t: t.update({"embed_tokens.weight": torch.zeros(V, 16)}), r"embedding has shape \[32, 16\]"),
    ],
)
def test_bad_checkpoints_are_clear_errors(change, message, tmp_path, model):
    folder = rewrite(save_eagle1(tmp_path / "bad", V), change)
    with pytest.raises(HeadLoadError, match=message):
        SpeculativeGenerator(loaded(model), load_head(folder), config=SpecConfig(draft="model", gamma=2))


def test_bad_configs_and_targets(tmp_path, dirs):
    folder = save_eagle1(tmp_path / "cfg", V)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"num_attention_heads": None}))
    with pytest.raises(HeadLoadError, match="positive integer 'num_attention_heads'"):
        load_head(folder)
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = LlamaForCausalLM(
        LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    with pytest.raises(HeadLoadError, match="the head's hidden size is 32, the target's 48"):
        SpeculativeGenerator(loaded(wide), load_head(dirs["one-layer"]), config=SpecConfig(draft="model", gamma=2))
    with pytest.raises(ValueError, match="draft=mtp drafts with an MTP layer"):  # draft=mtp reads the target's own
        SpeculativeGenerator(loaded(make_model(0)), load_head(dirs["one-layer"]), config=SpecConfig(draft="mtp"))
