"""An EAGLE-3 head that learns online from what the engine verifies (`draft=online`).

Data, from the forwards that run anyway: the target's aux hidden states at every token the target holds (captured
beside its keys and values for the head's own drafting: `HFRunner.capture_hidden`) and its distribution at every
emitted token (the verified step's top-K raw log-probabilities, `StepOutput.targets`, asked for by `keep_top`). A
prompt's positions carry their next token as a hard label (the prefill computes no distribution there; the output
layer at prompt positions is the one extra cost this avoids). Extra work per step: a top-K over the emitted slots'
logits, and copying each committed token's features into the replay buffer.

Versions: the learner trains its own copy of the head and publishes it (`publish`) between steps; the drafter picks
the newest version up at its next draft. Every drafted token carries the q of the version that drafted it (the
draft's `probs`, computed at draft time), so verification is exact whatever the version, and a version change mid
request changes only speed. After a new version the head's cache is rebuilt from the target's hidden states (its
keys were computed by the old weights).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..drafting.base import ANY_DEPTH, BatchView, Draft, Proposer, Signal
from ..drafting.draft_model import DraftModelProposer
from .learn import choose_vocab, init_head, save_eagle3, ttt_logits, ttt_loss
from .modules import PairHead
from .runner import PairRunner

__all__ = ["OnlineHeadProposer", "OnlineLearner", "OnlineSettings", "ReplayBuffer"]

log = logging.getLogger(__name__)

HOLD_OUT = 8  # every 8th sequence is held out of training: the new versions' acceptance is estimated on them
Slice = tuple  # (ids [n], aux [n, F], top_ids [n, K], top_p [n, K], the first position with a soft label)
STATE = "online_state.pt"  # beside the published head: the optimizer and counters (a restart resumes them)


@dataclass(frozen=True)
class OnlineSettings:
    """How an online head learns.

    Attributes:
        budget: The share of time training may take: training seconds <= budget x (decoding + training) seconds.
        buffer_tokens: The replay buffer's size in tokens (oldest sequences dropped first); per token it holds the
            aux hidden states (bfloat16, 3 x hidden size) and the top-K targets (K ids + K probabilities).
        top_k: Target probabilities kept per emitted token (the rest of the distribution is dropped, the kept
            part renormalized on the draft vocabulary).
        draft_vocab: The head's output ids: the most frequent tokens of the first data (fixed from then on).
        min_tokens: Generated tokens seen before the first head is built and trained.
        ttt: Training-time-test unroll steps; decay: step s weighs decay ** s.
        lr: AdamW's learning rate (linear warm-up over `warmup` steps).
        batch_tokens: Tokens per training step; window: the longest sequence slice a step reads.
        inline_tokens: Tokens per training step between decoding steps (`tick`): a small step, so a running
            request waits little (~0.4 s for SmolLM2-135M's head on 2 CPU cores).
        eval_tokens: Held-out tokens (every HOLD_OUT-th sequence, never trained on) a new version's acceptance is
            estimated on (`estimate`), what the draft-length controller expects of it before its drafts are counted.
        publish_every: Training steps between published versions while decoding runs (`train` publishes at its end).
        seed: The seed of the batches' sampling.
    """

    budget: float = 0.2
    buffer_tokens: int = 32768
    top_k: int = 32
    draft_vocab: int = 8192
    min_tokens: int = 512
    ttt: int = 3
    decay: float = 0.8
    lr: float = 5e-4
    warmup: int = 20
    batch_tokens: int = 512
    window: int = 384
    eval_tokens: int = 1024
    inline_tokens: int = 128
    publish_every: int = 8
    seed: int = 0


class _Entry:
    """One sequence in the buffer: tokens x_0..x_{n-1}, per position j the aux features h_j [F] and the target's
    distribution of x_{j+1} as top-K (ids, probabilities)."""

    __slots__ = ("_cat", "aux", "ids", "prompt", "top_ids", "top_p")

    def __init__(self, prompt: int):
        self.ids: list[int] = []
        self.aux: list[Tensor] = []  # chunks [n_i, F] bfloat16
        self.top_ids: list[Tensor] = []  # chunks [n_i, K] int64
        self.top_p: list[Tensor] = []  # chunks [n_i, K] float16
        self.prompt = prompt  # positions < prompt - 1 carry hard labels
        self._cat: tuple[Tensor, Tensor, Tensor] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def slice(self, start: int, end: int) -> Slice:
        aux, ids, p = self.tensors()
        return self.ids[start:end], aux[start:end], ids[start:end], p[start:end], max(0, self.prompt - 1 - start)

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._cat is None:
            self._cat = tuple(torch.cat(c) for c in (self.aux, self.top_ids, self.top_p))
            self.aux, self.top_ids, self.top_p = [self._cat[0]], [self._cat[1]], [self._cat[2]]
        return self._cat


class ReplayBuffer:
    """Sequences the engine verified, bounded in tokens (the oldest dropped first). A sequence grows as its row
    decodes (`extend`), so training may read a running request's prefix."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.tokens, self.generated = max_tokens, 0, 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, prompt_len: int) -> int:
        """A new sequence whose prompt has prompt_len tokens; returns its key."""
        self._next += 1
        self._entries[self._next] = _Entry(prompt_len)
        return self._next

    def extend(self, key: int, ids: list[int], aux: Tensor, top_ids: Tensor, top_p: Tensor) -> None:
        """Append positions to a sequence (dropped already: nothing): ids [n], aux [n, F], top_ids / top_p [n, K]."""
        e = self._entries.get(key)
        if e is None or not ids:
            return
        e.ids += ids
        e.aux.append(aux.to(torch.bfloat16, copy=True))  # a copy: never a view pinning the target's cache
        e.top_ids.append(top_ids)
        e.top_p.append(top_p.to(torch.float16))
        e._cat = None
        self.tokens += len(ids)
        self.generated += max(0, len(e) - max(len(e) - len(ids), e.prompt - 1))  # the new positions from prompt - 1 on
        while self.tokens > self.max_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def sequences(self, held_out: bool | None = None) -> list[_Entry]:
        """The sequences of two tokens or more: all, the training ones (held_out False) or the held-out ones."""
        return [
            e for k, e in self._entries.items() if len(e) > 1 and (held_out is None or (k % HOLD_OUT == 0) == held_out)
        ]

    def sample(self, tokens: int, window: int, gen: torch.Generator) -> list[Slice]:
        """Random slices of training sequences, at most `window` positions each, about `tokens` in all."""
        seqs = self.sequences(held_out=False)
        out, total = [], 0
        while seqs and total < tokens:
            e = seqs[int(torch.randint(len(seqs), (1,), generator=gen))]
            start = int(torch.randint(max(len(e) - window, 0) + 1, (1,), generator=gen))
            out.append(e.slice(start, min(len(e), start + window)))
            total += len(out[-1][0])
        return out

    def trainable(self) -> bool:
        """Whether some training sequence (two tokens or more, not held out) is there."""
        return any(len(e) > 1 and k % HOLD_OUT for k, e in self._entries.items())

    def held_out(self, tokens: int, window: int) -> list[Slice]:
        """The newest held-out sequences' last `window` positions, about `tokens` in all (never trained on)."""
        out, total = [], 0
        for e in reversed(self.sequences(held_out=True)):
            if total >= tokens:
                break
            out.append(e.slice(max(0, len(e) - window), len(e)))
            total += len(out[-1][0])
        return out


def _cpu(x):
    return x.detach().cpu() if isinstance(x, Tensor) else x


def hard_labels(next_ids: list[int], k: int, device) -> tuple[Tensor, Tensor]:
    """One-hot targets at the given next tokens: ([n, k] ids, [n, k] probabilities)."""
    ids = torch.zeros((len(next_ids), k), dtype=torch.int64, device=device)
    ids[:, 0] = torch.tensor(next_ids, dtype=torch.int64, device=device)
    p = torch.zeros((len(next_ids), k), dtype=torch.float16, device=device)
    p[:, 0] = 1.0
    return ids, p


class OnlineLearner:
    """The head, its training and its versions. `version` counts published heads (0: none yet); `head` is the
    published one (None before the first), never the one being trained.

    Args:
        model: The target's torch model (its embedding is shared, its output rows start the head).
        vocab_size: Ids the target and the head share.
        aux: The target's layers whose inputs the head reads.
        settings: How it learns.
        head: A saved head to start from (its draft vocabulary kept); None: built from the first data.
    """

    def __init__(self, model, vocab_size: int, aux: tuple[int, ...], settings: OnlineSettings, head=None):
        self.model, self.vocab_size, self.aux, self.settings = model, vocab_size, tuple(aux), settings
        self.buffer = ReplayBuffer(settings.buffer_tokens)
        self.version, self.head = 0, None
        self.alpha: tuple[float, ...] | None = None  # the published head's held-out acceptance by depth (`estimate`)
        self.steps, self.train_seconds, self.decode_seconds = 0, 0.0, 0.0
        self.skipped = 0  # training steps skipped for a non-finite loss or gradient
        self.error: str | None = None  # why inline training stopped (it fails alone: decoding goes on)
        self.idle_seconds = 0.0  # training while nothing decodes (`train_idle`): not charged to the budget
        self.last: dict = {}
        self._gen = torch.Generator().manual_seed(settings.seed)
        self._train: PairHead | None = None
        self._opt: torch.optim.Optimizer | None = None
        self._t2d: Tensor | None = None  # [V]: target id -> draft index (-1: outside the draft vocabulary)
        self._since_publish, self._tick = 0, None
        self.inline = True  # train between decoding steps (`tick`); False: only when the owner calls `train`
        if head is not None:
            self._adopt(head)
            self.publish()

    # --- the head ----------------------------------------------------------------------------------------
    def _adopt(self, head: PairHead) -> None:
        """Train this head from now on (its own draft vocabulary)."""
        self._train = head
        head.train().requires_grad_(True)  # a loaded head comes frozen (inference)
        ids = torch.arange(len(head.d2t), device=head.d2t.device) + head.d2t  # [V_d]: target ids
        self._t2d = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=ids.device)
        self._t2d[ids] = torch.arange(len(ids), device=ids.device)
        trained = [p for p in head.parameters() if p.requires_grad]
        self._opt = torch.optim.AdamW(trained, lr=self.settings.lr, weight_decay=0.0)

    def _build(self) -> None:
        """The first head: its draft vocabulary from the buffer's tokens (generated first, then prompts)."""
        seqs = self.buffer.sequences()
        vocab_ids = choose_vocab(
            [e.ids for e in seqs], [e.prompt for e in seqs], self.vocab_size, self.settings.draft_vocab
        )
        self._adopt(init_head(self.model, vocab_ids, self.aux))

    def replace_head(self, head: PairHead) -> int:
        """Train `head` from now on (a fresh optimizer) and publish it; returns the new version."""
        self._adopt(head)
        return self.publish()

    def publish(self) -> int:
        """The trained head becomes the drafting head (a frozen copy; its time counts as training); returns the
        version drafting uses (unchanged when the trained head holds a non-finite weight: it is not published)."""
        if self._train is None:
            return self.version
        t0 = time.perf_counter()
        if all(bool(torch.isfinite(p).all()) for p in self._train.parameters()):
            embed = self._train.embed  # shared with the target: not copied
            head = copy.deepcopy(self._train, memo={id(embed): embed}).eval().requires_grad_(False)
            self.alpha = self.estimate(head)
            self.head, self.version = head, self.version + 1
        self._since_publish = 0
        self.train_seconds += time.perf_counter() - t0
        return self.version

    # --- data ----------------------------------------------------------------------------------------------
    def record(self, key: int, ids: list[int], aux: Tensor, top_ids: Tensor, top_p: Tensor) -> None:
        self.buffer.extend(key, ids, aux, top_ids, top_p)

    # --- training ------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether training may run: it has not failed, there is training data, and a head to train or enough data
        to build one."""
        if self.error is not None or not self.buffer.trainable():
            return False
        return self._train is not None or self.buffer.generated >= self.settings.min_tokens

    def train_step(self, tokens: int | None = None) -> dict:
        """One optimizer step on a sampled batch of about `tokens` tokens (None: `batch_tokens`); returns its loss
        and top-1 agreement per unroll step."""
        if self._train is None:
            self._build()
        s, head = self.settings, self._train
        t0 = time.perf_counter()
        parts = self.buffer.sample(tokens or s.batch_tokens, s.window, self._gen)
        if not parts:  # no training sequence (yet): nothing to do
            return {}
        ids, lengths, aux, p = self._batch(parts)
        for group in self._opt.param_groups:
            group["lr"] = s.lr * min(1.0, (self.steps + 1) / s.warmup)
        loss, agree = ttt_loss(head, ids, lengths, aux, p, s.ttt, s.decay)
        self._opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(norm))
        if finite:  # a non-finite loss or gradient (bad features) changes nothing
            self._opt.step()
        self.steps, self._since_publish = self.steps + finite, self._since_publish + finite
        self.skipped += not finite
        self.train_seconds += time.perf_counter() - t0
        self.last = {"loss": loss.item() if finite else None, "top1": agree}
        return self.last

    def _padded(self, parts: list[Slice]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Slices, padded: ids [B, n], lengths [B], aux [B, n, F] (the head's dtype), p [B, n, V_d] (the target's
        top-K probabilities on the draft vocabulary, not renormalized) and soft [B, n] (positions whose p is the
        target's distribution, not a prompt's next token)."""
        dev = self._t2d.device
        n = max(len(x[0]) for x in parts)
        B, Vd = len(parts), len(self._train.d2t)
        ids = torch.zeros((B, n), dtype=torch.int64, device=dev)
        aux = torch.zeros((B, n, parts[0][1].shape[-1]), dtype=torch.float32, device=dev)
        p = torch.zeros((B, n, Vd), dtype=torch.float32, device=dev)
        soft = torch.zeros((B, n), dtype=torch.bool, device=dev)
        for b, (x, a, top, prob, first_soft) in enumerate(parts):
            m = len(x)
            ids[b, :m] = torch.tensor(x, device=dev)
            aux[b, :m] = a.float()
            d = self._t2d[top]  # [m, K]: draft indices (-1 outside)
            p[b, :m].scatter_add_(-1, d.clamp(min=0), prob.float() * (d >= 0))
            soft[b, first_soft:m] = True
        lengths = torch.tensor([len(x[0]) for x in parts], device=dev)
        return ids, lengths, aux.to(next(self._train.parameters()).dtype), p, soft

    def _batch(self, parts: list[Slice]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A training batch of sampled slices: ids, lengths, aux and p renormalized on the draft vocabulary
        (`_padded`; a position none of whose top-K ids is drafted weighs nothing)."""
        ids, lengths, aux, p, _ = self._padded(parts)
        return ids, lengths, aux, p / p.sum(-1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def estimate(self, head: PairHead) -> tuple[float, ...] | None:
        """The head's acceptance by draft position (1, 2, 3+) on the held-out sequences at temperature 1: per
        emitted position, sum_x min(p(x), q(x)) over the target's top-K ids (a lower bound), q from the
        training-time test's unroll step for that depth; None without held-out data."""
        s = self.settings
        parts = self.buffer.held_out(s.eval_tokens, s.window)
        if not parts or self._t2d is None:
            return None
        ids, lengths, aux, p, soft = self._padded(parts)
        slots = torch.arange(ids.shape[1], device=ids.device).view(1, -1)
        alphas = []
        for step, logits in enumerate(ttt_logits(head, ids, lengths, aux, s.ttt)):
            w = soft & (slots >= step + 1) & (slots < lengths.view(-1, 1))  # [B, n]
            if not bool(w.any()):
                break
            overlap = torch.minimum(p, logits.float().softmax(-1)).sum(-1)  # [B, n]
            alphas.append(float((overlap * w).sum() / w.sum()))
        return tuple(alphas) or None

    def train_between(self, decode_seconds: float) -> float:
        """Between batches (a `RolloutEngine`'s rollouts): train for the budget's share of `decode_seconds` of
        decoding, budget / (1 - budget) times it; returns the seconds spent. A failure stops training (logged,
        `error`): the rollouts it follows are never lost to it."""
        self.decode_seconds += decode_seconds
        b, t0 = self.settings.budget, time.perf_counter()
        try:
            return self.train(seconds=decode_seconds * b / (1 - b))
        except Exception as e:
            self.stop_training(e)
            return time.perf_counter() - t0

    def train(self, seconds: float | None = None, steps: int | None = None) -> float:
        """Train for about `seconds` (or `steps` steps) if there is data, then publish; returns the seconds spent."""
        if not self.ready() or (seconds is None and steps is None):
            return 0.0
        t0, done = time.perf_counter(), 0
        while (steps is None or done < steps) and (seconds is None or time.perf_counter() - t0 < seconds):
            self.train_step()
            done += 1
        if done:
            self.publish()
        return time.perf_counter() - t0

    def train_idle(self, publish: bool = False) -> float:
        """One small training step (`inline_tokens`, as between decoding steps) while nothing decodes (a server with
        no request running), published every `publish_every` steps (`publish`: now); its time goes to
        `idle_seconds`, not to the budget's books. Returns the seconds spent."""
        if not self.ready():
            return 0.0
        t0, charged = time.perf_counter(), self.train_seconds
        self.train_step(self.settings.inline_tokens)
        self.idle_seconds += self.train_seconds - charged
        self.train_seconds = charged
        if publish or self._since_publish >= self.settings.publish_every:
            self.publish()
        return time.perf_counter() - t0

    def tick(self) -> None:
        """Between two steps while decoding: train one step when the budget allows (and `inline`), publishing
        every `publish_every` steps (time between ticks counts as decoding)."""
        if not self.inline:
            return
        now = time.perf_counter()
        if self._tick is not None:
            self.decode_seconds += now - self._tick
        b = self.settings.budget
        if self.ready() and self.train_seconds < b * (self.decode_seconds + self.train_seconds):
            try:
                self.train_step(self.settings.inline_tokens)
                if self._since_publish >= self.settings.publish_every:
                    self.publish()
            except Exception as e:  # training fails alone: the requests decoding go on, with the last version
                self.stop_training(e)
        self._tick = time.perf_counter()

    def stop_training(self, error: Exception) -> None:
        """Training failed: no more training (the published head keeps drafting); logged, and kept in `error` and
        `stats()`."""
        self.inline, self.error = False, f"{type(error).__name__}: {error}"
        log.warning("online head training stopped: %s", self.error)

    def idle(self) -> None:
        """Decoding paused (between batches): the time until the next tick is not decoding."""
        self._tick = None

    # --- persistence ---------------------------------------------------------------------------------------
    def save(self, folder: str | Path, target_layers: int | None = None) -> None:
        """The published head in the SafeAILab / SpecForge layout (`--draft DIR`, vLLM, SGLang), and beside it the
        training state (`online_state.pt`: the trained head, optimizer, counters) a restart resumes."""
        if self.head is None:
            raise ValueError("the online head has no version yet: nothing to save")
        folder = Path(folder)
        save_eagle3(self.head, folder, self.vocab_size, target_layers)
        tmp = folder / (STATE + ".tmp")
        torch.save(self.state(), tmp)
        tmp.replace(folder / STATE)

    def resume(self, folder: str | Path) -> bool:
        """The training state saved beside the head this learner started from (False: none there)."""
        path = Path(folder) / STATE
        if not path.is_file() or self._train is None:
            return False
        self.load_state(torch.load(path, weights_only=True, map_location=self._t2d.device))
        return True

    def state(self) -> dict | None:
        """The training state on the CPU (the trained head, optimizer, counters; not the replay buffer), for
        `load_state` in another process (a restarted replica) or `save`; None before the first head."""
        if self._train is None:
            return None
        opt = self._opt.state_dict()
        opt["state"] = {k: {n: _cpu(v) for n, v in st.items()} for k, st in opt["state"].items()}
        state = {"head": {k: _cpu(v) for k, v in self._train.state_dict().items()}, "opt": opt}
        return state | {"version": self.version, "steps": self.steps, "train_seconds": self.train_seconds}

    def load_state(self, state: dict) -> int:
        """Continue from `state()`'s (a learner with no head yet builds one on the saved draft vocabulary) and
        publish it under the saved version; returns the version."""
        if self._train is None:
            d2t = state["head"]["d2t"]
            self._adopt(init_head(self.model, torch.arange(len(d2t)) + d2t, self.aux))
        self._train.load_state_dict(state["head"])
        self._opt.load_state_dict(state["opt"])
        self.steps, self.train_seconds = state["steps"], state["train_seconds"]
        self.version = state["version"] - 1
        return self.publish()

    def stats(self) -> dict:
        """version, tokens_seen (generated tokens recorded), buffer_tokens, train_seconds, train_steps, and the last
        step's loss and top-1 agreement per unroll step."""
        return {
            "version": self.version,
            "tokens_seen": self.buffer.generated,
            "buffer_tokens": self.buffer.tokens,
            "train_seconds": round(self.train_seconds, 3),
            "train_steps": self.steps,
            "alpha": None if self.alpha is None else [round(a, 3) for a in self.alpha],
            "skipped_steps": self.skipped,
            "error": self.error,
            **self.last,
        }


class OnlineHeadProposer(Proposer):
    """Drafts chains with the learner's newest head (none yet: nothing), and records every verified row for it.
    The engine hands it each verified step's target distributions (`observe_targets`, through the step observer
    the drafter factory registers: `engine.drafters`), `keep_top` of them per emitted token.

    Args:
        learner: The head and its training.
        target_runner: The target's runner (fast or transformers), whose cache keeps the hidden states the head
            reads (this constructor asks it to capture them, before its first batch).
        vocab_size: Ids the target and the head share.
        stop_below: A chain stops below this own probability (`DraftModelProposer`).
    """

    name = "online-head"
    cost_prior = 0.1

    def __init__(self, learner: OnlineLearner, target_runner, vocab_size: int, stop_below):
        target_runner.capture_hidden(learner.aux)
        self.learner, self.target, self.vocab_size, self.stop_below = learner, target_runner, vocab_size, stop_below
        self.keep_top = learner.settings.top_k
        self._inner: DraftModelProposer | None = None
        self._version = 0  # the version the inner proposer drafts with
        self._capacity = 0
        self._keys: list[int] = []  # per row: its buffer sequence
        self._recorded: list[int] = []  # per row: positions recorded so far
        self._targets: tuple[Tensor, Tensor] | None = None  # the step's ([B, D + 1, K] ids, log-probabilities)
        self._used = False  # the inner proposer drafted this step (its update follows)

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self, view: BatchView, capacity: int) -> None:
        self.learner.idle()
        self._capacity = capacity
        self._keys = [self.learner.buffer.begin(len(s)) for s in view.seqs]
        self._recorded = [0] * len(view.seqs)
        self._inner = None  # (re)built for this batch at its first draft

    def add(self, view: BatchView, capacity: int) -> None:
        self._capacity = max(self._capacity, capacity)
        self._keys += [self.learner.buffer.begin(len(s)) for s in view.seqs]
        self._recorded += [0] * len(view.seqs)
        if self._inner is not None:
            self._inner.add(view, capacity)

    def release(self) -> None:
        self._inner = None  # its head's cache; the next batch's first draft builds it again

    def select(self, rows: list[int]) -> None:
        self._keys = [self._keys[r] for r in rows]
        self._recorded = [self._recorded[r] for r in rows]
        if self._inner is not None:
            self._inner.select(rows)

    # --- drafting --------------------------------------------------------------------------------------------
    def signals(self, view: BatchView) -> list[tuple[Signal | None]]:
        """Nothing before the first version; then one bucket per version, its prior the version's held-out
        acceptance (the controller pools each version's acceptance on its own, shrunk towards that)."""
        if self.learner.head is None:
            return [(None,)] * len(view.seqs)
        signal = Signal(("version", self.learner.version), ANY_DEPTH, self.learner.alpha)
        return [(signal,)] * len(view.seqs)

    def propose(self, view: BatchView, caps: list[int]) -> Draft:
        if self.learner.head is None or (max(caps, default=0) == 0 and self._inner is None):
            self._used = False
            return Draft.empty(len(view.seqs), view.device)
        if self._inner is None or self._version != self.learner.version:
            self._inner = self._drafter(self.learner.head)
            self._inner.start(view, self._capacity)
            self._version = self.learner.version
        self._used = True
        return self._inner.propose(view, caps)

    def _drafter(self, head: PairHead) -> DraftModelProposer:
        target = self.target
        proposer = DraftModelProposer(
            head, self.vocab_size, self.stop_below, runner=lambda m, v: PairRunner(m, target, v)
        )
        proposer.name = "eagle3-head"
        return proposer

    # --- learning --------------------------------------------------------------------------------------------
    def observe_targets(self, targets: tuple[Tensor, Tensor] | None) -> None:
        """The verified step's ([B, D + 1, K] ids, log-probabilities) at the emitted tokens; read by `update`."""
        self._targets = targets

    def update(self, view: BatchView, old_lengths: list[int], draft: Draft, paths: list[list[int]]) -> None:
        if self._inner is not None and self._used:
            self._inner.update(view, old_lengths, draft, paths)
        self._record(view, old_lengths)
        self._targets = None
        self.learner.tick()

    def _record(self, view: BatchView, old_lengths: list[int]) -> None:
        """Each row's positions the target now holds and has a distribution for: prompt positions with their next
        token as a hard label, emitted ones with the step's top-K."""
        cache = self.target.cache
        if cache is None or not cache.extras or self._targets is None:
            return
        top_ids, top_lp = self._targets  # [B, D + 1, K]
        feats = cache.extras[0]
        K = top_ids.shape[-1]
        for b, seq in enumerate(view.seqs):
            held, start = len(seq) - 1, self._recorded[b]  # the new pending token is not in the cache yet
            first = old_lengths[b] - 1  # the position of the step's first emitted token's distribution
            if held <= start:
                continue
            n_hard = max(0, first - start)  # prompt positions: their next token
            ids, p = hard_labels(seq[start + 1 : start + 1 + n_hard], K, top_ids.device)
            lo = max(start, first) - first
            ids = torch.cat([ids, top_ids[b, lo : held - first]])
            p = torch.cat([p, top_lp[b, lo : held - first].exp().to(torch.float16)])
            self.learner.record(self._keys[b], list(seq[start:held]), feats[b, start:held], ids, p)
            self._recorded[b] = held
