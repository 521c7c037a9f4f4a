"""gamma=auto from a cold start, as a new user's process meets it: no calibration, nothing learnt yet.

    python3 docs/bench/cold_start.py [--runners llamacpp,fast] [--specs draft=ngram,draft=none] [--repeats 2]

Every (runner, category, temperature, spec) runs in a fresh process: it loads the built-in default model
(SmolLM2-135M, 2 threads), then generates the category's first --num-prompts prompts of the shipped prompt sets one
at a time (batch 1, chat template, --max-new-tokens each, EOS ignored, seed 0) and reports tokens per second over
those calls (prefill included; loading excluded). The runs of a cell alternate between the specs, --repeats times,
and each spec's figure is its total tokens over its total seconds. Prints a markdown table: per cell, each spec's
tokens/s and the ratio of the first spec to the last (default: prompt lookup, gamma auto, over plain decoding).
"""

import argparse
import json
import subprocess
import sys
from itertools import product

CHILD = r"""
import json, sys, time
from verispec.data import prompt_file
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.model.loading import default_model_path, load_model
from verispec.sampling import SamplingParams
runner, category, temp, spec, n, new = sys.argv[1:7]
backend = "llamacpp" if runner == "llamacpp" else "torch"
target = load_model(default_model_path(), backend=backend, threads=2)
gen = SpeculativeGenerator(target, config=SpecConfig.parse(f"{spec},runner={runner}"))
prompts = [json.loads(x)["prompt"] for x in prompt_file(category).read_text().splitlines() if x.strip()][: int(n)]
tokens, seconds = 0, 0.0
for p in prompts:
    t0 = time.perf_counter()
    out = gen.generate([p], SamplingParams(temperature=float(temp), seed=0), max_new_tokens=int(new), ignore_eos=True,
                       chat=True)
    seconds += time.perf_counter() - t0
    tokens += len(out[0].token_ids)
print(json.dumps(dict(tokens=tokens, seconds=seconds, drafted=gen.last_stats.drafted)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runners", default="llamacpp,fast")
    ap.add_argument("--specs", default="draft=ngram;draft=none", help="';'-separated specs, the baseline last")
    ap.add_argument("--categories", default="chat,code,math")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    specs = args.specs.split(";")
    print(f"| runner | category | T | {' | '.join(specs)} | {specs[0]} / {specs[-1]} |")
    print("|---|---|---|" + "---|" * (len(specs) + 1))
    cells = product(args.runners.split(","), args.categories.split(","), args.temperatures.split(","))
    for runner, category, temp in cells:
        total = {s: [0, 0.0] for s in specs}
        for _, spec in product(range(args.repeats), specs):
            argv = [runner, category, temp, spec, str(args.num_prompts), str(args.max_new_tokens)]
            res = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            total[spec][0] += r["tokens"]
            total[spec][1] += r["seconds"]
        rates = [total[s][0] / total[s][1] for s in specs]
        cols = " | ".join(f"{r:.1f}" for r in rates)
        print(f"| {runner} | {category} | {temp} | {cols} | {rates[0] / rates[-1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
