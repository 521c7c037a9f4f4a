"""`verispec bench stops`: what a request's stop strings cost per step, side by side in one run.

On a tiny random model (the engine's host work is the largest share of a step there: the strictest ratio) and the
same greedy prompts, it times the engine with
  * no stop strings;
  * N random stop strings that never match (the automaton: `verispec.engine.stops`);
  * the same N plus one that matches halfway through the first prompt's output (that request ends there);
  * the same N with the loops over every string that the automaton replaced (optional: slow);
and, apart from the engine, the matcher alone: its build, and one step's look-up and hold-back on a growing text.
The outputs without a match are checked to be the same tokens in every case, so the time ratios are per step.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..engine import rows
from ..engine.stops import StopMatcher, _matcher
from ..model.loading import LoadedModel
from ..sampling import SamplingParams
from ._provenance import provenance, provenance_lines
from .table import markdown_table

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class StopsConfig:
    num_stops: int = 10_000  # random stop strings per request
    num_prompts: int = 8  # requests in one batch
    max_new_tokens: int = 128  # per request
    repeats: int = 5  # timed runs per case (the fastest is kept: timeit's rule), cases interleaved
    gamma: int = 4  # prompt-lookup drafts per step
    reference: bool = True  # also time the loops over every string (engine and matcher alone)
    seed: int = 0

    def __post_init__(self):
        for name in ("num_stops", "num_prompts", "max_new_tokens", "repeats", "gamma"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class LoopStops:
    """The loops over every stop string that Row ran before `StopMatcher`, behind its interface (the reference).
    Its hold-back is StopMatcher's rule (the longest suffix) at the old loop's cost (the old one trimmed again for
    every later string that matched what was left)."""

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops))

    def window(self, old: int) -> int:
        return max(old - self.longest + 1, 0)

    def found(self, text: str, start: int = 0) -> bool:
        return any(s in text[start:] for s in self.stops)

    def first(self, text: str, start: int = 0):
        return min(((text.find(s, start), s) for s in self.stops if s in text[start:]), default=None)

    def held(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for m in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:m]):
                    best = max(best, m)
                    break
        return best


def tiny_model(seed: int, words: int = 200) -> LoadedModel:
    """A random 2-layer Llama over `words` random lowercase words (decoded with spaces), built here: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    r = random.Random(seed)
    vocab = ["<unk>", "<s>", "</s>"] + sorted({"".join(r.choices(ALPHABET, k=r.randint(1, 6))) for _ in range(words)})
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
    )
    return LoadedModel(LlamaForCausalLM(config).eval(), tok, f"tiny-random-llama-{len(vocab)}")


def random_stops(n: int, seed: int, avoid: list[str]) -> list[str]:
    """n random strings of 4-12 letters and spaces (so their starts often end a text) found in no text of `avoid`."""
    r = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        s = "".join(r.choices(ALPHABET + " ", k=r.randint(4, 12)))
        if not any(s in t for t in avoid):
            out.append(s)
    return out


@contextmanager
def loop_stops():
    """Rows match with LoopStops while inside (bench only)."""
    saved = rows.matcher_of
    rows.matcher_of = lambda stops: LoopStops(stops) if stops else None
    try:
        yield
    finally:
        rows.matcher_of = saved


def _generate(gen, prompts, stops, budget: int, patch=None) -> tuple[float, list]:
    """One timed batch, greedy, to the budget (its matchers built inside the time: the cache is cleared first)."""
    _matcher.cache_clear()
    with patch() if patch is not None else nullcontext():
        t0 = time.perf_counter()
        out = gen.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=budget, stop=stops, ignore_eos=True)
        return time.perf_counter() - t0, out


