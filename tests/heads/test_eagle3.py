"""EAGLE-3 heads: the forward against the paper's equations, greedy equality with plain decoding, and bad checkpoints.

Reference forward (Li et al. 2025, "EAGLE-3"; vLLM's `llama_eagle3.py`; conftest.Reference), written from the
equations and the checkpoint's tensors read with safetensors, independently of verispec's loading and modules: the
target runs once in full (transformers, no cache) with hooks grabbing the aux layers' hidden states (id i < L: the
input of layer i; id L: the last layer's output before the final norm); g_i = fc([h_a; h_b; h_c]) at position i;
pair i is (g_i, x_{i+1}): x = [RMSNorm_in(e(x_{i+1})); RMSNorm_h(g_i)], q/k/v = W x, RoPE at the pair's position,
causal attention over the pairs, a = o_proj(attn) + g_i, o = a + MLP(RMSNorm_post(a)), logits = lm_head(RMSNorm(o))
over the draft vocabulary (draft id j is target id j + d2t[j]). Drafting unrolls the head on itself: a draft token's
pair reads the prenorm o of its parent's pair instead of g. `PairRunner` over the fast and the transformers target
runners gives these logits at the target ids (and FLOOR below the row's lowest elsewhere) to 1e-4, for target-fed
slots (a prefill, then the pending token), drafted chains and trees, and a batch of rows of different lengths.

Greedy equality: the distilled head (conftest.distil_eagle3, drafts often accepted) in chains (gamma 1-4, auto,
random=position) and trees (static, dynamic) on both runners, one batch of prompts of 1 to 12 tokens, two of them
ending at EOS mid-way; rows joining and leaving a continuous-batching session; a weight update of the target.

Refusals: each bad checkpoint (missing / unexpected / misshapen tensor, no d2t) fails to load, each head that does
not fit the target (d2t out of range or not one-to-one, another hidden size, aux layers beyond the target's) fails
to bind, with a HeadLoadError naming the problem; a llama.cpp target, quant= and cross_vocab= are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.crossvocab.vocab import FLOOR
from verispec.engine import SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.engine.drafters import load_draft
from verispec.heads import HeadLoadError, PairRunner, bind_head, load_head
from verispec.model.fast import make_runner
from verispec.model.loading import LoadedModel, ModelLoadError, load_model
from verispec.sampling import SamplingParams

from ..helpers.heads import save_eagle3, save_speculators_eagle3
from ..helpers.tiny import V, greedy_reference, make_model, make_tokenizer
from .conftest import AUX, DRAFT_VOCAB, Reference, four_layer_target, target_features

RUNNERS = ("fast", "hf")
TOL = 1e-4


def assert_scattered(runner_logits: torch.Tensor, draft_logits: torch.Tensor, ids: torch.Tensor) -> None:
    """Runner logits over the target's vocabulary [..., V] == the reference's draft logits at their target ids, and
    FLOOR below the row's lowest at every other id."""
    torch.testing.assert_close(runner_logits[..., ids], draft_logits, atol=TOL, rtol=TOL)
    others = torch.ones(V, dtype=torch.bool)
    others[ids] = False
    floor = runner_logits[..., ids].amin(-1, keepdim=True) - FLOOR
    assert torch.allclose(runner_logits[..., others], floor.expand(*floor.shape[:-1], int(others.sum())))


def pair_runner(target, folder: Path, runner: str):
    head = load_head(folder)
    assert bind_head(head, target) == V
    tr = make_runner(target.model, V, runner=runner)
    return tr, PairRunner(head.model, tr, V)


SEQS = [[1, 3, 7, 7, 12, 3, 7, 9, 20], [1, 5, 6, 9, 4]]  # x_0 .. x_n per row (x_n: the pending token)


@pytest.fixture(scope="module")
def reference(target, head_dir):
    return Reference.read(head_dir, target.model.get_input_embeddings().weight)


def _g(reference, target, seq):
    """The target-fed hidden inputs g_0 .. g_{n-1} of a row x_0 .. x_n (the target holds x_0 .. x_{n-1})."""
    return reference.project(target_features(target.model, seq[:-1]))


