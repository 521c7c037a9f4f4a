"""An online head on a stream of served requests, against the head `train-draft` makes in the same CPU time.

    python3 docs/bench/online/serving.py [--requests 200] [--eval 48] [--batch 4] [--max-new-tokens 48]

1. Stream: --requests requests cycle through the shipped chat, code and math prompts (chat template, T = 1, seeded),
   --batch at a time, through `draft=online` (prompt lookup + the online head, gamma auto, the default budget) on
   the fast runner, every request on its own stream (random=stream: seeded requests under the default random=auto
   are Gumbel-coupled, whose keyed draws over the 49k vocabulary cost more than a head's draft step here): per window of requests, tau and the head's share of the kept drafts, the head's version and
   its held-out acceptance estimate.
2. train-draft in the same CPU time: `sample_data` on the stream's prompts (one sample each, the stream's length),
   then `train_eagle3` for as many seconds as the online head trained (its sampling is not counted: the online
   head's data came free with serving).
3. Evaluation on --eval requests after the stream (prompts neither head trained on, the same seeds for both): each
   head alone (draft=model, gamma 3 fixed, stop_below none) and prompt lookup; tau and tokens/s of each.

Writes serving.json (valid JSON, provenance) and serving.md into --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from verispec.bench._provenance import provenance
from verispec.data import prompt_file
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.engine.drafters import load_draft
from verispec.model.loading import load_model
from verispec.sampling import SamplingParams
from verispec.training.heads import TrainConfig, sample_data, train_eagle3


def stream_prompts(n: int, skip: int = 0) -> list[str]:
    """Requests k = skip..skip + n - 1: category k % 3, that category's prompt k // 3."""
    sets = [[json.loads(x)["prompt"] for x in prompt_file(c).read_text().splitlines() if x.strip()] for c in CATS]
    return [sets[k % 3][(k // 3) % len(sets[k % 3])] for k in range(skip, skip + n)]


CATS = ("chat", "code", "math")


def run_stream(target, prompts: list[str], args) -> tuple[SpeculativeGenerator, list[dict]]:
    gen = SpeculativeGenerator(target, config=SpecConfig.parse("draft=online,random=stream"))
    rows, window = [], {"tokens": 0, "passes": 0, "kept": [0, 0], "seconds": 0.0}
    for i in range(0, len(prompts), args.batch):
        t0 = time.perf_counter()
        params = [SamplingParams(temperature=1.0, seed=i + k) for k in range(args.batch)]
        gen.generate(prompts[i : i + args.batch], params, max_new_tokens=args.max_new_tokens, chat=True)
        st, kept = gen.last_stats, gen.core.proposer.kept
        window["tokens"] += st.output_tokens
        window["passes"] += st.target_passes
        window["seconds"] += time.perf_counter() - t0
        done = i + args.batch
        if done % args.window == 0 or done >= len(prompts):
            share = [k - w for k, w in zip(kept, window["kept"])]
            ls = gen.learner.stats()
            rows.append(
                {
                    "requests": done,
                    "tau": window["tokens"] / max(window["passes"], 1),
                    "kept_lookup": share[0],
                    "kept_head": share[1],
                    "tokens_per_s": window["tokens"] / window["seconds"],
                    "version": ls["version"],
                    "alpha": ls.get("alpha"),
                    "train_seconds": ls["train_seconds"],
                    "tokens_seen": ls["tokens_seen"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            window = {"tokens": 0, "passes": 0, "kept": list(kept), "seconds": 0.0}
    return gen, rows


def evaluate(target, draft, spec: str, prompts: list[str], args, seed0: int) -> dict:
    gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse(spec))
    tokens = passes = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        params = [SamplingParams(temperature=1.0, seed=seed0 + i + k) for k in range(args.batch)]
        gen.generate(prompts[i : i + args.batch], params, max_new_tokens=args.max_new_tokens, chat=True)
        tokens, passes = tokens + gen.last_stats.output_tokens, passes + gen.last_stats.target_passes
    return {"tau": tokens / max(passes, 1), "tokens_per_s": tokens / (time.perf_counter() - t0), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--eval", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(Path(__file__).parent))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(None, threads=2)
    prompts = stream_prompts(args.requests)
    t0 = time.perf_counter()
    gen, windows = run_stream(target, prompts, args)
    stream_s = time.perf_counter() - t0
    budget_s = gen.learner.stats()["train_seconds"]
    with tempfile.TemporaryDirectory() as tmp:
        online_dir, offline_dir = Path(tmp, "online"), Path(tmp, "offline")
        gen.learner.save(online_dir, target.model.config.num_hidden_layers)
        cfg = TrainConfig(samples_per_prompt=1, max_new_tokens=args.max_new_tokens, minutes=budget_s / 60, seed=0)
        t1 = time.perf_counter()
        data = sample_data(target, prompts, cfg)
        sample_s = time.perf_counter() - t1
        offline_dir.mkdir()
        summary = train_eagle3(target, data, offline_dir, cfg)
        held = stream_prompts(args.eval, skip=args.requests)
        head = "draft=model,gamma=3,stop_below=none,random=stream"
        evals = {
            "online head": evaluate(target, load_draft(str(online_dir)), head, held, args, 10_000),
            "train-draft head": evaluate(target, load_draft(str(offline_dir)), head, held, args, 10_000),
            "prompt lookup": evaluate(target, None, "draft=ngram,gamma=3,random=stream", held, args, 10_000),
            "plain": evaluate(target, None, "draft=none,random=stream", held, args, 10_000),
        }
    result = {
        **provenance(),
        "requests": args.requests,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "stream_seconds": stream_s,
        "online": {"train_seconds": budget_s, **gen.learner.stats()},
        "train_draft": {
            "sample_seconds": sample_s,
            "train_seconds": summary["seconds"],
            "steps": summary["steps"],
            "tokens": summary["tokens"],
        },
        "windows": windows,
        "eval": evals,
    }
    (out / "serving.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    plain = evals["plain"]["tokens_per_s"]
    lines = [
        f"# Online head on a request stream ({args.requests} requests, then {args.eval} held-out)",
        "",
        "| requests | tau (draft=online) | drafts kept: lookup / head | head version | held-out alpha | train s |",
        "|---|---|---|---|---|---|",
        *[
            f"| {w['requests']} | {w['tau']:.2f} | {w['kept_lookup']} / {w['kept_head']} | {w['version']} | "
            f"{w['alpha']} | {w['train_seconds']:.0f} |"
            for w in windows
        ],
        "",
        "| held-out requests: drafter | tau | tokens/s | vs plain |",
        "|---|---|---|---|",
        *[
            f"| {k} | {v['tau']:.2f} | {v['tokens_per_s']:.1f} | {v['tokens_per_s'] / plain:.2f}x |"
            for k, v in evals.items()
        ],
    ]
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
