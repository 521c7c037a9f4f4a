"""`verispec train-draft`: an EAGLE-3 head for a target, trained by self-distillation on the target's own samples
and written in the SafeAILab / SpecForge layout (what vLLM and SGLang load); docs/guides/train-draft-head.md.

Data: `samples_per_prompt` seeded continuations per prompt (kept in `data.pt`); the draft vocabulary: their
`draft_vocab` most frequent tokens (d2t[i] = id_i - i). Each step runs the target (no grad) for its aux hidden states
(the inputs of layers 2, L // 2, L - 3) and p, and the head with EAGLE-3's training-time test: unroll step s > 0
reads the head's own outputs of step s - 1 and attends to the target-fed keys up to where drafting began and its own
after, exactly as when it drafts s + 1 deep. Loss: cross-entropy of q against p restricted to the draft vocabulary
(renormalized), weighted decay**s. The head starts from the target's output rows and final norm, shares its
embedding (not trained, not saved), and is written at every checkpoint (`train_state.pt`, resumable).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from ..drafting.base import padded
from ..engine import SpecConfig, SpeculativeGenerator
from ..heads.learn import (
    choose_vocab,
    default_aux_layers,
    head_config,
    init_head,
    save_eagle3,
    ttt_logits,
    ttt_loss,
)
from ..model.runner import layer_inputs
from ..sampling import SamplingParams

__all__ = [
    "TrainConfig",
    "choose_vocab",
    "default_aux_layers",
    "head_config",
    "init_head",
    "save_eagle3",
    "train_eagle3",
    "ttt_logits",
    "ttt_loss",
]


@dataclass
class TrainConfig:
    """How `verispec train-draft` samples its data and trains an EAGLE-3 head (the CLI's flags of the same names).

    Attributes:
        samples_per_prompt: Continuations the target samples per prompt.
        max_new_tokens: Tokens per continuation.
        temperature: The target's sampling temperature for the data.
        draft_vocab: The head's output ids: the most frequent tokens of the data.
        ttt: Training-time-test unroll steps (the depth the head is trained to draft at).
        decay: The loss weight of unroll step s is decay ** s.
        lr: AdamW's learning rate.
        batch_tokens: Tokens per step (whole sequences).
        minutes: Stop after this much training time (the data sampling not counted).
        max_steps: Or after this many steps (None: no limit).
        checkpoint_every: Steps between checkpoints (train_state.pt).
        seed: The seed of the data's sampling and of the batches' order.
        chat: Prompts go through the target's chat template.
        cache_features: Run the target over the data once and keep its hidden states and p (bfloat16).
        head_intermediate: The head's MLP width (None: the target's).
    """

    samples_per_prompt: int = 2
    max_new_tokens: int = 192
    temperature: float = 1.0
    draft_vocab: int = 8192
    ttt: int = 3
    decay: float = 0.8
    lr: float = 5e-4
    batch_tokens: int = 2048
    minutes: float = 120.0
    max_steps: int | None = None
    checkpoint_every: int = 100
    seed: int = 0
    chat: bool = True
    cache_features: bool = False
    head_intermediate: int | None = None

    def check(self) -> None:
        for name in ("samples_per_prompt", "max_new_tokens", "draft_vocab", "ttt", "batch_tokens", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (self.lr > 0 and self.minutes > 0 and 0 < self.decay <= 1 and self.temperature > 0):
            raise ValueError("lr, minutes and temperature must be > 0 and decay in (0, 1]")
        if self.head_intermediate is not None and self.head_intermediate < 1:
            raise ValueError(f"head_intermediate must be >= 1, got {self.head_intermediate}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")


# --- the target's side, the data, the run ------------------------------------------------------------------------------------


class _TargetTap:
    """The target's forward for training batches: aux hidden states (layer inputs) and p on the draft vocabulary."""

    def __init__(self, model, aux: tuple[int, ...]):
        self.model, self.aux = model, aux

    @torch.no_grad()
    def __call__(self, ids: Tensor, lengths: Tensor, vocab_ids: Tensor) -> tuple[Tensor, Tensor]:
        """ids [B, n], lengths [B] -> (aux [B, n, len(aux) * H] float32, p [B, n, V_d] renormalized)."""
        mask = (torch.arange(ids.shape[1], device=ids.device).view(1, -1) < lengths.view(-1, 1)).long()
        with layer_inputs(self.model.get_decoder(), self.aux) as grabbed:
            logits = self.model(input_ids=ids, attention_mask=mask).logits  # [B, n, V]
        aux = torch.cat([grabbed[i] for i in self.aux], -1).float()
        p = logits.float().softmax(-1)[..., vocab_ids]
        return aux, p / p.sum(-1, keepdim=True).clamp_min(1e-12)


