"""`verispec bench stops`: what a request's stop strings cost per step, the engine and the matcher alone, side by side
in one run; what it measures: docs/benchmarks.md, "What each benchmark measures"."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..engine.config import SpecConfig
from ..engine.generator import SpeculativeGenerator
from ..engine.stops import StopMatcher, _matcher
from ..model.loading import LoadedModel
from ..sampling import SamplingParams
from .harness import report_head, started, table, timed

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class StopsConfig:
    num_stops: int = 10_000  # random stop strings per request
    num_prompts: int = 8  # requests in one batch
    max_new_tokens: int = 128  # per request
    repeats: int = 5  # timed runs per case (the fastest is kept: timeit's rule), cases interleaved
    gamma: int = 4  # prompt-lookup drafts per step
    reference: bool = True  # also time the loops over every string (the matcher alone)
    seed: int = 0

    def __post_init__(self):
        for name in ("num_stops", "num_prompts", "max_new_tokens", "repeats", "gamma"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class LoopStops:
    """The loops over every stop string that rows ran before `StopMatcher`, behind its interface (the reference).
    Its hold-back is StopMatcher's rule (the longest suffix) at the old loop's cost."""

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
            best = max(best, next((m for m in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:m])), 0))
        return best


def tiny_model(seed: int, words: int = 200) -> LoadedModel:
    """A random 2-layer Llama over `words` random lowercase words (decoded with spaces), built here: no download."""
    r = random.Random(seed)
    vocab = ["<unk>", "<s>", "</s>"] + sorted({"".join(r.choices(ALPHABET, k=r.randint(1, 6))) for _ in range(words)})
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    sizes |= dict(num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    config = LlamaConfig(vocab_size=len(vocab), **sizes)
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


def _generate(gen, prompts, stops, budget: int) -> tuple[float, list]:
    """One timed batch, greedy, to the budget (its matchers built inside the time: the cache is cleared first)."""
    _matcher.cache_clear()
    greedy = SamplingParams(temperature=0.0)
    return timed(gen.generate, prompts, greedy, max_new_tokens=budget, stop=stops, ignore_eos=True)


def engine_cases(cfg: StopsConfig) -> tuple[list[dict], list[str]]:
    """The engine on the same prompts, per case, at the budget and at twice it: best seconds per batch and batch
    steps; a step's cost is the difference over the difference (what a request's setup costs cancels out).
    Returns the table's rows and the texts without stop strings."""
    target = tiny_model(cfg.seed)
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="ngram", gamma=cfg.gamma))
    r = random.Random(cfg.seed)
    words = [w for w in target.tokenizer.get_vocab() if not w.startswith("<")]
    prompts = [" ".join(r.choices(words, k=12)) for _ in range(cfg.num_prompts)]
    budgets = (cfg.max_new_tokens, 2 * cfg.max_new_tokens)
    plain = {b: _generate(gen, prompts, (), b)[1] for b in budgets}  # a warm-up, and the texts to avoid
    stops = random_stops(cfg.num_stops, cfg.seed, [c.text for c in plain[budgets[1]]])
    text0, n = plain[budgets[0]][0].text, cfg.num_stops
    cases = {"no stop strings": (), f"{n} (automaton)": stops}
    cases[f"{n} + 1 matching (automaton)"] = [*stops, text0[len(text0) // 2 :][:8]]
    times = {(name, b): [] for name in cases for b in budgets}
    outs: dict[tuple[str, int], list] = {}
    for _ in range(cfg.repeats):  # interleaved: drift on a shared machine hits every case alike
        for (name, b), ts in times.items():
            dt, outs[name, b] = _generate(gen, prompts, cases[name], b)
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
    found = []
    for name, kind in [("automaton", StopMatcher)] + ([("loops, before", LoopStops)] if cfg.reference else []):
        build, m = timed(kind, stops)
        whole, step = timed(m.first, text)[0], _per_step(m, text, delta)
        found.append(dict(matcher=name, build_ms=1e3 * build, step_us=1e6 * step, first_us=1e6 * whole))
    return found


def run(cfg: StopsConfig) -> dict:
    result = started()  # the code, date and command at the start of the run
    engine, texts = engine_cases(cfg)
    return result | dict(config=asdict(cfg), engine=engine, matcher=matcher_alone(cfg, texts))


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    n1, n2 = cfg["max_new_tokens"], 2 * cfg["max_new_tokens"]
    lines = report_head(
        result,
        f"stop strings on cpu, torch {result['torch']}, {result['threads']} threads",
        f"engine: {cfg['num_prompts']} greedy prompts in one batch, {n1} and {n2} new tokens each, prompt lookup "
        f"gamma {cfg['gamma']}, tiny random model; best of {cfg['repeats']} interleaved runs; marginal = "
        f"(time({n2}) - time({n1})) / (steps({n2}) - steps({n1})), whole = time({n2}) / steps({n2})",
    )
    engine = ["case", (f"batch s ({n1} tok)", lambda r: r["seconds"][0], ".3f")]
    engine += [(f"batch s ({n2} tok)", lambda r: r["seconds"][1], ".3f")]
    engine += [("batch steps", lambda r: "{} / {}".format(*r["steps"])), (f"stopped ({n2})", "stopped")]
    engine += [("ms / step (marginal)", "ms_per_step", ".2f"), ("x none", "ratio", ".2f")]
    engine += [("ms / step (whole)", "ms_per_step_whole", ".2f"), ("x none", "ratio_whole", ".2f")]
    matcher = ["matcher", (f"build ms ({cfg['num_stops']} strings)", "build_ms", ".1f")]
    matcher += [("us / step (8 new chars)", "step_us", ".1f"), ("first() on 2000 chars us", "first_us", ".1f")]
    lines += table(result["engine"], engine) + ["", "matcher alone (no engine; one row)", ""]
    return "\n".join(lines + table(result["matcher"], matcher))
