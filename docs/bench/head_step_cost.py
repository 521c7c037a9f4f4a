"""Step cost of an EAGLE-3 head against the target's step and a draft model's, on this machine (issue 30's goal:
a head's step <= 0.1 of the target's). Timing only: the heads are freshly initialized (`init_head`), which costs
exactly what a trained head of the same shape costs.

    python3 docs/bench/head_step_cost.py --target T.gguf [--draft D.gguf --draft-quant int4] [--context 256]

Prints one JSON object: the commit, date and command (`verispec.bench.provenance`), the target's T(1), each head's
and the draft's step, and their ratios to T(1)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from verispec.bench import provenance
from verispec.engine import SpecConfig, SpeculativeGenerator
from verispec.engine.drafters import load_draft
from verispec.model.loading import load_model
from verispec.strict_json import dumps
from verispec.training.heads import default_aux_layers, init_head, save_eagle3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--draft-quant", default="int4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--intermediate", default="full,2048", help="head MLP widths to time (full: the target's)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    origin = provenance()  # the code, date and command at the start of the run
    target = load_model(args.target)
    cfg = target.model.config.get_text_config()
    out = {**origin, "target": args.target, "context": args.context, "threads": args.threads}
    plain = SpeculativeGenerator(target, config=SpecConfig(draft="none", runner="fast"))
    t1 = plain.calibrate(batches=(1,), context=args.context)[1]["curve"][0]
    out["target_step_s"] = t1
    for width in args.intermediate.split(","):
        inter = None if width == "full" else int(width)
        head = init_head(target.model, torch.arange(args.draft_vocab), default_aux_layers(cfg.num_hidden_layers), inter)
        with tempfile.TemporaryDirectory() as d:
            save_eagle3(head, Path(d), target.model.get_output_embeddings().weight.shape[0], cfg.num_hidden_layers)
            gen = SpeculativeGenerator(target, load_draft(d), config=SpecConfig(draft="model", runner="fast"))
            step = gen.calibrate(batches=(1,), context=args.context)[1]["draft_step"]
        name = f"head_I{inter or cfg.intermediate_size}_Vd{args.draft_vocab}"
        out[name + "_step_s"], out[name + "_ratio"] = step, step / t1
    if args.draft:
        config = SpecConfig(draft="model", runner="fast", quant=args.draft_quant)
        gen = SpeculativeGenerator(target, load_model(args.draft), config=config)
        step = gen.calibrate(batches=(1,), context=args.context)[1]["draft_step"]
        out[f"draft_{args.draft_quant}_step_s"], out[f"draft_{args.draft_quant}_ratio"] = step, step / t1
    print(dumps(out, indent=2))


if __name__ == "__main__":
    main()
