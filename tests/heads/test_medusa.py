"""Medusa heads (FasterDecoding's and vLLM's layouts): the forward against the paper's equations, greedy equality with
plain decoding, the target's law at temperature 1 (and a broken drafter that fails it), depth limits, bad checkpoints.

Reference (Cai et al. 2024, "Medusa", §2.1.1; vLLM's `medusa.py`), from the checkpoint's raw tensors: h_t is the
target's last normed hidden state (the last token the target holds: the one before the pending token x_{t+1});
head k = lm_head_k(ResBlock^n(h_t)), ResBlock(x) = x + SiLU(W x + b), is the distribution of x_{t+k+2}. A drafted
token d below the pending token (depth d: its chain index, or its tree depth) gets head d; past the last head, and
where the target holds no token yet (a one-token prompt's first step), the runner's logits are 0 (uniform).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from verispec.certify.stats import detectable_tv
from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import load_draft
from verispec.heads import HeadLoadError, LoadedHead, MedusaRunner, load_head
from verispec.sampling import SamplingParams
from verispec.sampling.tree import chain_parents

from ..helpers.heads import H, medusa_tensors, save_medusa
from ..helpers.tiny import V, make_model
from .hidden_ref import (
    LEVEL,
    P1,
    P2,
    P3,
    RUNNERS,
    bigram_target,
    chain_logits,
    check_law,
    close,
    exact_law,
    greedy_reference,
    greedy_run,
    loaded,
    paths,
    runners,
    sample,
    session_run,
    target_hidden,
    tensors,
    tree_logits,
)

K = 3  # heads
N, N_SLOW = 3000, 20_000
LAYOUTS = {  # name -> save_medusa's options
    "fasterdecoding": dict(layout="fasterdecoding"),
    "fasterdecoding-pt-2-layers": dict(layout="fasterdecoding", weights="pt", layers=2),
    "vllm": dict(layout="vllm"),
    "vllm-no-bias": dict(layout="vllm", bias=False),
}


@pytest.fixture(scope="module")
def model():
    return make_model(0, layers=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("medusa")
    return {
        name: save_medusa(base / name, V, heads=K, seed=i, **opts) for i, (name, opts) in enumerate(LAYOUTS.items())
    }


def raw_heads(folder: Path) -> list[tuple[list[tuple], torch.Tensor]]:
    """Per head: ([(W, b or None)] per residual block, lm_head weight), from the files (either layout)."""
    cfg = json.loads((folder / "config.json").read_text())
    if (folder / "medusa_lm_head.pt").exists():
        w = {k: v.double() for k, v in torch.load(folder / "medusa_lm_head.pt").items()}
    else:
        w = tensors(folder)
    out = []
    for k in range(cfg.get("medusa_num_heads") or cfg["num_heads"]):
        n = cfg.get("medusa_num_layers") or cfg.get("num_hidden_layers", 1)
        if "medusa_num_heads" in cfg:
            blocks = [(w[f"{k}.{j}.linear.weight"], w[f"{k}.{j}.linear.bias"]) for j in range(n)]
            out.append((blocks, w[f"{k}.{n}.weight"]))
        else:
            blocks = [(w[f"blocks.{k}.layers.{j}.weight"], w.get(f"blocks.{k}.layers.{j}.bias")) for j in range(n)]
            out.append((blocks, w[f"lm_heads.{k}.weight"]))
    return out


def reference(heads, h: torch.Tensor, depth: int) -> torch.Tensor:
    """Head `depth` on h [H] (zeros past the last head)."""
    if depth >= len(heads):
        return torch.zeros(V, dtype=torch.float64)
    blocks, lm = heads[depth]
    x = h
    for W, b in blocks:
        x = x + F.silu(x @ W.T + (b if b is not None else 0))
    return x @ lm.T


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_the_reference(layout, runner, dirs, model):
    """Chains in a batch of rows of different lengths (one prompt twice, one of a single token: uniform), past the
    last head, a row that joins and rows kept by select, and a tree (nodes by depth)."""
    heads = raw_heads(dirs[layout])
    target, head = runners(model, dirs[layout], runner)
    assert isinstance(head, MedusaRunner) and head.max_draft == K
    prompts, drafts = [P1, P2, P1, [7]], [[5, 9, 4], [7], [5, 9, 4], [3, 8]]
    got = chain_logits(target, head, prompts, drafts)
    for b, (p, d) in enumerate(zip(prompts, drafts)):
        if len(p) == 1:
            assert torch.equal(got[b], torch.zeros(1 + len(d), V)), "a one-token prompt: uniform"
            continue
        h = target_hidden(model, p[:-1])[-1]
        for i in range(1 + len(d)):
            close(got[b][i], reference(heads, h, i), f"row {b}, depth {i}")
    target.add_rows([P3[:-1]], 64)
    head.add_rows([P3[:-1]], 64)
    h3 = target_hidden(model, P3[:-1])[-1]
    close(head.forward([[], [], [], [], [P3[-1]]], "last")[4], reference(heads, h3, 0), "a row that joined")
    target.select([4, 1])
    head.select([4, 1])
    after = head.forward([[2], [13]], "last")
    close(after[0], reference(heads, h3, 1), "the joined row after select")
    close(after[1], reference(heads, target_hidden(model, P2[:-1])[-1], 2), "a kept row after select")
    tokens, parents = [5, 27, 9, 4], [-1, -1, 0, 2]
    target, head = runners(model, dirs[layout], runner)
    for levels in ([4], [2, 3, 4]):  # one chunk, or level by level
        got = tree_logits(target, head, P1, tokens, parents, levels)
        h = target_hidden(model, P1[:-1])[-1]
        close(got[0], reference(heads, h, 0), "tree root")
        for i, path in enumerate(paths(tokens, parents)):
            close(got[1 + i], reference(heads, h, len(path)), f"tree node {i}")


def test_load_model_gives_the_heads(dirs):
    head = load_draft(dirs["vllm"])
    assert isinstance(head, LoadedHead) and head.kind == "medusa" and head.model.num_heads == K


# --- heads that agree with the target -------------------------------------------------------------------------------
@torch.no_grad()
def fitted_tensors(model, heads: int = K) -> dict:
    """Medusa heads fitted to the target in closed form: ResBlocks at zero (x + SiLU(0) = x), lm_head_k the least-
    squares map from h_t to the target's logits for x_{t+k+2}, over greedy runs from every token."""
    ids = torch.arange(3, V).unsqueeze(1)
    for _ in range(10):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    h, logits = model.model(ids).last_hidden_state, model(ids).logits
    t = {}
    for k in range(heads):
        X, Z = h[:, : ids.shape[1] - k - 1].reshape(-1, H), logits[:, k + 1 :].reshape(-1, V)
        t[f"{k}.0.linear.weight"], t[f"{k}.0.linear.bias"] = torch.zeros(H, H), torch.zeros(H)
        t[f"{k}.1.weight"] = torch.linalg.lstsq(X, Z).solution.T.contiguous()
    return t


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    model = bigram_target()
    folder = save_medusa(tmp_path_factory.mktemp("medusa-fit") / "heads", V, tensors=fitted_tensors(model))
    return model, load_head(folder)


