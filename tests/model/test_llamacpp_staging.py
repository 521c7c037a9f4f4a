"""Slow tier, `llamacpp` marker: chunked prefill on the llama.cpp runner (default model, SmolLM2-135M Q4_1).

A row staged outside the batch (`LlamaCppRunner.stage`) and fed in chunks joins with exactly the cache `add_rows`
gives where its cells lie where add_rows puts them (its calls use the same kernels: >= 64 tokens inside unchunked
prefill's 512-token calls); the batch's own logits do not change while it is staged; it survives compaction, a
larger context and a fresh `fill` of the batch, and dropped, frees its sequence. llama.cpp's larger calls depend on
where a row's cells lie (see `_GEMM_MIN`), so in a session a staged prompt's own tokens may differ from unchunked
prefill's as they may with the moment it joins; the running rows' tokens (one-token kernels) do not."""

from __future__ import annotations

import pytest

from verispec.engine import GenerationSession, Job, Request, SpeculativeGenerator
from verispec.engine.config import SpecConfig
from verispec.model import make_runner
from verispec.model.loading import default_model_path, load_model
from verispec.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]
TOL = 1e-3  # as tests/model/test_llamacpp.py (measured 0.0)


@pytest.fixture(scope="module")
def lc():
    pytest.importorskip("llama_cpp", reason='needs the extra: pip install -e ".[llamacpp]"')
    return load_model(default_model_path(), backend="llamacpp", threads=1)


@pytest.fixture(scope="module")
def prompts(lc):
    text = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n" * 25
    long = lc.tokenizer(text, add_special_tokens=True)["input_ids"]
    short = lc.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    assert len(long) > 512  # two of unchunked prefill's calls
    return short, long


def close(a, b) -> bool:
    return (a - b).abs().max().item() <= TOL


def test_a_staged_row_joins_with_the_cache_add_rows_gives(lc, prompts):
    short, long = prompts
    V = len(lc.tokenizer)
    a = make_runner(lc.model, V)
    a.fill([short], 64)
    a.add_rows([long, long], len(long) + 8)
    b = make_runner(lc.model, V)
    b.fill([short], 64)
    free = len(b._free_seqs)
    staged = b.stage(long, len(long) + 8)
    fed = []
    while staged.remaining:
        fed.append(staged.feed(16))
        assert b.lengths == [len(short)]
    assert min(fed) >= 64 and all(n < 128 for n in fed)  # calls of the batched kernels, < 64 never left over
    b._restore(b._save())  # a compaction keeps the staged row's cells
    b.join(staged, copies=2)
    assert b.lengths == a.lengths == [len(short), len(long), len(long)]
    tokens = [[10, 11], [12], [13, 14]]
    assert close(b.forward(tokens), a.forward(tokens))
    b.select([0])
    dropped = b.stage(long, len(long) + 8)
    dropped.feed(8)
    dropped.close()
    b.select([])
    assert len(b._free_seqs) == free + 1  # every sequence but the graveyard's is free again
    with pytest.raises(ValueError, match="joined the batch or been dropped"):
        dropped.feed(8)


def test_the_batch_runs_unchanged_while_a_row_is_staged(lc, prompts):
    short, long = prompts
    V = len(lc.tokenizer)
    steps = [[10], [11, 12, 13], [14]]
    ref = make_runner(lc.model, V)
    ref.fill([short], 64)
    expected = [ref.forward([t]) for t in steps]
    r = make_runner(lc.model, V)
    r.fill([short], 64)
    staged = r.stage(long, len(long) + 8)
    for t, want in zip(steps, expected):
        staged.feed(100)  # the staged row's cells land between the batch's
        assert close(r.forward([t]), want)
    assert r.lengths == [len(short) + 5]


def test_a_staged_row_survives_a_fresh_fill_and_a_larger_context(lc, prompts):
    short, long = prompts
    V = len(lc.tokenizer)
    r = make_runner(lc.model, V)
    r.fill([short], 32)
    staged = r.stage(long, len(long) + 8)
    staged.feed(100)
    before = bytes(r._save()[-1])  # the staged row's cells
    n_ctx = r.n_ctx
    r.fill([short, short], 4 * len(long))  # the batch's rows replaced; a larger context, cells copied over
    assert r.n_ctx > n_ctx and bytes(r._save()[-1]) == before and r.lengths == [len(short)] * 2
    staged.feed(staged.remaining)
    r.join(staged)
    assert r.lengths == [len(short), len(short), len(long)]
    assert r.forward([[5], [6], [7]]).isfinite().all()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)])
def test_a_session_with_chunked_prefill_on_llamacpp(lc, prompts, params):
    short, long = prompts
    gen = SpeculativeGenerator(lc, config=SpecConfig(draft="ngram", gamma=2))

    def run(chunk: int) -> tuple[dict, int]:
        sess = GenerationSession(gen.core, prefill_chunk=chunk)
        sess.submit(Job([Request(tuple(short), params, max_new_tokens=24, ignore_eos=True, key="running")]))
        done, staged_steps = {}, 0
        for step in range(200):
            if step == 2:
                group = [
                    Request(tuple(long), params, max_new_tokens=6, ignore_eos=True, key=i, index=i) for i in (0, 1)
                ]
                sess.submit(Job(group, group=2))
            for e in sess.step():
                if e.completion is not None:
                    done[e.key] = e.completion
            staged_steps += bool(sess.prefilling)
            if sess.idle:
                break
        return done, staged_steps

    whole, _ = run(0)
    chunked, staged_steps = run(128)
    assert staged_steps >= len(long) // 128 - 1  # one chunk per step (a call may take up to 63 more)
    assert chunked["running"].token_ids == whole["running"].token_ids
    for i in (0, 1):
        assert len(chunked[i].token_ids) == 6 and chunked[i].finish_reason == "length"
