"""MTP layers in a target's own checkpoint (DeepSeek-V3 and Qwen3-Next layouts): the forward against vLLM's equations,
greedy equality with plain decoding, the target's law at temperature 1, the entry points, and bad checkpoints.

Reference (DeepSeek-V3 report §2.2; vLLM's `deepseek_mtp.py` / `qwen3_next_mtp.py`), from the checkpoint's raw
tensors: the pair at position i reads e = E(x_{i+1}) and h_i, the target's final normed hidden state:
x = eh_proj([RMSNorm_e(e); RMSNorm_h(h)]) (Qwen3-Next: fc, pre_fc_norm_embedding / _hidden), o = a Llama decoder
layer over x, logits = head(RMSNorm(o)) — DeepSeek-V3: `shared_head.norm` and `shared_head.head`; Qwen3-Next:
`mtp.norm` and the target's lm_head. Drafting unrolls the layer on its own output: DeepSeek-V3 feeds back o,
Qwen3-Next RMSNorm(o) (what vLLM's drafters feed). The embedding is the target's, or the layer's own
`embed_tokens` where the checkpoint has one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.heads import HeadLoadError, LoadedHead, head_kind, load_head, mtp_head
from verispec.model.loading import LoadedModel, load_model
from verispec.sampling import SamplingParams

from ..helpers.heads import H, mtp_layer_tensors, save_mtp_deepseek, save_mtp_qwen3next
from ..helpers.tiny import V, make_model, make_tokenizer
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
    rms,
    sample,
    session_run,
    tensors,
)

LAYOUTS = ("deepseek", "deepseek-embed", "qwen3next")


@pytest.fixture(scope="module")
def model():
    return make_model(0, layers=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, model) -> dict[str, Path]:
    """The random target saved with each layout's MTP layer (random weights; deepseek-embed: with its own embedding,
    not the target's)."""
    base = tmp_path_factory.mktemp("mtp")
    own = torch.randn(V, H, generator=torch.Generator().manual_seed(7)) * 0.5
    return {
        "deepseek": save_mtp_deepseek(base / "deepseek", model, seed=1),
        "deepseek-embed": save_mtp_deepseek(base / "deepseek-embed", model, seed=2, embed=own),
        "qwen3next": save_mtp_qwen3next(base / "qwen3next", model, seed=3),
    }


def reference(layout: str, folder: Path, model):
    """(forward, embedding) of the layout's MTP layer, from the checkpoint's tensors."""
    L = model.config.num_hidden_layers
    if layout == "qwen3next":
        w = tensors(folder, "mtp.")
        names = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight", "layers.0.", "norm.weight")
        head = model.lm_head.weight.detach().double()
    else:
        w = tensors(folder, f"model.layers.{L}.")
        names = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "", "shared_head.norm.weight")
        head = w["shared_head.head.weight"]
    e_norm, h_norm, proj, block, norm = names

    def forward(e, h, pos):
        x = torch.cat([rms(e, w[e_norm]), rms(h, w[h_norm])], -1) @ w[proj].T
        o = decoder_layer(w, block, x, pos)
        out = rms(o, w[norm])
        return out @ head.T, (out if layout == "qwen3next" else o)

    return forward, (w["embed_tokens.weight"] if "embed_tokens.weight" in w else embed(model))


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_the_reference(layout, runner, dirs, model):
    forward, E = reference(layout, dirs[layout], model)
    check_pair_head(model, dirs[layout], runner, forward, E)


# --- entry points ---------------------------------------------------------------------------------------------------
def test_a_checkpoint_with_an_mtp_layer_loads_as_the_model(dirs, model):
    """load_model gives the target (transformers ignores the extra tensors); load_head and draft=mtp give the layer."""
    folder = dirs["deepseek"]
    assert head_kind(folder) == "mtp"
    target = load_model(str(folder))
    assert not isinstance(target, LoadedHead) and isinstance(target.model, torch.nn.Module)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, model(ids).logits)
    head = load_head(folder)
    assert head.kind == "mtp" and not head.embedded
    own = mtp_head(target)
    assert own.kind == "mtp" and Path(own.name) == folder
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="mtp", gamma=2))
    assert gen.config.draft == "mtp" and gen.core.proposer.name == "mtp-head"
    assert str(SpecConfig(draft="mtp", tree="2-2")) == "draft=mtp,gamma=auto,tree=2-2,verify=deterministic,random=auto"
    out = gen.generate([[3, 4, 5]], SamplingParams(temperature=0.0), max_new_tokens=6, ignore_eos=True)
    assert out[0].token_ids == greedy_reference(model, [3, 4, 5], 6)