PROMPTS = [[3, 17, 8, 22, 5, 11], [9], [9, 4, 30], [3, 17, 8, 22, 5, 11], [14, 6, 25, 7, 19, 12, 28, 10]]


@pytest.mark.parametrize("runner", RUNNERS)
def test_greedy_equals_plain_decoding(runner, bigram):
    """Chains (gamma 3) and a static tree (2-2) over a batch of prompts of different lengths (one of a single token,
    one twice), then a session of at most two rows where rows leave and join: plain decoding's tokens, with most
    drafts accepted (the heads read the right rows' hidden states) and some rejected."""
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


def test_chains_are_capped_at_the_heads_and_deeper_trees_refused(bigram):
    model, head = bigram
    gen = SpeculativeGenerator(loaded(model), head, config=SpecConfig(draft="model", stop_below=None, gamma=6))
    widths = []
    propose = gen.core.proposer.propose

    def recording(view, caps):
        draft = propose(view, caps)
        widths.append(draft.token_ids.shape[1])
        return draft

    gen.core.proposer.propose = recording
    gen.generate([P1], SamplingParams(temperature=0.0), max_new_tokens=12, ignore_eos=True)
    assert widths and max(widths) == K
    SpeculativeGenerator(loaded(model), head, config=SpecConfig(draft="model", tree="2-1-1"))  # as deep as the heads
    for tree in ("2-1-1-1", "dynamic-4-2-8"):
        with pytest.raises(HeadLoadError, match=r"the tree is 4 deep and the checkpoint has 3 Medusa heads"):
            SpeculativeGenerator(loaded(model), head, config=SpecConfig(draft="model", tree=tree))


