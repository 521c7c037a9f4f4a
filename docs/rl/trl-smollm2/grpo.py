"""A few GRPO steps of TRL on a real model with rollouts from a running `verispec serve`, checked on-policy.

    python3 docs/rl/trl-smollm2/grpo.py --server http://127.0.0.1:8123 --model ~/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts math --steps 3 --out docs/rl/trl-smollm2

Per step: the weight sync (HTTP body, the server's validation and in-place copy), the rollout call, completion tokens,
accepted / drafted tokens, and OnPolicyCheck's largest |rollout logprob - trainer logprob| (fp32 on both sides).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from verispec.data import prompt_file
from verispec.rollout.client import RolloutClient
from verispec.rollout.trl import OnPolicyCheck, verispec_rollout_func


class TimedClient(RolloutClient):
    """Records each call's wall time and the server's reply."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[dict] = []

    def update_weights(self, named_tensors):
        t0 = time.perf_counter()
        out = super().update_weights(named_tensors)
        self.log.append({"call": "sync", "seconds": time.perf_counter() - t0, "server": out})
        return out

    def generate(self, prompts, n=1, **kw):
        t0 = time.perf_counter()
        out = super().generate(prompts, n, **kw)
        tokens = sum(len(c) for c in out["completion_ids"])
        self.log.append(
            {
                "call": "generate",
                "seconds": time.perf_counter() - t0,
                "tokens": tokens,
                "weight_version": out["weight_version"],
                **out["speculation"],
            }
        )
        return out


class Trainer(OnPolicyCheck, GRPOTrainer):
    pass


def reward(prompts, completions, completion_ids, **kw):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat: [{"role", "content"}]
    return [float(sum(ch.isdigit() for ch in t)) / 8 for t in texts]  # any signal that varies


def convert(gguf: Path, out: Path) -> None:
    """A GGUF file as a float32 transformers checkpoint: transformers dequantizes GGUF on load but marks the model
    quantized, and its Trainer refuses to train a quantized model; TRL and the server then load the same directory."""
    kw = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    model.hf_quantizer, model.is_quantized = None, False
    del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default="http://127.0.0.1:8123")
    ap.add_argument("--model", required=True, help="the policy: a model directory (or, with --convert-to, a .gguf)")
    ap.add_argument("--convert-to", help="only write the .gguf --model as a float32 model directory here")
    ap.add_argument("--prompts")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    path = Path(os.path.expanduser(args.model))
    if args.convert_to:
        convert(path, Path(args.convert_to))
        return
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with open(prompt_file(args.prompts)) as f:  # a file, or a built-in set: math
        rows = [json.loads(line) for line in f][: args.num_prompts * args.steps]
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows]})
    client = TimedClient(args.server)
    client.wait_for_server(300)
    cfg = GRPOConfig(
        output_dir="/tmp/verispec-grpo",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=args.num_prompts * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_dropout=True,
        temperature=1.0,
        seed=0,
        use_vllm=False,
    )
    trainer = Trainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        rollout_func=verispec_rollout_func(client),
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    syncs = [e for e in client.log if e["call"] == "sync"]
    gens = [e for e in client.log if e["call"] == "generate"]
    steps = [
        {
            "step": i,
            "sync_s": s["seconds"],
            "server_update_s": s["server"]["seconds"],
            "rollout_s": g["seconds"],
            "tokens": g["tokens"],
            "drafted": g["draft_tokens"],
            "accepted": g["accepted_tokens"],
            "weight_version": g["weight_version"],
            "logprob_gap_max": gap,
        }
        for i, (s, g, gap) in enumerate(zip(syncs, gens, trainer.logprob_gaps))
    ]
    params = sum(p.numel() for p in model.parameters())
    result = {
        "model": str(path),
        "parameters": params,
        "sync_body_bytes": params * 4,
        "train_wall_s": wall,
        "steps": steps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpo.json").write_text(json.dumps(result, indent=2))
    lines = [
        "| step | weight sync s | rollout s | completion tokens | drafted | accepted | weight version | max abs logprob gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['step']} | {s['sync_s']:.2f} ({s['server_update_s']:.2f}) | {s['rollout_s']:.2f} | {s['tokens']} | {s['drafted']} | {s['accepted']} "
        f"| {s['weight_version']} | {s['logprob_gap_max']:.2e} |"
        for s in steps
    ]
    (out / "grpo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
