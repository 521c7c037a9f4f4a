"""`verispec train-draft`: train an EAGLE-3 head for a target on this machine (self-distillation)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import UsageError, add_counts, add_device_args, add_seed_arg, load, model_errors, pick, user_errors


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-draft", help="train an EAGLE-3 draft head for a target from its own samples", description=run.__doc__
    )
    p.add_argument("--target", help="the target model (directory, .gguf file or hub id; default: the built-in model)")
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files ({'prompt': ...} per line)")
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

    from ..bench.e2e import load_prompts
    from ..training.heads import TrainConfig, default_aux_layers, sample_data, train_eagle3

    with user_errors():
        cfg = TrainConfig(**pick(args, *_TRAIN_FIELDS), chat=not args.no_chat)
        cfg.check()
    with user_errors(OSError):
        by_cat = load_prompts(args.prompts)
    out = Path(args.out)
    if not args.resume and (out / "train_state.pt").exists():
        raise UsageError(f"{out} holds a training run already: pass --resume to continue it, or another --out")
    prompts = [p for ps in by_cat.values() for p in ps[args.holdout :][: args.max_prompts]]
    if not prompts:
        raise UsageError("no prompts left after --holdout")
    with model_errors():
        target = load(args.target, args)
    if not isinstance(target.model, torch.nn.Module):
        raise UsageError(f"train-draft trains on a torch model, and {target.name} runs on llama.cpp")
    with user_errors():  # before sampling: a target the head cannot read
        tc = target.model.config
        default_aux_layers((tc.get_text_config() if hasattr(tc, "get_text_config") else tc).num_hidden_layers)
    out.mkdir(parents=True, exist_ok=True)
    data_path = out / "data.pt"

    with _Reporter() as report:
        if args.resume and data_path.is_file():
            data = torch.load(data_path, weights_only=False)
        else:
            task = report.task("sampling", len(prompts) * cfg.samples_per_prompt)
            data = sample_data(target, prompts, cfg, progress=lambda k, n: report.update(task, k, f"{k}/{n}"))
            torch.save(data, data_path)
        task = report.task("training", cfg.max_steps)

        def show(step, info):
            top1 = "/".join(f"{a:.2f}" for a in info["top1"])
            report.update(task, step, f"step {step} loss {info['loss']:.3f} top1 {top1} {info['seconds']:.0f}s")

        summary = train_eagle3(target, data, out, cfg, resume=args.resume, progress=show)
        torch.save(data, data_path)  # with the draft vocabulary chosen
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2), file=sys.stdout)
    return 0


class _Reporter:
    """A rich progress bar on a terminal; elsewhere (a log file, CI) a plain line per update at most every 10 s."""

    def __init__(self):
        from rich.console import Console

        self.live = Console(stderr=True).is_terminal
        self.bar = None
        self._last = 0.0

    def __enter__(self):
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn()
            )
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def task(self, name: str, total: int | None):
        return self.bar.add_task(name, total=total, info="") if self.bar is not None else name

    def update(self, task, completed: int, info: str) -> None:
        import time

        if self.bar is not None:
            self.bar.update(task, completed=completed, info=info)
        elif time.monotonic() - self._last >= 10:
            self._last = time.monotonic()
            print(f"{task}: {info}", file=sys.stderr, flush=True)