# --- the target's law -----------------------------------------------------------------------------------------------
PROMPT = [3, 17, 8]
CONFIGS = {
    "chain": "draft=model,gamma=3,stop_below=none,random=stream",
    "tree-iid": "draft=model,tree=2-2,verify=iid,random=stream",
    "tree-without-replacement": "draft=model,tree=2-2-1,verify=without_replacement,random=stream",
    "auto-seeded": "draft=model,gamma=3,stop_below=none",  # every request seeded: Gumbel-coupled
}


@pytest.fixture(scope="module")
def law(bigram):
    return exact_law(bigram[0], PROMPT, SamplingParams(temperature=1.0))


@pytest.mark.statistical
def test_power(law):
    """At N = 3000 the test detects every alternative at total variation >= 0.14 from the law (30 784 outcomes) with
    probability >= 0.99, worst case over directions; at N_SLOW, >= 0.08 (each head kind's one full-power law test,
    its chain: here, test_mtp.py and test_eagle1.py, the same target and prompt)."""
    assert len(law.outcomes) > 30_000
    assert detectable_tv(law.probs, N, LEVEL, 0.99) < 0.14
    assert detectable_tv(law.probs, N_SLOW, LEVEL, 0.99) < 0.08


@pytest.mark.statistical
@pytest.mark.parametrize(
    "name, n",
    [pytest.param("chain", N, id="chain")]
    + [pytest.param(c, N, id=c, marks=pytest.mark.slow) for c in CONFIGS if c != "chain"]
    + [pytest.param("chain", N_SLOW, id="chain-large", marks=pytest.mark.slow)],  # the full-power one
)
def test_law(name, n, bigram, law):
    model, head = bigram
    gen = SpeculativeGenerator(loaded(model), head, config=SpecConfig.parse(CONFIGS[name]))
    check_law(gen, sample(gen, PROMPT, n), law, name)


def handing_the_next_head(gen: SpeculativeGenerator) -> SpeculativeGenerator:
    """Broken on purpose: the chain's draft j is drawn from head j's q, as it should, but verification is handed
    head j + 1's (mod K) — each draft's q taken one head too far."""
    proposer = gen.core.proposer
    runner = proposer.runner
    heads = runner.heads
    seen = []

    class Shifted:
        lm_heads, num_heads = heads.lm_heads, heads.num_heads

        def head(self, k, hidden):
            return heads.head((k + 1) % K, hidden)

    forward = runner.forward

    def recording(tokens, logits_at="all", parents=None, tree_start=None):
        lengths, computed = list(runner._lengths), runner.tokens_computed
        runner.heads = Shifted()
        seen.append(forward(tokens, logits_at, parents, tree_start))
        runner.heads, runner._lengths, runner.tokens_computed = heads, lengths, computed
        return forward(tokens, logits_at, parents, tree_start)

    propose = proposer.propose

    def broken(view, caps):
        seen.clear()
        draft = propose(view, caps)
        if draft.probs is None:
            return draft
        B, k = draft.token_ids.shape
        q = draft.probs.clone()
        for j, logits in enumerate(seen[:k]):
            ctx = view.node_context(draft.token_ids[:, :j], chain_parents(B, j, q.device)).at(j)
            q[:, j] = view.probs(logits, *ctx)
        return replace(draft, probs=q)

    runner.forward, proposer.propose = recording, broken
    return gen