@pytest.mark.parametrize("runner", RUNNERS)
def test_target_fed_slots_match_the_reference(target, head_dir, reference, runner):
    """A prefill of x_0 .. x_{n-1} (slot 0 has no pair) then the pending token x_n: slot j's logits are pair j - 1's."""
    tr, pr = pair_runner(target, head_dir, runner)
    seq = SEQS[0]
    n = len(seq) - 1
    tr.fill([seq[:-1]], 32)
    pr.start(1, 32)
    first = pr.forward([seq[:-1]])  # [1, n, V]: slots 0 .. n - 1
    pending = pr.forward([[seq[-1]]], logits_at="last")  # [1, V]: slot n
    ref, _ = reference.pairs(_g(reference, target, seq), seq[1:])  # pairs 0 .. n - 1 (x_1 .. x_n)
    assert_scattered(first[0, 1:], ref[: n - 1], reference.ids)
    assert_scattered(pending[0], ref[n - 1], reference.ids)
    assert torch.isfinite(first[0, 0]).all()  # slot 0 (no pair): finite junk


@pytest.mark.parametrize("runner", RUNNERS)
def test_drafted_chain_and_tree_unroll_the_head_on_its_own_output(target, head_dir, reference, runner):
    """Two rows of different lengths. Chain: drafts d1, d2 after the pending token read the head's own prenorm
    output at their parent. Tree: siblings under the pending token, a grandchild under one of them."""
    tr, pr = pair_runner(target, head_dir, runner)
    tr.fill([s[:-1] for s in SEQS], 32)
    pr.start(2, 32)
    pr.forward([s[:-1] for s in SEQS])
    pr.forward([[s[-1]] for s in SEQS])
    before = pr.lengths
    chains = [[4, 11], [30, 2]]
    got = [pr.forward([[c[0]] for c in chains], logits_at="last")]
    got.append(pr.forward([[c[1]] for c in chains], logits_at="last"))
    for b, seq in enumerate(SEQS):
        ref = reference.unrolled(_g(reference, target, seq), seq[1:], chains[b])
        for j in range(2):
            assert_scattered(got[j][b], ref[len(seq) - 1 + j], reference.ids)
    pr.keep_paths(before, [[], []])  # verification is over: every drafted slot is dropped
    assert pr.lengths == before
    # a tree under the pending token: siblings 8 and 13, then 17 under 8 (a second forward, tree_start)
    level1 = pr.forward([[8, 13], [8, 13]], parents=[[-1, -1]] * 2)  # [2, 2, V]
    level2 = pr.forward([[17], [17]], parents=[[-1, -1, 0]] * 2, tree_start=before, logits_at="last")
    for b, seq in enumerate(SEQS):
        g, toks, m = _g(reference, target, seq), seq[1:], len(seq) - 1
        assert_scattered(level1[b, 0], reference.unrolled(g, toks, [8])[m], reference.ids)
        assert_scattered(level1[b, 1], reference.unrolled(g, toks, [13])[m], reference.ids)
        assert_scattered(level2[b], reference.unrolled(g, toks, [8, 17])[m + 1], reference.ids)


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_generators_runner_reads_the_targets_verification_forwards(target, head_dir, reference, runner):
    """Through the engine: after a greedy generate, the head's runner (`gen.core.proposer.runner`) holds pairs fed with
    the target's hidden states of the verification forwards; a forward of the next pending token matches the
    reference over the whole output."""
    head = load_head(head_dir)
    gen = SpeculativeGenerator(target, head, config=SpecConfig(draft="model", gamma=3, runner=runner))
    assert (
        isinstance(gen.core.proposer.runner, PairRunner) and gen.core.proposer.runner.features.target is gen.core.runner
    )
    prompt = SEQS[0][:5]
    out = gen.generate([prompt], SamplingParams(temperature=0), max_new_tokens=9, ignore_eos=True)[0]
    assert gen.last_stats.drafted > 0
    seq = prompt + list(out.token_ids)
    pr, tr = gen.core.proposer.runner, gen.core.runner
    held = tr.lengths[0]  # the target holds all but the pending token
    assert held == len(seq) - 1
    pending = pr.forward([seq[pr.lengths[0] :]], logits_at="last")
    ref, _ = reference.pairs(_g(reference, target, seq), seq[1:])
    assert_scattered(pending[0], ref[-1], reference.ids)