def _batches(seqs: list[list[int]], batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffled batches of sequence indices of similar length, about batch_tokens tokens each."""
    batches, cur, longest = [], [], 0
    for k in sorted(range(len(seqs)), key=lambda k: len(seqs[k])):
        longest = max(longest, len(seqs[k]))
        if cur and longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], len(seqs[k])
        cur.append(k)
    batches += [cur] if cur else []
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def _cache_features(tap, seqs: list[list[int]], vocab_ids: Tensor, pad: int, cfg: TrainConfig, told=None):
    """The target's aux hidden states and p for every sequence, computed once: ([n_k, F] bf16, [n_k, V_d] bf16).
    told(done, total): the sequences done so far, after each batch."""
    aux, probs = [None] * len(seqs), [None] * len(seqs)
    done = 0
    for batch in _batches(seqs, cfg.batch_tokens, torch.Generator().manual_seed(0)):
        ids, lengths = _pad([seqs[k] for k in batch], pad, vocab_ids.device)
        a, p = tap(ids, lengths, vocab_ids)
        for b, k in enumerate(batch):
            n = len(seqs[k])
            aux[k], probs[k] = a[b, :n].bfloat16(), p[b, :n].bfloat16()
        done += len(batch)
        if told is not None:
            told(done, len(seqs))
    return aux, probs


def _pad_rows(rows: list[Tensor]) -> Tensor:
    """[n_k, F] tensors -> [B, max n_k, F] float32, zero-padded."""
    return pad_sequence([r.float() for r in rows], batch_first=True)


def _pad(seqs: list[list[int]], pad: int, device=None) -> tuple[Tensor, Tensor]:
    """Token lists -> right-padded ids [B, n] and lengths [B], on `device`."""
    return padded(seqs, fill=pad).to(device), torch.tensor([len(s) for s in seqs], device=device)


RESUME_KEYS = ("head_intermediate", "draft_vocab", "batch_tokens", "seed", "ttt")  # must match to resume a run


def _resumed_state(path: Path, cfg: TrainConfig) -> dict:
    """A checkpoint to resume, checked against the options that shape the head and the order of its batches."""
    st = torch.load(path, weights_only=False)
    for key in RESUME_KEYS:
        if st["config"].get(key) != getattr(cfg, key):
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"the run in {path.parent} used {flag} {st['config'].get(key)}: resume it with the same {flag}"
            )
    return st


def train_eagle3(target, data: dict, out: Path, cfg: TrainConfig, resume: bool = False, progress=None) -> dict:
    """Train (or resume) an EAGLE-3 head for `target` by self-distillation, and write it into `out` (`config.json` +
    `model.safetensors`, `train_state.pt` every `cfg.checkpoint_every` steps); returns the run's summary (steps, loss,
    top-1 agreement per unroll step), also written to `out/train.json`.

    Args:
        target (LoadedModel): The target, a torch model of at least 7 layers.
        data: `{"seqs": token id lists, "starts": where each continuation starts}`, as `sample_data` returns.
        out: The output directory.
        cfg: The training settings.
        resume: Continue from `out`'s checkpoint.
        progress (Callable | None): For a progress display: called with (step, info) after every step, info being
            the step's record (`loss`, `top1` per unroll step, `seconds` of training so far) plus `tokens` (the
            sequence tokens the step read) and `epoch` (passes over the data, fractional); with
            `cfg.cache_features`, first with (step, {"phase": "features", "done": n, "total": sequences}) as the
            target's features are computed.
    """
    run = _Run(target, data, out, cfg, resume, progress)
    done = False
    while not done:
        order = _batches(data["seqs"], cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed + run.epoch))
        while run.cursor < len(order) and not done:
            info = run.step(order[run.cursor])
            if progress is not None:
                progress(run.steps, info | {"tokens": run.last_tokens, "epoch": run.epoch + run.cursor / len(order)})
            if run.steps % cfg.checkpoint_every == 0:
                run.save()
            done = info["seconds"] >= cfg.minutes * 60 or (cfg.max_steps is not None and run.steps >= cfg.max_steps)
        if not done:
            run.epoch, run.cursor = run.epoch + 1, 0
    run.head.eval()
    run.save()
    summary = run.summary(run.epoch + run.cursor / max(len(order), 1))
    (out / "train.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary


class _Run:
    """One training run's state: the head, its optimizer, the counters a checkpoint keeps, the target's tap."""

    WARMUP = 20  # steps of linear learning-rate warm-up

    def __init__(self, target, data: dict, out: Path, cfg: TrainConfig, resume: bool, progress=None):
        model = target.model
        tc = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.cfg, self.out, self.data, self.layers = cfg, out, data, tc.num_hidden_layers
        self.V = model.get_output_embeddings().weight.shape[0]
        self.aux = default_aux_layers(self.layers)
        if data.get("vocab_ids") is None:  # chosen once and kept with the data (a resumed run trains the same ids)
            data["vocab_ids"] = choose_vocab(data["seqs"], data["starts"], self.V, cfg.draft_vocab)
            torch.save(data, out / "data.pt")
        self.dev = next(model.parameters()).device
        self.vocab_ids = data["vocab_ids"].to(self.dev)  # [V_d]
        self.head = init_head(model, data["vocab_ids"], self.aux, cfg.head_intermediate)
        trained = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0)
        self.steps, self.epoch, self.cursor, self.seconds, self.history = 0, 0, 0, 0.0, []
        self.state_path = out / "train_state.pt"
        if resume and self.state_path.is_file():
            st = _resumed_state(self.state_path, cfg)
            self.head.load_state_dict(st["head"])
            self.opt.load_state_dict(st["opt"])
            self.steps, self.epoch, self.cursor = st["step"], st["epoch"], st["cursor"]
            self.seconds, self.history = st["seconds"], st["history"]
        self.tap = _TargetTap(model, self.aux)
        self.pad = int(getattr(target.tokenizer, "pad_token_id", None) or 0)
        told = (
            None
            if progress is None
            else lambda k, n: progress(self.steps, {"phase": "features", "done": k, "total": n})
        )
        self.cached = (
            _cache_features(self.tap, data["seqs"], self.vocab_ids, self.pad, cfg, told) if cfg.cache_features else None
        )
        self.last_tokens = 0  # the sequence tokens of the last step's batch
        self.head.train()
        self._t0 = time.perf_counter() - self.seconds

    def step(self, batch: list[int]) -> dict:
        """One optimizer step on the sequences `batch`; returns its history record."""
        ids, lengths = _pad([self.data["seqs"][k] for k in batch], self.pad, self.dev)
        self.last_tokens = int(lengths.sum())
        if self.cached is None:
            a, p = self.tap(ids, lengths, self.vocab_ids)
        else:
            a, p = (_pad_rows([self.cached[i][k] for k in batch]) for i in (0, 1))
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * min(1.0, (self.steps + 1) / self.WARMUP)
        loss, agree = ttt_loss(self.head, ids, lengths, a, p, self.cfg.ttt, self.cfg.decay)
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.opt.step()
        self.steps, self.cursor = self.steps + 1, self.cursor + 1
        self.seconds = time.perf_counter() - self._t0
        self.history.append({"step": self.steps, "loss": loss.item(), "top1": agree, "seconds": round(self.seconds, 1)})
        return self.history[-1]

    def save(self) -> None:
        """The checkpoint (resumable) and the head in the published layout."""
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.steps}
        state |= {"epoch": self.epoch, "cursor": self.cursor, "seconds": self.seconds, "history": self.history}
        torch.save(state | {"config": asdict(self.cfg)}, self.state_path)
        save_eagle3(self.head, self.out, self.V, self.layers)

    def summary(self, epochs: float) -> dict:
        tail = self.history[-20:] or [{"loss": 0.0, "top1": [0.0] * self.cfg.ttt}]
        seqs, starts = self.data["seqs"], self.data["starts"]
        return {
            "steps": self.steps,
            "epochs": epochs,
            "seconds": round(self.seconds, 1),
            "sequences": len(seqs),
            "tokens": sum(len(s) - n for s, n in zip(seqs, starts)),
            "draft_vocab": len(self.vocab_ids),
            "aux_layers": list(self.aux),
            "final_loss": sum(h["loss"] for h in tail) / len(tail),
            "final_top1_by_step": [sum(h["top1"][s] for h in tail) / len(tail) for s in range(self.cfg.ttt)],
            "config": asdict(self.cfg),
        }


def sample_data(target, prompts: list[str], cfg: TrainConfig, progress=None) -> dict:
    """The target's own continuations of every prompt (verispec's engine, temperature `cfg.temperature`, seeds
    `cfg.seed + k`): `{"seqs": prompt + continuation token ids, "starts": where each continuation starts}`, the
    training data of `train_eagle3`.

    Args:
        target (LoadedModel): The target model.
        prompts: The prompts' texts.
        cfg: `samples_per_prompt`, `max_new_tokens`, `temperature`, `seed` and `chat` are read.
        progress (Callable | None): Called with (samples done, samples in all) after each batch.
    """
    gen = SpeculativeGenerator(target, config=SpecConfig(draft="none"))
    seqs, starts = [], []
    batch = 32
    jobs = [(pr, s) for pr in prompts for s in range(cfg.samples_per_prompt)]
    for i in range(0, len(jobs), batch):
        chunk = jobs[i : i + batch]
        params = [SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i + k) for k in range(len(chunk))]
        outs = gen.generate([pr for pr, _ in chunk], params, max_new_tokens=cfg.max_new_tokens, chat=cfg.chat)
        for (pr, _), o in zip(chunk, outs):
            prompt_ids = gen.encode(pr, chat=cfg.chat)
            seqs.append(list(prompt_ids) + list(o.token_ids))
            starts.append(len(prompt_ids))
        if progress is not None:
            progress(min(i + batch, len(jobs)), len(jobs))
    return {"seqs": seqs, "starts": starts}
