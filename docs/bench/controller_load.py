"""gamma=auto when the load changes mid-run: a neighbour takes a core for the middle third of a long request.

    python3 docs/bench/controller_load.py [--draft SPEC] [--steps 150] [--out DIR]

On the built-in default model (SmolLM2-135M, fast runner, 2 threads), one greedy request of 3 x STEPS target passes
(EOS ignored), first with plain decoding, then with the drafter (default `draft=ngram+self,quant=int4`, gamma auto,
after a calibration taken *under load*, as a process started beside a busy neighbour would take it). A step counter
(an engine observer) starts a busy neighbour process (`--hog` busy loops) when phase B begins and stops it when phase
C begins. Greedy output: both methods generate the same tokens, so each phase's tokens/s compare like for like.
Writes controller_load.json and controller_load.md to --out: per phase and method, tokens/s, the share of steps that
drafted, the mean draft length, probes, and the controller's T(1) estimate at the phase's end.
"""

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

from verispec.bench import provenance
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.engine.observe import StepObserver
from verispec.model.loading import default_model_path, load_model
from verispec.sampling import SamplingParams

PROMPT = "Write a Python class for a bank account with deposit, withdraw and a transaction history, with tests."


def _spin() -> None:
    while True:
        pass


class Phases(StepObserver):
    """Counts target passes; starts the neighbour at pass `steps`, stops it at 2 x `steps`; records each phase."""

    def __init__(self, steps: int, hogs: int, gen=None):
        self.steps, self.hogs, self.gen, self.n = steps, hogs, gen, 0
        self.procs: list[mp.Process] = []
        self.phases = [dict(phase=p, tokens=0, drafted_steps=0, drafts=0) for p in "ABC"]
        self.t0 = time.perf_counter()

    def after_verify(self, view, draft, out) -> None:
        if self.n >= 3 * self.steps:
            return
        ph = self.phases[self.n // self.steps]
        ph["tokens"] += len(out.tokens[0])
        ph["drafted_steps"] += draft.num_nodes[0] > 0
        ph["drafts"] += draft.num_nodes[0]

    def after_commit(self, view, out) -> None:
        self.n += 1
        if self.n % self.steps == 0 and self.n <= 3 * self.steps:
            self._close(self.phases[self.n // self.steps - 1])
            if self.n == self.steps:
                self.procs = [mp.Process(target=_spin, daemon=True) for _ in range(self.hogs)]
                for p in self.procs:
                    p.start()
            elif self.n == 2 * self.steps:
                self.stop()

    def _close(self, ph: dict) -> None:
        now = time.perf_counter()
        ph["seconds"], self.t0 = now - self.t0, now
        ph["tokens_per_s"] = ph["tokens"] / ph["seconds"]
        ph["drafting_share"] = ph["drafted_steps"] / self.steps
        ph["mean_gamma"] = ph["drafts"] / max(ph["drafted_steps"], 1)
        if self.gen is not None:
            c = self.gen.core.controller
            curve = c.costs.curve(1, 2)
            ph["T1_estimate_s"] = curve[0] if curve else None
            ph["counters"] = dict(c.counters)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            p.join()
        self.procs = []


def run(target, spec: str | None, steps: int, hogs: int) -> list[dict]:
    """One method through the three phases (spec None: plain decoding)."""
    config = SpecConfig.parse(spec if spec else "draft=none")
    phases = Phases(steps, hogs)
    gen = SpeculativeGenerator(target, config=config, observers=[phases])
    phases.gen = gen if spec else None
    if spec:  # calibrated beside a busy neighbour: the costs a process started under load would see first
        hog = [mp.Process(target=_spin, daemon=True) for _ in range(hogs)]
        for p in hog:
            p.start()
        gen.calibrate((1,), repeats=3)
        for p in hog:
            p.terminate()
            p.join()
        gen.core.controller.counters = dict.fromkeys(gen.core.controller.counters, 0.0)
    phases.t0 = time.perf_counter()
    try:
        gen.generate(
            [PROMPT],
            SamplingParams(temperature=0),
            max_new_tokens=(8 if spec else 3) * steps,
            ignore_eos=True,
            chat=True,
        )
    finally:
        phases.stop()
    return phases.phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="draft=ngram+self,quant=int4,gamma=auto")
    ap.add_argument("--steps", type=int, default=150, help="target passes per phase")
    ap.add_argument("--hogs", type=int, default=2, help="busy-loop processes in phase B")
    ap.add_argument("--out", default="controller-load")
    args = ap.parse_args()
    target = load_model(default_model_path(), threads=2)
    plain = run(target, None, args.steps, args.hogs)
    auto = run(target, args.draft, args.steps, args.hogs)
    for p, a in zip(plain, auto):
        a["vs_plain"] = a["tokens_per_s"] / p["tokens_per_s"]
    result = provenance() | dict(spec=args.draft, steps=args.steps, hogs=args.hogs, plain=plain, auto=auto)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_load.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"`{result['command']}` (commit {result['commit']}, {result['date']}, {result.get('cpu', '')})",
        "",
        f"draft `{args.draft}` vs plain, greedy, {args.steps} target passes per phase; phase B: {args.hogs} busy "
        "neighbour process(es); the drafter's costs were calibrated under that load before the run.",
        "",
        "| phase | plain tok/s | auto tok/s | auto / plain | steps drafting | mean gamma | probes (cum.) | T(1) est. s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, a in zip(plain, auto):
        t1 = a.get("T1_estimate_s")
        lines.append(
            f"| {a['phase']} | {p['tokens_per_s']:.1f} | {a['tokens_per_s']:.1f} | {a['vs_plain']:.2f} | "
            f"{a['drafting_share']:.2f} | {a['mean_gamma']:.1f} | {a['counters']['probes']:.0f} | "
            f"{'-' if t1 is None else f'{t1:.4f}'} |"
        )
    (out / "controller_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