def test_speculators_layout_equals_the_safeailab_layout(target, head_dir, tmp_path):
    """vLLM's `speculators` layout of the same tensors loads to the same module: equal logits."""
    spec_dir = save_speculators_eagle3(tmp_path / "spec", V)
    outs = []
    for folder in (head_dir, spec_dir):
        tr, pr = pair_runner(target, folder, "hf")
        tr.fill([SEQS[0][:-1]], 32)
        pr.start(1, 32)
        outs.append(torch.cat([pr.forward([SEQS[0]])[0], pr.forward([[5]])[0]]))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


# --- greedy equality --------------------------------------------------------------------------------------------------
GREEDY_PROMPTS = [  # a 1-token prompt, rows of different lengths, two whose greedy output ends with EOS mid-way
    [5],
    [1, 3, 22],
    SEQS[0],
    [1, 4, 11],
    [1, 9, 14, 3, 3, 20, 21, 8, 7, 6, 5, 4],
]
GREEDY_NEW = 16
GREEDY_SPECS = [
    "gamma=1",
    "gamma=2",
    "gamma=3",
    "gamma=4,stop_below=none",
    "gamma=auto",
    "tree=2-2",
    "tree=3-1-1",
    "tree=dynamic-3-2-6",
    "gamma=3,random=position",
]


@pytest.fixture(scope="module")
def greedy_refs(target):
    return [greedy_reference(target.model, p, GREEDY_NEW) for p in GREEDY_PROMPTS]


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("spec", GREEDY_SPECS)
def test_greedy_equals_the_targets_greedy(target, trained_head_dir, greedy_refs, runner, spec):
    """Temperature 0, one batch: every row's output is the target's greedy output (full forwards, no cache), EOS
    included. The distilled head's drafts are accepted often (chains and trees kept in part and in full)."""
    cfg = SpecConfig.parse(f"draft=model,{spec},runner={runner}")
    gen = SpeculativeGenerator(target, load_head(trained_head_dir), config=cfg)
    if cfg.gamma == "auto":  # measured costs from the first step (cold, auto decodes plainly until they pay)
        gen.calibrate((len(GREEDY_PROMPTS),), context=8, repeats=1)
    outs = gen.generate(GREEDY_PROMPTS, SamplingParams(temperature=0), max_new_tokens=GREEDY_NEW)
    assert [list(o.token_ids) for o in outs] == greedy_refs, spec
    assert [o.finish_reason for o in outs] == ["length" if len(r) == GREEDY_NEW else "stop" for r in greedy_refs]
    assert "stop" in {o.finish_reason for o in outs}
    stats = gen.last_stats
    assert 0 < stats.accepted < stats.drafted, spec


@pytest.mark.parametrize("spec", ["gamma=3", "tree=2-2"])
def test_greedy_in_a_continuous_batching_session(target, trained_head_dir, greedy_refs, spec):
    """At most 2 rows at once: rows join (`add_rows` on the target's cache and the head's, hidden states included)
    and leave (`select`) between steps; every output is still the target's greedy output."""
    from verispec.engine import Job, Request

    gen = SpeculativeGenerator(target, load_head(trained_head_dir), config=SpecConfig.parse(f"draft=model,{spec}"))
    sess = gen.session(max_batch=2)
    greedy = SamplingParams(temperature=0)
    reqs = [Request(tuple(p), greedy, max_new_tokens=GREEDY_NEW, key=i, index=i) for i, p in enumerate(GREEDY_PROMPTS)]
    sess.submit(Job(reqs))
    done = {}
    while not sess.idle:
        for e in sess.step():
            if e.completion is not None:
                done[e.key] = list(e.completion.token_ids)
    assert [done[i] for i in range(len(GREEDY_PROMPTS))] == greedy_refs