@pytest.mark.statistical
def test_the_next_heads_q_fails(bigram, law):
    model, head = bigram
    gen = handing_the_next_head(SpeculativeGenerator(loaded(model), head, config=SpecConfig.parse(CONFIGS["chain"])))
    result = law.gof(sample(gen, PROMPT, N))
    assert result.rejects(LEVEL), result
    assert 0 < gen.last_stats.accepted < gen.last_stats.drafted


# --- bad checkpoints ------------------------------------------------------------------------------------------------
def _edit(folder: Path, tensors=None, config=None) -> Path:
    f = next(folder.glob("*.safetensors"))
    if tensors:
        t = load_file(str(f))
        tensors(t)
        save_file(t, str(f))
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    "layout, tensors, config, message",
    [
        ("fasterdecoding", lambda t: t.pop("1.0.linear.weight"), None, r"missing tensor\(s\) blocks\.1\.0\.weight"),
        ("fasterdecoding", lambda t: t.pop("0.1.weight"), None, r"missing tensor '0\.1\.weight'"),
        ("vllm", lambda t: t.pop("lm_heads.2.weight"), None, r"missing tensor\(s\) lm_heads\.2\.weight"),
        ("vllm", lambda t: t.update({"lm_heads.1.weight": torch.zeros(V, 16)}), None, r"'lm_heads\.1\.weight' has"),
        ("fasterdecoding", None, {"medusa_num_heads": 0}, "gives 0 heads; a Medusa checkpoint needs at least one"),
        ("vllm", None, {"num_heads": 0}, "gives 0 heads"),
        ("fasterdecoding", None, {"medusa_num_heads": "3"}, "'medusa_num_heads' must be an integer"),
        ("fasterdecoding", None, {"medusa_num_heads": 2}, r"unexpected tensor\(s\) blocks\.2\.0\.bias"),
        ("fasterdecoding", None, {"medusa_num_heads": 4}, r"missing tensor\(s\) blocks\.3\.0\.bias"),
        ("vllm", None, {"medusa_fc_bias": False}, r"unexpected tensor\(s\) blocks\.0\.0\.bias"),
        ("vllm", lambda t: t.update({"token_map": torch.arange(16)}), {"truncated_vocab_size": 16}, "token_map"),
    ],
)
def test_bad_checkpoints_are_clear_errors(layout, tensors, config, message, tmp_path):
    folder = _edit(save_medusa(tmp_path / "bad", V, heads=K, layout=layout), tensors, config)
    with pytest.raises(HeadLoadError, match=message):
        load_head(folder)


def test_heads_of_another_width_or_vocabulary_are_refused(tmp_path, model):
    wide = medusa_tensors(V, K)
    wide = {k: torch.zeros(48, 48) if k.endswith("linear.weight") else v for k, v in wide.items()}
    wide = {k: torch.zeros(48) if k.endswith("bias") else v for k, v in wide.items()}
    wide = {k: torch.zeros(V, 48) if k.endswith(".1.weight") else v for k, v in wide.items()}
    folder = save_medusa(tmp_path / "wide", V, heads=K, tensors=wide)
    with pytest.raises(HeadLoadError, match="the Medusa heads read hidden size 48, the target's is 32"):
        SpeculativeGenerator(loaded(model), load_head(folder), config=SpecConfig(draft="model", gamma=2))
    narrow = {k: v[:16] if k.endswith(".1.weight") else v for k, v in medusa_tensors(V, K).items()}
    folder = save_medusa(tmp_path / "narrow", V, heads=K, tensors=narrow)
    with pytest.raises(HeadLoadError, match=r"output layers have 16 rows, fewer than the target's vocabulary \(32\)"):
        SpeculativeGenerator(loaded(model), load_head(folder), config=SpecConfig(draft="model", gamma=2))