def test_draft_mtp_errors(dirs, model, tmp_path):
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    target = LoadedModel(model, make_tokenizer(), str(plain))
    with pytest.raises(HeadLoadError, match=r"does not describe an MTP layer \(num_nextn_predict_layers"):
        SpeculativeGenerator(target, config=SpecConfig(draft="mtp"))
    with pytest.raises(HeadLoadError, match="neither a local directory nor in the Hugging Face cache"):
        mtp_head(LoadedModel(model, target.tokenizer, "no-such-org/no-such-model"))
    with pytest.raises(ValueError, match="quant"):
        SpecConfig(draft="mtp", quant="int8")
    with pytest.raises(ValueError, match="model"):
        SpecConfig(draft="mtp", model="org/m")


def test_the_cli_flag_is_draft_mtp(dirs, capsys):
    """`--draft mtp` (or `--spec draft=mtp`) drafts with the layer in --target's own checkpoint."""
    from ..helpers.cli import run_verispec

    target = ["generate", "a b c", "--target", dirs["deepseek"], "--max-new-tokens", "4", "--temperature", "0"]
    for flags in (["--draft", "mtp", "--gamma", "2"], ["--spec", "draft=mtp,tree=2-1"]):
        done = run_verispec(target + flags, capsys)
        assert done.returncode == 0, done.stderr
        assert "spec draft=mtp," in done.stderr
    done = run_verispec(target + ["--draft", "mtp", "--spec", "quant=int8"], capsys)
    assert done.returncode == 2 and "quant applies to a draft model or --draft self, not to --draft mtp" in done.stderr