def test_greedy_after_a_weight_update(trained_head_dir):
    """`update_weights` on the target (in place): the head reads the new target's hidden states and embedding and
    the output is the new target's greedy output."""
    fresh = four_layer_target("updated")
    gen = SpeculativeGenerator(fresh, load_head(trained_head_dir), config=SpecConfig(draft="model", gamma=3))
    params = SamplingParams(temperature=0)
    before = gen.generate(GREEDY_PROMPTS[1:3], params, max_new_tokens=GREEDY_NEW)
    assert [list(o.token_ids) for o in before] == [
        greedy_reference(fresh.model, p, GREEDY_NEW) for p in GREEDY_PROMPTS[1:3]
    ]
    new = make_model(5, layers=4)
    up = gen.core.update_weights(new.state_dict().items())
    assert up.version == 1 and up.tensors > 0
    after = gen.generate(GREEDY_PROMPTS[1:3], params, max_new_tokens=GREEDY_NEW)
    assert [list(o.token_ids) for o in after] == [greedy_reference(new, p, GREEDY_NEW) for p in GREEDY_PROMPTS[1:3]]
    assert gen.last_stats.drafted > 0


def test_a_head_drafts_with_the_embedding_of_the_target_it_is_bound_to(head_dir):
    """One loaded head bound to two targets in turn (no embedding of its own): it reads the second's embedding."""
    head = load_head(head_dir)
    a, b = four_layer_target("a"), LoadedModel(make_model(7, layers=4), make_tokenizer(), "b")
    bind_head(head, a)
    bind_head(head, b)
    embed = b.model.get_input_embeddings().weight
    assert head.model.embed.data_ptr() == embed.data_ptr() and head.model.embed.shape == embed.shape  # shared storage
    assert not any(p is embed for p in head.model.parameters())  # not a parameter of the head


# --- what a head refuses ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, words",
    [
        ("draft=model,quant=int8", "quant"),
        ("draft=model,cross_vocab=tli", "cross_vocab"),
        ("draft=ngram", "draft=ngram"),
    ],
)
def test_a_head_refuses_what_does_not_apply(target, head_dir, spec, words):
    with pytest.raises((HeadLoadError, ValueError), match=words):
        SpeculativeGenerator(target, load_head(head_dir), config=SpecConfig.parse(spec))


def _saved(tmp_path: Path, edit=None, **cfg) -> Path:
    """A random EAGLE-3 head (the fixture's) saved with config overrides `cfg`, its tensors changed by edit(dict)."""
    folder = save_eagle3(tmp_path / "bad", V, DRAFT_VOCAB, AUX, **cfg)
    if edit is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _shift_last_d2t(t):
    t["d2t"][-1] += V


def _duplicate_d2t(t):
    t["d2t"][1] = t["d2t"][0] - 1  # draft ids 0 and 1 both map to target id d2t[0]


def _fc_for_h48(t):
    t["fc.weight"] = torch.randn(32, 3 * 48)


LOAD_ERRORS = [  # (config overrides, tensor edit, what the message names)
    ({}, lambda t: t.pop("midlayer.mlp.up_proj.weight"), r"missing tensor\(s\) layers\.0\.mlp\.up_proj\.weight"),
    (
        {},
        lambda t: t.__setitem__("fc.weight", torch.zeros(32, 95)),
        r"'fc\.weight' has shape \[32, 95\], expected \[32, 96\]",
    ),
    ({}, lambda t: t.__setitem__("midlayer.extra.weight", torch.zeros(2)), r"unexpected tensor\(s\) layers\.0\.extra"),
    ({}, lambda t: t.pop("d2t"), "draft vocabulary but no 'd2t'"),
    ({}, lambda t: t.__setitem__("lm_head.weight", torch.zeros(20, 32)), r"'lm_head\.weight' has shape \[20, 32\]"),
]
BIND_ERRORS = [
    ({}, _shift_last_d2t, r"d2t maps draft ids outside the target's vocabulary \[0, 32\)"),
    ({}, _duplicate_d2t, "d2t maps two draft ids to one target id"),
    ({"target_hidden_size": 48}, _fc_for_h48, "target_hidden_size 48 != the target's hidden size 32"),
    (
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 9]}},
        None,
        r"aux layer ids \[1, 3, 10\] must lie in \[0, 4\]",
    ),
]


@pytest.mark.parametrize("cfg, edit, message", LOAD_ERRORS)
def test_bad_checkpoints_fail_to_load_with_the_problem_named(tmp_path, cfg, edit, message):
    folder = _saved(tmp_path, edit, **cfg)
    with pytest.raises(HeadLoadError, match=message):
        load_head(folder)
    with pytest.raises(ModelLoadError, match=message):  # through load_draft too (HeadLoadError is one)
        load_draft(str(folder))
    with pytest.raises(ModelLoadError, match="is a draft head, not a model"):  # load_model loads models only
        load_model(str(folder))


