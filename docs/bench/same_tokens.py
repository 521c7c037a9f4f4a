"""Same seeds, fixed gamma -> the same tokens: run before and after a change to the engine and compare the digests.

    python3 docs/bench/same_tokens.py [--max-new-tokens 32] > after.txt

On the built-in default model (SmolLM2-135M), with the target's own int4 weights as the draft, n-gram drafting and
plain decoding, chains (token-wise, block), a tree, positional seeding and Gumbel coupling, at T = 0 and T = 1, two
prompts in one batch: prints one line per configuration with a SHA-256 of every token id it generated, and the
tokens of the first prompt. Uses only `SpeculativeGenerator(target, config=SpecConfig.parse(...))`, which every
version since the configuration landed takes, so the same script runs on an older checkout (PYTHONPATH=OLD/src)."""

import argparse
import hashlib
import sys

import torch

from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.model.loading import default_model_path, load_model
from verispec.sampling import SamplingParams

PROMPTS = ["Write a Python function that reverses a string.", "What is 17 * 23? Think step by step."]
CONFIGS = {
    "plain": "draft=none",
    "ngram@3": "draft=ngram,gamma=3",
    "self-int4@4": "draft=self,quant=int4,gamma=4,stop_below=none",
    "self-int4@4/block": "draft=self,quant=int4,gamma=4,stop_below=none,verify=block",
    "self-int4@4/position": "draft=self,quant=int4,gamma=4,stop_below=none,random=position",
    "self-int4@4/gumbel": "draft=self,quant=int4,gamma=4,stop_below=none,random=gumbel",
    "self-int4-tree@2-2-1/iid": "draft=self,quant=int4,tree=2-2-1,verify=iid",
    "ngram-tree@2-2": "draft=ngram,tree=2-2",
}


def _made_by() -> str:
    """The commit, date and command of this run (`verispec.bench.provenance`); an older checkout has no such helper."""
    try:
        from verispec.bench import provenance, provenance_line
    except ImportError:
        return "Made by an older checkout (no verispec.bench.provenance)"
    return f"Made by {provenance_line(provenance())}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(_made_by(), file=sys.stderr)  # on stderr: stdout stays comparable across checkouts
    target = load_model(str(default_model_path()))
    for name, spec in CONFIGS.items():
        gen = SpeculativeGenerator(target, config=SpecConfig.parse(spec))
        for t in (0.0, 1.0):
            params = [SamplingParams(temperature=t, seed=11 + i) for i in range(len(PROMPTS))]
            outs = gen.generate(PROMPTS, params, max_new_tokens=args.max_new_tokens, chat=True)
            ids = [o.token_ids for o in outs]
            digest = hashlib.sha256(repr(ids).encode()).hexdigest()[:16]
            print(f"{name:28s} T={t:.0f} {digest} {ids[0][:12]}", flush=True)


if __name__ == "__main__":
    main()
