"""Generator-level certificate: do a generator's continuations follow the target model's own distribution? N
continuations of L tokens per prompt from a method (methods.py) are scored under the target's processed conditionals
(float32) and tested (scoring.py; docs/guides/certify.md): first token and sequence goodness of fit, PIT uniformity,
log-likelihood, two-sample; Holm-corrected into one verdict. Sample i of prompt j uses seed base + j * N + i
whatever the batching, so `workers` processes share the samples without changing the result."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..engine.config import SpecConfig
from ..engine.stats import SpecStats
from ..sampling import SamplingParams
from .kernel import DEFAULT_LEVEL, POWER, require
from .methods import MethodSpec, SampleFn, _load, _verispec_method, build_method, eos_set
from .mutants import GRAMMAR_BUGS, GRAMMAR_NON_BUGS
from .report import GenerateReport, write_report
from .scoring import (
    Scores,
    _exact_tests,
    _fit_tests,
    _samples_needed,
    _size_tests,
    _two_sample_tests,
    logprob_parity,
)

__all__ = ["GenerateReport", "MethodSpec", "build_method", "certify_generate", "write_report"]

DEFAULT_SAMPLES = 2000  # continuations per prompt
DEFAULT_LENGTH = 8  # tokens per continuation
REFERENCE_SEED_OFFSET = 7_919_000  # the two-sample reference's samples use seeds offset by this


# progress(phase, done, total): `done` of `total` samples of a phase ("sampling", "scoring", "two-sample
# reference") so far; called once with done = 0 as the phase starts, then after each batch
ProgressFn = Callable[[str, int, int], None]


def _transient_bar(stack: ExitStack) -> ProgressFn:
    """The ProgressFn of `show_progress` without a `progress` callback (callers that render nothing themselves): a
    transient rich bar per phase, open until `stack` closes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    bar = stack.enter_context(Progress(*columns, transient=True))
    tasks: dict[str, object] = {}

    def show(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
        bar.update(tasks[phase], completed=done, total=total)

    return show


def _counter(progress: ProgressFn | None, phase: str, total: int) -> Callable[[int], None]:
    """advance(k): k more of `total` done, told to `progress` (which hears `done = 0` now)."""
    if progress is None:
        return lambda k: None
    done = 0
    progress(phase, 0, total)

    def advance(k: int) -> None:
        nonlocal done
        done += k
        progress(phase, done, total)

    return advance


_WORKER: dict = {}


def _worker_init(spec: MethodSpec) -> None:
    _WORKER["fn"] = build_method(spec)


def _worker_run(task):  # (prompt, params, seeds, length)
    return _WORKER["fn"](*task)


def draw_samples(
    spec,
    prompts,
    params,
    n: int,
    length: int,
    seed: int,
    workers=1,
    chunk=16,
    label="sampling",
    show_progress=True,
    sample_fn: SampleFn | None = None,
    progress: ProgressFn | None = None,
):
    """n continuations of `length` tokens per prompt (a MethodSpec's, or sample_fn's; sample i of prompt j with seed
    seed + j * n + i, `chunk` seeds a task): samples[prompt][i] (token lists), the pooled SpecStats (or None) and
    logprobs[prompt][i] (the method's returned logprobs of sample i, or None). Each batch is told to `progress` as
    phase `label`; without it, `show_progress` draws a transient bar on the terminal."""
    tasks = [
        (j, list(prompts[j]), params, list(range(seed + j * n + i, seed + j * n + min(i + chunk, n))), length)
        for j in range(len(prompts))
        for i in range(0, n, chunk)
    ]
    samples, logprobs = [[] for _ in prompts], [[] for _ in prompts]  # [prompt][i]: tokens, logprobs
    pooled, seen_stats = SpecStats(), False
    with ExitStack() as stack:
        progress = progress or (_transient_bar(stack) if show_progress else None)
        advance = _counter(progress, label, n * len(prompts))
        for (j, *_), (tokens, stats, *lps) in zip(tasks, _results(stack, spec, tasks, workers, sample_fn)):
            samples[j] += tokens
            logprobs[j] += lps[0] if lps and lps[0] is not None else [None] * len(tokens)
            if stats is not None:
                pooled.merge(stats)
                seen_stats = True
            advance(len(tokens))
    return samples, (pooled if seen_stats else None), logprobs


def _results(stack: ExitStack, spec: MethodSpec, tasks: list, workers: int, sample_fn: SampleFn | None):
    """Each task's (tokens, stats[, logprobs]), in task order: from `workers` spawned processes (shut down with
    `stack`), or in this process."""
    if workers <= 1 or sample_fn is not None:
        fn = sample_fn or build_method(spec)
        return (fn(*t[1:]) for t in tasks)
    import multiprocessing as mp

    wspec = replace(spec, threads=max(1, (os.cpu_count() or 1) // workers))
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init, initargs=(wspec,))
    stack.callback(pool.shutdown, cancel_futures=True)  # (Ctrl-C: the tasks not started are dropped)
    with _sigint_ignored():  # the workers start now (the first task) and inherit it: Ctrl-C is this process's alone
        return pool.map(_worker_run, [t[1:] for t in tasks])


@contextmanager
def _sigint_ignored():
    """SIGINT ignored inside the block (in the main thread; elsewhere signals are the main thread's already)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


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
    progress: ProgressFn | None = None,
) -> GenerateReport:
    """Certify a generator against the target model's own conditionals (`verispec certify generate`).

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
        two_sample_tokens: Positions of the two-sample test (0 = off; skipped for plain methods; with a tolerance,
            run only against a reference_fn).
        sequence_tokens: m for the whole-sequence test (only when V^m <= 4096).
        reference (LoadedModel | None): The scoring model in float32 (None: loaded from spec.target); the
            two-sample test's reference is plain decoding of it unless reference_fn says otherwise.
        show_progress: Without `progress`: show a transient progress bar on the terminal.
        sample_fn: Draws the method's samples instead of `build_method(spec)`.
        reference_fn: Draws the two-sample reference instead (e.g. another endpoint with speculation off).
        tv_tolerance: > 0: test TV <= tolerance instead of equality (another engine's numerics).
        progress (Callable | None): Told (phase, done, total) as the samples are drawn and scored (phases
            "sampling", "scoring", "two-sample reference"), for a caller's display; the library prints nothing then.

    Returns:
        The report; `write_report` writes it as generate-certificate.{md,json,png}.
    """
    _check_request(params, samples, length, prompts, level, tv_tolerance)
    _check_constraint(spec, params)
    with ExitStack() as stack:
        shown = progress or (_transient_bar(stack) if show_progress else None)
        run = _Run(spec, prompts, params, samples, length, level, power, seed, workers, shown, tv_tolerance)
        return _certify(run, reference, sample_fn, reference_fn, two_sample_tokens, sequence_tokens)


@dataclass(frozen=True)
class _Run:
    """What one `certify_generate` call asks."""

    spec: MethodSpec
    prompts: list[list[int]]
    params: SamplingParams
    samples: int
    length: int
    level: float
    power: float
    seed: int
    workers: int
    progress: ProgressFn | None
    tv_tolerance: float


def _certify(run: _Run, reference, sample_fn, reference_fn, two_sample: int, sequence_tokens: int) -> GenerateReport:
    """Draw the samples, score them, test them (scoring.py) and report."""
    t0 = time.perf_counter()
    spec, prompts, params = run.spec, run.prompts, run.params
    scorer = reference if reference is not None else _load(spec.target, "float32")
    V = scorer.model.get_output_embeddings().weight.shape[0]
    # an endpoint samples in this process (its concurrency is HTTP requests) and its EOS set is one outcome
    endpoint = spec.method == "openai"
    sample_fn = build_method(spec) if endpoint and sample_fn is None else sample_fn
    eos = eos_set(scorer) if endpoint or params.constraint is not None else []
    grammar = None if params.constraint is None else grammar_state(scorer, params.constraint, V, eos)
    chunk = 4 * spec.max_in_flight if endpoint else 16
    drawing = (run.samples, run.length, run.seed, run.workers, chunk, "sampling", False, sample_fn, run.progress)
    got, stats, lps = draw_samples(spec, prompts, params, *drawing)
    got, lps, unusable = _usable(got, lps, "")
    sc, tolerance = Scores(), run.tv_tolerance
    exact = (prompts, got, params, np.random.default_rng(run.seed), sc, sequence_tokens, tolerance, eos, grammar)
    scored = _counter(run.progress, "scoring", sum(1 for g in got for x in g if x))
    tests, laws, tolerant = _exact_tests(scorer.model, *exact, on_scored=scored)
    fit = None if tolerance else _fit_tests(sc, tests)
    if two_sample > 0 and spec.method != "plain" and (not tolerance or reference_fn is not None):
        m = min(run.length, two_sample)
        ref = [[_cut_at_eos(x, eos) for x in g] for g in _reference_samples(run, reference, reference_fn, m)]
        ref, _, lost = _usable(ref, None, "ref ")
        _two_sample_tests(got, ref, m, V, tests, laws)
        unusable += lost
    per_test = run.level / len(tests)
    _size_tests(tests, laws, per_test, run.power, fit, tolerant)
    return GenerateReport(
        **_record(run, tests, stats, sample_fn, reference_fn, getattr(scorer, "name", None)),
        tests=tests,
        pit=sc.pit,
        unusable=unusable,
        seconds=time.perf_counter() - t0,
        errors=_sample_errors(got, run.length, V, eos[0] if eos else None),
        samples_needed=_samples_needed(laws, run.samples, per_test, run.power),
        parity=logprob_parity(sc, lps),
    )


def _record(run: _Run, tests: list, stats: SpecStats | None, sample_fn, reference_fn, scorer_name=None) -> dict:
    """The report's record of the request (the target as given, else the name of the model scored against: the
    default model's), the acceptance of a speculative method (empty / nan otherwise), the endpoint logs (the
    reference's, when it was the two-sample reference) and every request's seed (to replay any sample alone)."""
    acc = stats.per_position_acceptance if stats is not None and stats.drafted else []
    two_sample = any(t.kind == "two-sample" for t in tests)
    first_last = [[run.seed + j * run.samples, run.seed + (j + 1) * run.samples - 1] for j in range(len(run.prompts))]
    seeds = {"rule": "sample i of prompt j: seed + j * N + i", "per_prompt_first_last": first_last}
    if two_sample:
        seeds["reference"] = f"two-sample reference: the same rule plus {REFERENCE_SEED_OFFSET}"
    asked = {f: getattr(run, f) for f in ("samples", "length", "level", "power", "seed", "tv_tolerance")}
    return asked | dict(
        method=run.spec.label(),
        target=run.spec.target if run.spec.target is not None else scorer_name,
        params=asdict(run.params),
        prompts=len(run.prompts),
        acceptance=acc,
        acceptance_rate=stats.acceptance_rate if acc else math.nan,
        tau=stats.tau if acc else math.nan,
        endpoint=_endpoint_log(sample_fn),
        reference_endpoint=_endpoint_log(reference_fn) if two_sample else None,
        request_seeds=seeds,
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
    lost = [x for x, g, k in zip(lost, got, kept) if len(g) > len(k)]
    return [[s for s, _ in k] for k in kept], [[lp for _, lp in k] for k in kept], lost


def _endpoint_log(fn) -> dict | None:
    endpoint = getattr(fn, "endpoint", None)
    if endpoint is None:
        return None
    log = asdict(endpoint.log)
    return log | {"unmappable": len(log["unmappable"]), "unmappable_examples": log["unmappable"][:10]}


def _reference_samples(run: _Run, reference, reference_fn, m: int):
    """The two-sample test's reference: n continuations of m tokens per prompt by plain decoding of `reference`
    (when given, unless reference_fn says otherwise), else of spec.target."""
    spec = run.spec
    ref_spec = MethodSpec(
        method="plain", target=spec.target, config=SpecConfig(draft="none", runner=spec.config.runner)
    )
    if reference_fn is None and reference is not None:  # plain decoding of the model the scores come from
        reference_fn = _verispec_method(ref_spec, reference)
    label = "two-sample reference"
    seed = run.seed + REFERENCE_SEED_OFFSET
    drawing = (run.samples, m, seed, run.workers, 16, label, False, reference_fn, run.progress)
    ref_samples, _, _ = draw_samples(ref_spec, run.prompts, run.params, *drawing)
    return ref_samples


def _check_request(params: SamplingParams, samples: int, length: int, prompts: list, level: float, tolerance: float):
    penalties = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    require(
        {
            "certify generate scores tokens under temperature / top-k / top-p / min-p only; penalties make the "
            "target's law depend on the whole output and are not supported here": not penalties,
            f"need samples >= 20 and length >= 1, got {samples} and {length}": samples >= 20 and length >= 1,
            "no prompts": bool(prompts),
            f"level must lie in (0, 1), got {level}": 0 < level < 1,
            f"tv_tolerance must lie in [0, 1), got {tolerance}": 0 <= tolerance < 1,
        }
    )


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
