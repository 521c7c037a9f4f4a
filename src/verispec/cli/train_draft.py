"""`verispec train-draft`: train an EAGLE-3 head for a target on this machine (self-distillation)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import (
    UsageError,
    add_counts,
    add_device_args,
    add_seed_arg,
    check_model_path,
    load,
    model_errors,
    pick,
    user_errors,
)
from .progress import duration

HELP = "train an EAGLE-3 draft head for a target from its own samples"


def add_parser(sub) -> None:
    p = sub.add_parser("train-draft", help=HELP, description=run.__doc__)
    p.add_argument("--target", help="the target model (directory, .gguf file or hub id; default: the built-in model)")
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files or built-in sets: chat, code, math")
    p.add_argument(
        "--out", required=True, help="directory for the head (config.json + model.safetensors), data and checkpoints"
    )
    add_counts(
        p,
        ("--holdout", 0, 8, "skip the first N prompts of each category (benchmarks use them; default %(default)s)"),
        ("--max-prompts", 1, None, "use at most this many prompts per category"),
        ("--samples-per-prompt", 1, 2, "continuations the target samples per prompt (default %(default)s)"),
        ("--max-new-tokens", 1, 192, "tokens per continuation (default %(default)s)"),
        ("--draft-vocab", 1, 8192, "the head's vocabulary: the most frequent tokens (default %(default)s)"),
        ("--ttt", 1, 3, "training-time-test unroll steps (default %(default)s)"),
        ("--batch-tokens", 1, 2048, "tokens per training step (default %(default)s)"),
        ("--max-steps", 1, None, "stop after this many steps"),
        ("--checkpoint-every", 1, 100, "steps between checkpoints (default %(default)s)"),
        ("--head-intermediate", 1, None, "the head's MLP width (default: the target's)"),
    )
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default 5e-4)")
    p.add_argument("--minutes", type=float, default=120.0, help="training time budget, sampling excluded (default 120)")
    p.add_argument(
        "--cache-features",
        action="store_true",
        help="run the target over the data once and keep its hidden states and p in memory (bfloat16): for targets "
        "whose forward costs more than the head's training step",
    )
    add_seed_arg(p)
    p.add_argument("--no-chat", action="store_true", help="feed prompts as plain text (default: the chat template)")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint (and its sampled data)")
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (default: a bar on a terminal, else a line every 30 s: samples drawn, then "
        "steps with loss, top-1 agreement, epoch, tokens/s and the time budget left)",
    )
    add_device_args(p)
    p.set_defaults(func=run, torch_only=True)


_TRAIN_FIELDS = ("samples_per_prompt", "max_new_tokens", "draft_vocab", "ttt", "lr", "batch_tokens", "minutes")
_TRAIN_FIELDS += ("max_steps", "checkpoint_every", "seed", "cache_features", "head_intermediate")  # TrainConfig's


def run(args: argparse.Namespace) -> int:
    """Sample continuations from the target (kept in OUT/data.pt), pick the draft vocabulary by frequency, train a
    one-layer EAGLE-3 head with the training-time test, and write it in the layout vLLM and SGLang load (OUT/
    config.json, OUT/model.safetensors), with resumable checkpoints (OUT/train_state.pt) and a summary (OUT/
    train.json). Use it with `--draft OUT`."""
    import torch

    from ..training.heads import TrainConfig, default_aux_layers, sample_data, train_eagle3

    with user_errors():
        cfg = TrainConfig(**pick(args, *_TRAIN_FIELDS), chat=not args.no_chat)
        cfg.check()
    from .options import read_bench_prompts  # files or the built-in sets (verispec.data), as every --prompts

    by_cat = read_bench_prompts(args.prompts)
    out = Path(args.out)
    if not args.resume and (out / "train_state.pt").exists():
        raise UsageError(f"{out} holds a training run already: pass --resume to continue it, or another --out")
    prompts = [p for ps in by_cat.values() for p in ps[args.holdout :][: args.max_prompts]]
    if not prompts:
        raise UsageError("no prompts left after --holdout")
    check_model_path(f"--target {args.target}", args.target)
    with model_errors():
        target = load(args.target, args)
    if not isinstance(target.model, torch.nn.Module):
        raise UsageError(f"train-draft trains on a torch model, and {target.name} runs on llama.cpp")
    with user_errors():  # before sampling: a target the head cannot read
        tc = target.model.config
        default_aux_layers((tc.get_text_config() if hasattr(tc, "get_text_config") else tc).num_hidden_layers)
    out.mkdir(parents=True, exist_ok=True)
    data_path = out / "data.pt"

    from .progress import ProgressDisplay

    with ProgressDisplay(args.quiet) as display:
        shown = TrainProgress(display, cfg)
        if args.resume and data_path.is_file():
            data = torch.load(data_path, weights_only=False)
        else:
            shown.sampling(0, len(prompts) * cfg.samples_per_prompt)
            data = sample_data(target, prompts, cfg, progress=shown.sampling)
            torch.save(data, data_path)
        summary = train_eagle3(target, data, out, cfg, resume=args.resume, progress=shown.training)
        torch.save(data, data_path)  # with the draft vocabulary chosen
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2), file=sys.stdout)
    return 0


class TrainProgress:
    """train-draft's progress: `sample_data`'s and `train_eagle3`'s callbacks shown on a `ProgressDisplay` (the
    training line: steps of --max-steps, with the loss, top-1 agreement per unroll step, epoch, tokens/s and the time
    budget left, --minutes)."""

    def __init__(self, display, cfg):
        self.display, self.cfg = display, cfg
        self._first: float | None = None  # the training seconds at the first step seen
        self._tokens = 0  # sequence tokens the steps read since

    def sampling(self, done: int, total: int) -> None:
        self.display.update("sampling", done, total, unit="samples")

    def training(self, step: int, info: dict) -> None:
        if info.get("phase") == "features":
            self.display.update("target features", info["done"], info["total"], unit="sequences")
            return
        if self._first is None:
            self._first = info["seconds"]
        else:
            self._tokens += info["tokens"]
        spent = info["seconds"] - self._first
        top1 = "/".join(f"{a:.2f}" for a in info["top1"])
        figures = [f"loss {info['loss']:.3f}", f"top1 {top1}", f"epoch {info['epoch']:.2f}"]
        figures += [f"{self._tokens / spent:.3g} tokens/s"] if spent > 0 else []
        left = self.cfg.minutes * 60 - info["seconds"]
        figures.append(f"time budget left {duration(left)}")
        self.display.update("training", step, self.cfg.max_steps, ", ".join(figures), unit="steps")