@pytest.mark.parametrize("cfg, edit, message", BIND_ERRORS)
def test_heads_that_do_not_fit_the_target_are_refused_with_the_problem_named(target, tmp_path, cfg, edit, message):
    head = load_draft(str(_saved(tmp_path, edit, **cfg)))
    with pytest.raises(HeadLoadError, match=message):
        SpeculativeGenerator(target, head, config=SpecConfig(draft="model", gamma=3))


def test_a_head_needs_a_torch_target(target, head_dir, tmp_path):
    """llama.cpp runs a GGUF target without exposing its hidden states: a head is refused for it, a head directory
    is refused by the llama.cpp backend, and the head's runner refuses a target runner that is not a torch one."""
    gguf_like = LoadedModel(object(), target.tokenizer, "model.gguf")  # what load_model(backend="llamacpp") gives
    with pytest.raises(HeadLoadError, match=r"llama\.cpp runner does not expose"):
        bind_head(load_head(head_dir), gguf_like)
    with pytest.raises(ModelLoadError, match="draft head, not a GGUF model"):
        load_draft(str(head_dir), backend="llamacpp")
    with pytest.raises(ValueError, match="must run on the fast or the transformers runner"):
        PairRunner(load_head(head_dir).model, object(), V)


def test_not_a_head(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(HeadLoadError, match="does not describe"):
        load_head(tmp_path)
    folder = save_eagle3(tmp_path / "empty", V)
    (folder / "model.safetensors").unlink()
    with pytest.raises(HeadLoadError, match="no weights"):
        load_head(folder)


# --- review fixes: dtypes, default layers per target, a head passed as the target ---------------------------------------
def test_a_float32_head_drafts_for_a_bfloat16_target(head_dir):
    """The head keeps its own dtype (its inputs are cast at its boundaries) and is no parameter owner of the target's
    embedding: a bf16 target drafts with an fp32 head, and the head's logits are finite."""
    target = LoadedModel(make_model(0, layers=4, dtype=torch.bfloat16), make_tokenizer(), "bf16")
    head = load_head(head_dir)
    gen = SpeculativeGenerator(target, head, config=SpecConfig(draft="model", gamma=3))
    out = gen.generate(["a b c", "d e"], SamplingParams(temperature=1.0, seed=1), max_new_tokens=12)
    assert all(len(o.token_ids) > 0 for o in out) and gen.last_stats.drafted > 0
    assert next(head.model.parameters()).dtype == torch.float32


def test_default_aux_layers_follow_each_target(tmp_path):
    """A head whose config names no aux layers reads 2, L // 2, L - 3 of whichever target it is bound to."""
    head = load_head(save_eagle3(tmp_path / "h", V, DRAFT_VOCAB, aux=None))
    bind_head(head, LoadedModel(make_model(0, layers=8), make_tokenizer(), "8"))
    assert head.model.layers_read == (2, 4, 5)
    bind_head(head, LoadedModel(make_model(0, layers=10), make_tokenizer(), "10"))
    assert head.model.layers_read == (2, 5, 7)


def test_safeailab_ids_name_layer_outputs(tmp_path):
    """SafeAILab / SpecForge's nested ids name layer outputs (SGLang adds one), speculators' top-level ids inputs."""
    assert load_head(save_eagle3(tmp_path / "a", V, DRAFT_VOCAB, aux=(1, 2, 4))).config["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [0, 1, 3]
    assert load_head(save_eagle3(tmp_path / "b", V, DRAFT_VOCAB, aux=(1, 2, 4))).model.layers_read == (1, 2, 4)
    assert load_head(save_speculators_eagle3(tmp_path / "c", V, DRAFT_VOCAB, aux=(1, 2, 4))).model.layers_read == (
        1,
        2,
        4,
    )


def test_a_head_is_not_a_target(head_dir):
    with pytest.raises(ValueError, match="not a model: pass it as the draft"):
        SpeculativeGenerator(load_head(head_dir), config=SpecConfig(draft="none"))