# --- greedy equality ------------------------------------------------------------------------------------------------
def agreeing_layer(model, seed: int = 0) -> dict:
    """An MTP layer that mostly agrees with `bigram_target`: eh_proj passes the normed embedding on (and a little of
    h), the block adds little, the head is the target's output layer: logits ~ the target's after x_{i+1}."""
    t = mtp_layer_tensors(V, seed)
    g = torch.Generator().manual_seed(seed)
    t["eh_proj.weight"] = torch.cat([torch.eye(H), 0.05 * torch.randn(H, H, generator=g)], 1)
    t["self_attn.o_proj.weight"] = t["self_attn.o_proj.weight"] * 0.1
    t["mlp.down_proj.weight"] = t["mlp.down_proj.weight"] * 0.1
    t["enorm.weight"], t["shared_head.norm.weight"] = torch.ones(H), torch.ones(H)
    t["shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return t


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """(target, {layout: the MTP layer loaded from its checkpoint}) for the greedy and law tests."""
    model = bigram_target()
    base = tmp_path_factory.mktemp("mtp-agree")
    layer = agreeing_layer(model)
    heads = {
        "deepseek": load_head(save_mtp_deepseek(base / "deepseek", model, tensors=layer)),
        "qwen3next": load_head(save_mtp_qwen3next(base / "qwen3next", model, tensors=layer)),
    }
    return model, heads


PROMPTS = [[3, 17, 8, 22, 5, 11], [9], [9, 4, 30], [3, 17, 8, 22, 5, 11], [14, 6, 25, 7, 19, 12, 28, 10]]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", ["deepseek", "qwen3next"])
def test_greedy_equals_plain_decoding(layout, runner, bigram):
    """Chains (gamma 3) and a static tree (2-2) over a batch of prompts of different lengths (one of a single token,
    one twice), then a session of at most two rows where rows leave and join: plain decoding's tokens, with most
    drafts accepted (the layer agrees with the target) and some rejected."""
    model, heads = bigram
    n = 16
    want = [greedy_reference(model, p, n) for p in PROMPTS]
    for spec in (dict(gamma=3), dict(tree="2-2")):
        gen = SpeculativeGenerator(
            loaded(model), heads[layout], config=SpecConfig(draft="model", runner=runner, **spec)
        )
        assert greedy_run(gen, PROMPTS, n) == want, spec
        s = gen.last_stats
        assert 0.3 * s.drafted < s.accepted < s.drafted, (spec, s.drafted, s.accepted)
    gen = SpeculativeGenerator(loaded(model), heads[layout], config=SpecConfig(draft="model", gamma=3, runner=runner))
    budgets = [10, 4, 12, 6, 8]
    got = session_run(gen, PROMPTS, budgets, max_batch=2)
    assert got == [w[:b] for w, b in zip(want, budgets)]


# --- bad checkpoints ------------------------------------------------------------------------------------------------
def _deepseek(tmp_path, model, change=None, config=None) -> Path:
    t = mtp_layer_tensors(V, 0)
    if change:
        change(t)
    folder = save_mtp_deepseek(tmp_path / "bad", model, tensors=t)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _drop(name):
    return lambda t: t.pop(name)


def _mla(t):
    for k in [k for k in t if k.startswith("self_attn.")]:
        t.pop(k)
    t["self_attn.q_a_proj.weight"] = torch.zeros(16, H)
    t["self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(24, H)


def _moe(t):
    for k in [k for k in t if k.startswith("mlp.")]:
        t.pop(k)
    t["mlp.gate.weight"] = torch.zeros(4, H)
    t["mlp.experts.0.gate_proj.weight"] = torch.zeros(8, H)


@pytest.mark.parametrize(
    "change, config, message",
    [
        (_drop("eh_proj.weight"), None, r"missing tensor\(s\) eh_proj\.weight"),
        (_drop("self_attn.q_proj.weight"), None, r"missing tensor\(s\) layers\.0\.self_attn\.q_proj\.weight"),
        (lambda t: t.update({"eh_proj.weight": torch.zeros(H, H)}), None, r"'eh_proj\.weight' has shape \[32, 32\]"),
        (lambda t: t.update({"extra.weight": torch.zeros(2)}), None, r"unexpected tensor\(s\) layers\.0\.extra"),
        (_mla, None, "multi-head latent attention"),
        (_moe, None, "mixture of experts"),
        (None, {"num_nextn_predict_layers": 1, "num_hidden_layers": 9}, r"no 'model\.layers\.9\.\*' tensors exist"),
    ],
)
def test_bad_checkpoints_are_clear_errors(change, config, message, model, tmp_path):
    with pytest.raises(HeadLoadError, match=message):
        load_head(_deepseek(tmp_path, model, change, config))


def test_bad_qwen3next_checkpoints(model, tmp_path):
    folder = save_mtp_qwen3next(tmp_path / "q", model)
    f = folder / "model.safetensors"
    t = load_file(str(f))
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, str(f), metadata={"format": "pt"})
    with pytest.raises(HeadLoadError, match=r"no 'mtp\.\*' tensors exist"):
        load_head(folder)
    real = save_mtp_qwen3next(tmp_path / "real", model)
    cfg = json.loads((real / "config.json").read_text())
    (real / "config.json").write_text(json.dumps(cfg | {"model_type": "qwen3_next"}))
    with pytest.raises(HeadLoadError, match="Qwen3-Next's MTP layer"):
        load_head(real)


def test_a_target_of_another_hidden_size_is_refused(dirs):
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = LlamaForCausalLM(
        LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    with pytest.raises(HeadLoadError, match="hidden size is 32, the target's 48"):
        SpeculativeGenerator(loaded(wide), load_head(dirs["deepseek"]), config=SpecConfig(draft="model", gamma=2))


# --- the target's law -----------------------------------------------------------------------------------------------
PROMPT = [3, 17, 8]
N, N_SLOW = 3000, 20_000
CONFIGS = {
    "chain": "draft=model,gamma=3,stop_below=none,random=stream",
    "tree-iid": "draft=model,tree=2-2,verify=iid,random=stream",
    "block": "draft=model,gamma=3,stop_below=none,verify=block,random=stream",
    "auto-seeded-tree": "draft=model,tree=2-2,verify=iid",  # every request seeded: Gumbel-coupled
}


@pytest.fixture(scope="module")
def law(bigram):
    return exact_law(bigram[0], PROMPT, SamplingParams(temperature=1.0))


@pytest.mark.statistical
@pytest.mark.parametrize(
    "layout, name, n",
    [pytest.param("deepseek", "chain", N, id="deepseek-chain")]
    + [
        pytest.param(layout, c, N, id=f"{layout}-{c}", marks=pytest.mark.slow)
        for layout in ("deepseek", "qwen3next")
        for c in CONFIGS
        if c != "chain"  # deepseek's: the default tier's; qwen3next's: the full-power one below
    ]
    + [pytest.param("qwen3next", "chain", N_SLOW, id="qwen3next-chain-large", marks=pytest.mark.slow)],
)
def test_law(layout, name, n, bigram, law):
    """Temperature 1: the outputs follow the target's law (chi-square, detectable TV 0.14 at N = 3000: see
    test_medusa.py's test_power, the same target and prompt). The slow tier runs every layout and configuration at
    N, and MTP's one full-power law test: the other layout's chain at N_SLOW (TV 0.08)."""
    model, heads = bigram
    gen = SpeculativeGenerator(loaded(model), heads[layout], config=SpecConfig.parse(CONFIGS[name]))
    check_law(gen, sample(gen, PROMPT, n), law, f"{layout} {name}")
