"""Generator-level certificate: do a generator's continuations follow the target model's own distribution?

Draw N continuations of L tokens per prompt from a method (verispec in any configuration, plain decoding, HF
transformers `generate` with or without `assistant_model`, or a user callable), score every emitted token under
the target's processed conditionals (transformers forward, the reference precision), and test:
  (a) first token: chi-square goodness of fit against p(. | prompt), exactly; for small vocabularies also the
      whole first m-token sequence against its exact law (all V^m sequences enumerated from the target);
  (b) randomized PIT: u_t = F_t(x_t - 1) + v p_t(x_t) is i.i.d. U(0, 1) over all positions (Rosenblatt);
      Kolmogorov-Smirnov test;
  (c) log-likelihood: sum_t log p_t(x_t) against its expectation -sum_t H(p_t), standardized by the conditional
      variances (catches sharpened / flattened output, e.g. a temperature mismatch);
  (d) two-sample: tokens at positions 1..m against as many samples of plain decoding (chi-square homogeneity),
      or of a reference endpoint (`reference_fn`), the test that assumes nothing about numerics.
Methods that return their tokens' logprobs (verispec; an OpenAI endpoint, `method="openai"`, see endpoint.py)
also get a logprob-parity table: the returned logprobs against the float32 recompute of the same tokens.
With `tv_tolerance` > 0 (another engine's numerics), (a) becomes a test of TV <= tolerance (stats'
tolerant_tv_test) and the exact-equality tests (b), (c) and the sequence test are left out.
All p-values are Holm-corrected into one verdict at a stated family-wise level, with each test's detectable
effect at power 0.99. A first-token test that cannot detect any deviation makes the verdict INCONCLUSIVE (never
PASS), with the N that would detect TV TARGET_TV.

Structured outputs (`SamplingParams(constraint=...)`): the law under test is the constrained one (scoring.py), the
method is asked for it (verispec and plain decoding: the request's constraint; an OpenAI endpoint: vLLM's guided_*
fields or response_format, endpoint.py; a callable: the params dict carries it; transformers' generate: refused),
and a continuation ends at EOS where the grammar is complete: EOS is one outcome (the EOS set merged, as for an
endpoint), a shorter sample ends with it, and the sequence test pads it with EOS. `--inject grammar-...`
(bugs.GRAMMAR_BUGS) breaks the engine's use of the grammar.

Samples are independent (sample i of prompt j uses seed base + j * N + i whatever the batching), so `workers`
processes can share them and the result does not depend on how many there are.

This module is the driver (drawing the samples, the workers, the reference samples, the request checks); the
methods and their adapters live in methods.py, the scores and the tests in scoring.py, the report in report.py
(their public names are importable from here too).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace

import numpy as np

from ..engine.config import SpecConfig
from ..engine.stats import SpecStats
from ..sampling import SamplingParams
from .kernel import DEFAULT_LEVEL, POWER
from .methods import (  # noqa: F401  (LOSSY_VERIFIERS, _verifier: re-exported from their old home)
    LOSSY_VERIFIERS,
    METHODS,
    MethodSpec,
    SampleFn,
    _load,
    _verifier,
    _verispec_method,
    build_method,
    eos_set,
)
from .report import GenerateReport, TestResult, write_report  # noqa: F401  (TestResult: re-exported)
from .scoring import (  # noqa: F401  (PARITY_THRESHOLD, exact_sequence_law, score, top_deviations: re-exported)
    PARITY_THRESHOLD,
    Scores,
    _exact_tests,
    _fit_tests,
    _samples_needed,
    _size_tests,
    _two_sample_tests,
    exact_sequence_law,
    logprob_parity,
    score,
    top_deviations,
)

__all__ = ["METHODS", "GenerateReport", "MethodSpec", "build_method", "certify_generate", "write_report"]

DEFAULT_SAMPLES = 2000  # continuations per prompt
DEFAULT_LENGTH = 8  # tokens per continuation
REFERENCE_SEED_OFFSET = 7_919_000  # the two-sample reference's samples use seeds offset by this


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True
    )


_WORKER: dict = {}


def _worker_init(spec: MethodSpec) -> None:
    _WORKER["fn"] = build_method(spec)


def _worker_run(task):
    prompt, params, seeds, length = task
    return _WORKER["fn"](prompt, params, seeds, length)


def draw_samples(
    spec: MethodSpec,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    length: int,
    seed: int,
    workers: int = 1,
    chunk: int = 16,
    label: str = "sampling",
    show_progress: bool = True,
    sample_fn: SampleFn | None = None,
):
    """N continuations per prompt: returns samples[prompt][i] (token lists), the pooled SpecStats (or None) and
    logprobs[prompt][i] (the method's returned logprobs of sample i, or None)."""

    tasks = [
        (j, list(prompts[j]), params, list(range(seed + j * n + i, seed + j * n + min(i + chunk, n))), length)
        for j in range(len(prompts))
        for i in range(0, n, chunk)
    ]
    samples: list[list[list[int]]] = [[] for _ in prompts]
    logprobs: list[list] = [[] for _ in prompts]
    pooled = SpecStats()
    seen_stats = False
    bar = _progress() if show_progress else None
    if bar:
        bar.start()
        task_id = bar.add_task(label, total=n * len(prompts))
    try:
        pool = None
        if workers > 1 and sample_fn is None:
            import multiprocessing as mp

            wspec = replace(spec, threads=max(1, (os.cpu_count() or 1) // workers))
            pool = ProcessPoolExecutor(
                workers, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(wspec,)
            )
            results = pool.map(_worker_run, [t[1:] for t in tasks])
        else:
            fn = sample_fn or build_method(spec)
            results = (fn(*t[1:]) for t in tasks)
        for (j, *_), (tokens, stats, *lps) in zip(tasks, results):  # one collection loop for both ways of sampling
            samples[j] += tokens
            logprobs[j] += lps[0] if lps and lps[0] is not None else [None] * len(tokens)
            if stats is not None:
                pooled.merge(stats)
                seen_stats = True
            if bar:
                bar.advance(task_id, len(tokens))
    finally:
        if pool is not None:
            pool.shutdown()
        if bar:
            bar.stop()
    return samples, (pooled if seen_stats else None), logprobs


def certify_generate(
    spec: MethodSpec,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    samples: int = DEFAULT_SAMPLES,
    length: int = DEFAULT_LENGTH,
    level: float = DEFAULT_LEVEL,
    power: float = POWER,
    seed: int = 0,
    workers: int = 1,
    two_sample_tokens: int = 2,
    sequence_tokens: int = 2,
    reference=None,
    show_progress: bool = True,
    sample_fn: SampleFn | None = None,
    reference_fn: SampleFn | None = None,
    tv_tolerance: float = 0.0,
) -> GenerateReport:
    """Certify a generator against the target model's own conditionals (`verispec certify generate`).

    Draws `samples` continuations of `length` tokens per prompt from the method, scores every token under the
    target's processed conditionals in float32, and tests (a) the first token exactly (and the first
    `sequence_tokens` tokens as a whole where the vocabulary is small), (b) the randomized PIT of every token for
    uniformity, (c) the log-likelihood against its expectation, (d) the first positions against as many samples
    of plain decoding. Holm-corrected into one verdict; see the module docstring.

    Args:
        spec: What to certify (method, target, speculation, ...).
        prompts: The prompts as token ids.
        params: How to sample (a constraint makes the law under test the constrained one).
        samples: Continuations per prompt (at least 20).
        length: Tokens per continuation.
        level: The family-wise significance level.
        power: The power at which each test's detectable deviation is stated.
        seed: The random seed; sample i of prompt j always uses the same seed.
        workers: Processes drawing samples (the result does not depend on their number).
        two_sample_tokens: m for test (d) (0 = off; skipped for plain methods; with a tolerance, run only against
            a reference_fn).
        sequence_tokens: m for the whole-sequence test (a) (only when V^m <= 4096).
        reference (LoadedModel | None): The scoring model in float32 (None: loaded from spec.target); when given,
            the two-sample test's reference is plain decoding of it unless reference_fn says otherwise.
        show_progress: Show a progress bar.
        sample_fn: Draws the method's samples instead of `build_method(spec)`.
        reference_fn: Draws the two-sample reference instead (e.g. another endpoint with speculation off).
        tv_tolerance: > 0: test TV <= tolerance instead of equality (another engine's numerics); the PIT,
            log-likelihood and sequence tests are left out.

    Returns:
        The report: verdict, every test with its detectable deviation, acceptance, PIT, logprob parity;
        `write_report` writes it as generate-certificate.{md,json,png}.

    Raises:
        ValueError: A bad request (samples < 20, no prompts, a level outside (0, 1), a constraint the method
            cannot take, ...).
    """
    _check_request(params, samples, length, prompts, level, tv_tolerance)
    _check_constraint(spec, params)
    t0 = time.perf_counter()
    scorer = reference if reference is not None else _load(spec.target, "float32")
    V = scorer.model.get_output_embeddings().weight.shape[0]
    sample_fn, eos, chunk = _sampling_plan(spec, scorer, sample_fn)
    grammar = None
    if params.constraint is not None:
        eos = eos or eos_set(scorer)
        grammar = grammar_state(scorer, params.constraint, V, eos)
    got, stats, lps = draw_samples(
        spec, prompts, params, samples, length, seed, workers, chunk, spec.label(), show_progress, sample_fn
    )
    got, lps, unusable = _usable(got, lps, "")
    sc = Scores()
    tests, laws, tolerant = _exact_tests(
        scorer.model, prompts, got, params, np.random.default_rng(seed), sc, sequence_tokens, tv_tolerance, eos, grammar
    )
    fit = None if tv_tolerance else _fit_tests(sc, tests)
    if two_sample_tokens > 0 and spec.method != "plain" and (not tv_tolerance or reference_fn is not None):
        m = min(length, two_sample_tokens)
        ref_samples = _reference_samples(
            spec, reference, reference_fn, prompts, params, samples, m, seed, workers, show_progress
        )
        unusable += _two_sample_against(got, ref_samples, eos, m, V, tests, laws)
    per_test = level / len(tests)
    _size_tests(tests, laws, per_test, power, fit, tolerant)
    return GenerateReport(
        **_request_fields(spec, prompts, params, samples, length, level, power, seed),
        tests=tests,
        **_acceptance(stats),
        pit=sc.pit,
        seconds=time.perf_counter() - t0,
        errors=_sample_errors(got, length, V, eos[0] if eos else None),
        samples_needed=_samples_needed(laws, samples, per_test, power),
        tv_tolerance=tv_tolerance,
        parity=logprob_parity(sc, lps),
        **_provenance(prompts, samples, seed, tests, sample_fn, reference_fn),
        unusable=unusable,
    )


def grammar_state(scorer, constraint, V: int, eos: Sequence[int]):
    """A `GrammarState` at the start of the output for the scorer's tokenizer (the engine's `Grammars`, built the same
    way: its vocabulary size, the EOS set as the stop tokens), which the scores walk along each sample."""
    from ..structured import Grammars

    grammars = getattr(scorer, "_certify_grammars", None)
    if grammars is None or grammars.vocab_size != V or grammars.stop_ids != sorted(set(eos)):
        grammars = Grammars(scorer.tokenizer, V, eos)
        scorer._certify_grammars = grammars  # compiled once per scorer (its tokenizer's vocabulary read once)
    return grammars.state(constraint)


CONSTRAINT_METHODS = ("verispec", "plain", "callable", "openai")  # the methods a constraint is asked of


def _check_constraint(spec: MethodSpec, params: SamplingParams) -> None:
    """A constraint needs a method that can be asked for it; a grammar bug needs a constraint (else it is a sure
    PASS: the engine it breaks has no grammar to use)."""
    from .bugs import GRAMMAR_BUGS, GRAMMAR_NON_BUGS

    if params.constraint is None:
        if spec.verifier in GRAMMAR_BUGS + GRAMMAR_NON_BUGS:
            raise ValueError(
                f"{spec.verifier} breaks how the engine uses a structured-output grammar: it needs a constraint "
                "(--json-schema, --json-object, --regex, --choice or --grammar)"
            )
        return
    if spec.method not in CONSTRAINT_METHODS:
        raise ValueError(
            f"a structured-output constraint is certified for methods {', '.join(CONSTRAINT_METHODS)}, not "
            f"{spec.method!r} (transformers' generate has no grammar of its own)"
        )


def _sampling_plan(spec: MethodSpec, scorer, sample_fn: SampleFn | None) -> tuple:
    """(sample_fn, eos, chunk) for draw_samples and the scores: an endpoint (method 'openai') samples in this
    process (its concurrency is HTTP requests, 4 * max_in_flight seeds a task) and its EOS set is one outcome
    (endpoint.py); other methods: as given, no EOS set, 16 seeds a task."""
    if spec.method != "openai":
        return sample_fn, [], 16
    return build_method(spec) if sample_fn is None else sample_fn, eos_set(scorer), 4 * spec.max_in_flight


def _two_sample_against(got, ref_samples, eos: Sequence[int], m: int, V: int, tests: list, laws: list) -> list[str]:
    """The two-sample tests of `got` against the reference's samples (cut at the EOS set, `_cut_at_eos`, without
    the ones it could not return); returns the reference's `_usable` lines."""
    ref_samples, _, ref_unusable = _usable([[_cut_at_eos(x, eos) for x in g] for g in ref_samples], None, "ref ")
    _two_sample_tests(got, ref_samples, m, V, tests, laws)
    return ref_unusable


def _request_fields(spec: MethodSpec, prompts, params: SamplingParams, samples, length, level, power, seed) -> dict:
    """The report's record of what was asked."""
    return dict(
        method=spec.label(),
        target=spec.target,
        params=asdict(params),
        prompts=len(prompts),
        samples=samples,
        length=length,
        level=level,
        power=power,
        seed=seed,
    )


def _provenance(prompts, samples: int, seed: int, tests: list, sample_fn, reference_fn) -> dict:
    """The report's endpoint logs (the method's; the reference's, when it was the two-sample reference) and every
    request's seed."""
    two_sample = any(t.kind == "two-sample" for t in tests)
    return dict(
        endpoint=_endpoint_log(sample_fn),
        reference_endpoint=_endpoint_log(reference_fn) if two_sample else None,
        request_seeds=_request_seeds(prompts, samples, seed, two_sample),
    )


def _cut_at_eos(sample: list[int] | None, eos: Sequence[int]) -> list[int] | None:
    """A sample cut after its first EOS-set id, written as eos[0] (a reference decoded past EOS, endpoint.py)."""
    if sample is None or not eos:
        return sample
    cut = next((i for i, t in enumerate(sample) if t in eos), None)
    return sample if cut is None else sample[:cut] + [eos[0]]


def _usable(got, lps, label: str):
    """(samples, logprobs) without the samples a method could not return (None: a token text an endpoint printed
    maps to no single id), and one line per prompt that lost some: such a certificate is INCONCLUSIVE."""
    lps = lps if lps is not None else [[None] * len(g) for g in got]
    kept = [[(s, lp) for s, lp in zip(g, lg) if s is not None] for g, lg in zip(got, lps)]
    lost = [f"{label}prompt {j}: {len(g) - len(k)} samples dropped" for j, (g, k) in enumerate(zip(got, kept))]
    return (
        [[s for s, _ in k] for k in kept],
        [[lp for _, lp in k] for k in kept],
        [x for x, g, k in zip(lost, got, kept) if len(g) > len(k)],
    )


def _endpoint_log(fn) -> dict | None:
    endpoint = getattr(fn, "endpoint", None)
    if endpoint is None:
        return None
    log = asdict(endpoint.log)
    return log | {"unmappable": len(log["unmappable"]), "unmappable_examples": log["unmappable"][:10]}


def _request_seeds(prompts, samples: int, seed: int, reference: bool) -> dict:
    """Every request's seed, to replay any sample alone: sample i of prompt j used seed + j * N + i."""
    ranges = [[seed + j * samples, seed + (j + 1) * samples - 1] for j in range(len(prompts))]
    out = {"rule": "sample i of prompt j: seed + j * N + i", "per_prompt_first_last": ranges}
    if reference:
        out["reference"] = f"two-sample reference: the same rule plus {REFERENCE_SEED_OFFSET}"
    return out


def _acceptance(stats: SpecStats | None) -> dict:
    """The report's acceptance fields: per position, the rate and tau of a speculative method (empty / nan else)."""
    acc = stats.per_position_acceptance if stats is not None and stats.drafted else []
    nan = float("nan")
    return dict(acceptance=acc, acceptance_rate=stats.acceptance_rate if acc else nan, tau=stats.tau if acc else nan)


def _reference_samples(spec: MethodSpec, reference, reference_fn, prompts, params, n, m, seed, workers, show_progress):
    """The two-sample test's reference: n continuations of m tokens per prompt by plain decoding of `reference`
    (when given, unless reference_fn says otherwise), else of spec.target."""
    ref_spec = MethodSpec(
        method="plain", target=spec.target, config=SpecConfig(draft="none", runner=spec.config.runner)
    )
    if reference_fn is None and reference is not None:  # plain decoding of the model the scores come from
        reference_fn = _verispec_method(ref_spec, reference)
    ref_samples, _, _ = draw_samples(
        ref_spec,
        prompts,
        params,
        n,
        m,
        seed + REFERENCE_SEED_OFFSET,
        workers,
        sample_fn=reference_fn,
        show_progress=show_progress,
        label="plain decoding (two-sample reference)",
    )
    return ref_samples


def _check_request(
    params: SamplingParams, samples: int, length: int, prompts: list, level: float, tv_tolerance: float = 0.0
) -> None:
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        raise ValueError(
            "certify generate scores tokens under temperature / top-k / top-p / min-p only; penalties "
            "make the target's law depend on the whole output and are not supported here"
        )
    if samples < 20 or length < 1:
        raise ValueError(f"need samples >= 20 and length >= 1, got {samples} and {length}")
    if not prompts:
        raise ValueError("no prompts")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if not 0 <= tv_tolerance < 1:
        raise ValueError(f"tv_tolerance must lie in [0, 1), got {tv_tolerance}")


def _sample_errors(got: list[list[list[int]]], length: int, V: int, eos: int | None = None) -> list[str]:
    """One line per prompt whose samples break the request (wrong length, a token outside the vocabulary); with
    `eos`, a shorter sample that ends with it (an endpoint that stopped at EOS) is well formed."""
    errors = []
    for j, group in enumerate(got):
        for s in group:
            if len(s) != length and not (eos is not None and 0 < len(s) < length and s[-1] == eos):
                errors.append(f"prompt {j}: a sample has {len(s)} tokens, expected {length}")
                break
            if any(not 0 <= t < V for t in s):
                errors.append(f"prompt {j}: a sample holds a token outside [0, {V})")
                break
    return errors


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt as verispec's generator builds them (chat: the tokenizer's chat template)."""
    if not text:
        raise ValueError("a prompt is empty")
    if not chat:
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat given but the tokenizer has no chat template")
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(enc, "keys"):
        enc = enc["input_ids"]
    return [int(t) for t in enc]
