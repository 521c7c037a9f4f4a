"""`verispec train-draft`: train an EAGLE-3 head for a target on this machine (self-distillation)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import UsageError, add_device_args, load, model_errors, user_errors


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train-draft", help="train an EAGLE-3 draft head for a target from its own samples", description=run.__doc__
    )
    p.add_argument("--target", help="the target model (directory, .gguf file or hub id; default: the built-in model)")
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL prompt files ({'prompt': ...} per line)")
    p.add_argument(
        "--out", required=True, help="directory for the head (config.json + model.safetensors), data and checkpoints"
    )
    p.add_argument(
        "--holdout",
        type=int,
        default=8,
        help="skip the first N prompts of each category (benchmarks use them; default 8)",
    )
    p.add_argument("--max-prompts", type=int, help="use at most this many prompts per category")
    p.add_argument(
        "--samples-per-prompt", type=int, default=2, help="continuations the target samples per prompt (default 2)"
    )
    p.add_argument("--max-new-tokens", type=int, default=192, help="tokens per continuation (default 192)")
    p.add_argument(
        "--draft-vocab", type=int, default=8192, help="the head's vocabulary: the most frequent tokens (default 8192)"
    )
    p.add_argument("--ttt", type=int, default=3, help="training-time-test unroll steps (default 3)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default 5e-4)")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per training step (default 2048)")
    p.add_argument("--minutes", type=float, default=120.0, help="training time budget, sampling excluded (default 120)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument(
        "--cache-features",
        action="store_true",
        help="run the target over the data once and keep its hidden states and p in memory (bfloat16): for targets "
        "whose forward costs more than the head's training step",
    )
    p.add_argument("--head-intermediate", type=int, help="the head's MLP width (default: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="feed prompts as plain text (default: the chat template)")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint (and its sampled data)")
    add_device_args(p)
    p.set_defaults(func=run, torch_only=True)


def run(args: argparse.Namespace) -> int:
    """Sample continuations from the target (kept in OUT/data.pt), pick the draft vocabulary by frequency, train a
    one-layer EAGLE-3 head with the training-time test, and write it in the layout vLLM and SGLang load (OUT/
    config.json, OUT/model.safetensors), with resumable checkpoints (OUT/train_state.pt) and a summary (OUT/
    train.json). Use it with `--draft OUT`."""
    import torch

    from ..bench.e2e import load_prompts
    from ..training.heads import TrainConfig, default_aux_layers, sample_data, train_eagle3

    with user_errors():
        cfg = TrainConfig(
            samples_per_prompt=args.samples_per_prompt,
            max_new_tokens=args.max_new_tokens,
            draft_vocab=args.draft_vocab,
            ttt=args.ttt,
            lr=args.lr,
            batch_tokens=args.batch_tokens,
            minutes=args.minutes,
            max_steps=args.max_steps,
            checkpoint_every=args.checkpoint_every,
            seed=args.seed,
            chat=not args.no_chat,
            cache_features=args.cache_features,
            head_intermediate=args.head_intermediate,
        )
        cfg.check()
        if args.holdout < 0:
            raise ValueError(f"--holdout must be >= 0, got {args.holdout}")
        if args.max_prompts is not None and args.max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {args.max_prompts}")
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