def engine_cases(cfg: StopsConfig) -> tuple[list[dict], list[str]]:
    """The engine on the same prompts, per case, at the budget and at twice it: best seconds per batch and batch
    steps; a step's cost is the difference over the difference (what a request's setup costs cancels out).
    Returns the table's rows and the texts without stop strings."""
    from ..engine.generator import SpeculativeGenerator

    target = tiny_model(cfg.seed)
    gen = SpeculativeGenerator(target, "ngram", gamma=cfg.gamma)
    r = random.Random(cfg.seed)
    words = [w for w in target.tokenizer.get_vocab() if not w.startswith("<")]
    prompts = [" ".join(r.choices(words, k=12)) for _ in range(cfg.num_prompts)]
    budgets = (cfg.max_new_tokens, 2 * cfg.max_new_tokens)
    plain = {b: _generate(gen, prompts, (), b)[1] for b in budgets}  # a warm-up, and the texts to avoid
    stops = random_stops(cfg.num_stops, cfg.seed, [c.text for c in plain[budgets[1]]])
    text0 = plain[budgets[0]][0].text
    n = cfg.num_stops
    cases = {"no stop strings": ((), None), f"{n} (automaton)": (stops, None)}
    cases[f"{n} + 1 matching (automaton)"] = (stops + [text0[len(text0) // 2 :][:8]], None)
    if cfg.reference:
        cases[f"{n} (loops, before)"] = (stops, loop_stops)
    times = {(name, b): [] for name in cases for b in budgets}
    outs: dict[tuple[str, int], list] = {}
    for _ in range(cfg.repeats):  # interleaved: drift on a shared machine hits every case alike
        for (name, b), ts in times.items():
            dt, outs[name, b] = _generate(gen, prompts, cases[name][0], b, cases[name][1])
            ts.append(dt)
    return _engine_rows(list(cases), budgets, times, outs, plain), [c.text for c in plain[budgets[0]]]


def _engine_rows(names, budgets, times, outs, plain) -> list[dict]:
    found = []
    for name in names:
        for b in budgets:
            if "matching" not in name and [c.token_ids for c in outs[name, b]] != [c.token_ids for c in plain[b]]:
                raise AssertionError(f"{name}: other tokens than without stop strings")
        (t1, t2), (s1, s2) = (
            [min(times[name, b]) for b in budgets],
            [max(c.stats.target_passes for c in outs[name, b]) for b in budgets],
        )
        out = outs[name, budgets[1]]
        row = dict(case=name, seconds=[t1, t2], steps=[s1, s2], tokens=sum(len(c.token_ids) for c in out))
        row["stopped"] = sum(c.finish_reason == "stop" for c in out)
        row["ms_per_step"] = 1e3 * (t2 - t1) / max(s2 - s1, 1)  # marginal: setup cancels
        row["ms_per_step_whole"] = 1e3 * t2 / s2  # the whole longer batch, setup included
        base = found[0] if found else row
        row["ratio"] = row["ms_per_step"] / base["ms_per_step"]
        row["ratio_whole"] = row["ms_per_step_whole"] / base["ms_per_step_whole"]
        found.append(row)
    return found


def _per_step(matcher, text: str, delta: int) -> float:
    """Seconds for a row's per-step work on `text` growing `delta` characters a step: look for a stop string in
    the new window, hold back a possible start; the best of 5 passes, per step."""
    ends = range(delta, len(text) + 1, delta)
    passes = []
    for _ in range(5):
        t0 = time.perf_counter()
        for end in ends:
            matcher.found(text[:end], matcher.window(end - delta))
            matcher.held(text[:end])
        passes.append(time.perf_counter() - t0)
    return min(passes) / len(ends)


def matcher_alone(cfg: StopsConfig, texts: list[str], delta: int = 8) -> list[dict]:
    """The matcher without the engine, on the engine's texts: build, one step, and `first` on a whole text."""
    stops = random_stops(cfg.num_stops, cfg.seed, texts)
    text = " ".join(texts)[:2000]
    kinds = [("automaton", StopMatcher)] + ([("loops, before", LoopStops)] if cfg.reference else [])
    found = []
    for name, kind in kinds:
        t0 = time.perf_counter()
        m = kind(stops)
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.first(text)
        whole = time.perf_counter() - t0
        found.append(
            dict(matcher=name, build_ms=1e3 * build, step_us=1e6 * _per_step(m, text, delta), first_us=1e6 * whole)
        )
    return found


def run(cfg: StopsConfig) -> dict:
    origin = provenance()  # the code, date and command at the start of the run
    engine, texts = engine_cases(cfg)
    return dict(**origin, config=cfg.__dict__, engine=engine, matcher=matcher_alone(cfg, texts))


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    n1, n2 = cfg["max_new_tokens"], 2 * cfg["max_new_tokens"]
    head = ["case", f"batch s ({n1} tok)", f"batch s ({n2} tok)", "batch steps", f"stopped ({n2})"]
    head += ["ms / step (marginal)", "x none", "ms / step (whole)", "x none"]
    rows_ = [
        [r["case"], f"{r['seconds'][0]:.3f}", f"{r['seconds'][1]:.3f}", "{} / {}".format(*r["steps"]), r["stopped"]]
        + [f"{r['ms_per_step']:.2f}", f"{r['ratio']:.2f}", f"{r['ms_per_step_whole']:.2f}", f"{r['ratio_whole']:.2f}"]
        for r in result["engine"]
    ]
    lines = [
        *provenance_lines(result),
        f"engine: {cfg['num_prompts']} greedy prompts in one batch, {n1} and {n2} new tokens each, prompt lookup "
        f"gamma {cfg['gamma']}, tiny random model; best of {cfg['repeats']} interleaved runs; marginal = "
        f"(time({n2}) - time({n1})) / (steps({n2}) - steps({n1})), whole = time({n2}) / steps({n2})",
        "",  # a markdown table needs a blank line before it
    ]
    lines += markdown_table(head, rows_)
    head = ["matcher", f"build ms ({cfg['num_stops']} strings)", "us / step (8 new chars)", "first() on 2000 chars us"]
    rows_ = [
        [r["matcher"], f"{r['build_ms']:.1f}", f"{r['step_us']:.1f}", f"{r['first_us']:.1f}"] for r in result["matcher"]
    ]
    lines += ["", "matcher alone (no engine; one row)", ""] + markdown_table(head, rows_)
    return "\n".join(lines)
