"""The generate loop: draft, verify in one target pass, commit, roll back — for a batch of requests.

    gen = SpeculativeGenerator(target, draft)            # draft: a LoadedModel, "ngram", or None (plain)
    outs = gen.generate(["def fib(n):"], SamplingParams(temperature=0.7, seed=1), max_new_tokens=64)
    for event in gen.stream("Hello", SamplingParams()):  # text deltas as they are accepted
        print(event.delta, end="")

Every emitted token follows the target's distribution exactly (verify_chain); the target's cache is
rolled back to the accepted prefix after each step, the draft's too. Rows finish independently (EOS,
stop strings, max_new_tokens, the context end) and leave the batch. Each request draws its randomness
from its own generator (SamplingParams.seed, or a seed drawn from torch's global RNG), so with a fixed
gamma a seeded request gives the same tokens alone or in any batch — bit for bit as far as the kernels
are batch-invariant: padding changes summation order in the last bits, which can flip a token only at a
near-exact tie (the distribution is unaffected).

Logprobs convention (both under the target, at each returned token):
    logprobs[i]     = log p(x_i): the processed distribution actually sampled from (penalties, temperature,
                      top-k / top-p / min-p applied; a greedy request gets 0.0);
    raw_logprobs[i] = log softmax(logits)(x_i): the model's own distribution (temperature 1, nothing
                      truncated or penalised) — what RL importance ratios usually need.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..drafting import BatchView, DraftModelProposer, PromptLookupProposer, Proposal, Proposer, TreeDraftProposer, TreeSpec
from ..sampling import (SamplingParams, counts_at_draft_positions, counts_at_tree_nodes, probs_from_logits,
                        verify_chain, verify_tree)
from .adaptive import GammaController
from ..model.loading import LoadedModel, shared_vocab_size
from ..model.fast import make_runner
from .stats import SpecStats

__all__ = ["Completion", "GenerationSession", "SpeculativeGenerator", "StreamEvent"]


@dataclass
class Completion:
    index: int  # position of the request in the call
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (EOS excluded)
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_new_tokens or the context end)
    stop_reason: str | int | None  # the stop string or EOS id that ended it
    logprobs: list[float] | None  # log p(x) under the processed target distribution
    raw_logprobs: list[float] | None  # log softmax(target logits)(x), temperature 1, no truncation
    stats: SpecStats
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position: (token, raw logprob), best first
    key: object = None  # the handle given to GenerationSession.add


@dataclass
class StreamEvent:
    index: int
    delta: str  # new text, safe to print (no half characters, no partial stop string)
    token_ids: list[int]  # tokens accepted in this step
    completion: Completion | None = None  # set on the request's last event
    key: object = None  # the handle given to GenerationSession.add
    raw_logprobs: list[float] = field(default_factory=list)  # raw target logprob of each of token_ids
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, raw logprob) alternatives


@dataclass
class _Row:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    seq: list[int]
    max_new: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    gamma: int | None = None  # this request's draft length (0: no speculation); None: the generator's choice
    top_logprobs: int = 0  # alternatives per position to return (raw target log-softmax)
    key: object = None  # the caller's handle (abort)
    t_start: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    sent: str = ""  # text already streamed
    successes: int = 0  # accepted drafts (adaptive gamma)
    failures: int = 0  # rejections (adaptive gamma)
    stats: SpecStats = field(default_factory=SpecStats)
    done: Completion | None = None


class SpeculativeGenerator:
    """Speculative decoding with a target model and a drafter.

    draft: a `LoadedModel` (draft model), "self" (the target's own weights, quantized: needs draft_quant),
    "ngram" (prompt lookup), a `Proposer`, or None / "none" (plain decoding through the same loop: the
    honest baseline). gamma: drafts per step (an upper bound when a draft model stops early), or "auto".
    draft_stop_below: a draft model stops drafting for a row once its own probability of a drafted token
    falls below this (None: always draft gamma tokens). runner: "auto" (verispec's fast forward where the
    architecture is supported, else transformers'), "fast" or "hf", for target and draft model.
    draft_quant: None, "int8" or "int4": weight-only quantized draft weights (lossless: q is what the
    quantized draft sampled from).
    tree: None (chains) or a token tree per step — a `TreeSpec` or its string form ("4-2-2-1": children per
    node at each depth; "dynamic-D-K-M": EAGLE-2), drafted by the draft model (or, for "ngram", several prompt
    matches as branches) and verified in one tree-masked target pass with verify_tree; tree_rule: how children
    are drawn and verified ("deterministic" top-k, "iid", "without_replacement"). With a tree, gamma only
    switches speculation on or off per request; the tree's shape sets the draft.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | Proposer | str | None = "ngram", *,
                 gamma: int | str = "auto", max_gamma: int = 8, ngram_sizes: Sequence[int] = (3, 2, 1),
                 draft_stop_below: float | None = 0.3, runner: str = "auto", draft_quant: str | None = None,
                 verifier=verify_chain, tree: TreeSpec | str | None = None, tree_rule: str | None = None,
                 tree_verifier=verify_tree):
        self.target = target
        if isinstance(tree, str):
            tree = TreeSpec.parse(tree, tree_rule)
        elif tree_rule is not None and (tree is None or tree.rule != tree_rule):
            raise ValueError("tree_rule needs a tree (or matches the TreeSpec's rule)")
        if tree is not None and not isinstance(tree, TreeSpec):
            raise ValueError(f"tree must be a TreeSpec or a string such as '4-2-2-1', got {tree!r}")
        self.tree = tree
        self.tree_verifier = tree_verifier  # verify_tree's interface; swapped only by certification
        # the chain-verification function (verify_chain's interface); `verispec certify --inject` and the lossy
        # variants of the study swap it, nothing else should
        self.verifier = verifier
        self.tokenizer = target.tokenizer
        if draft_quant is not None and not (isinstance(draft, LoadedModel) or draft == "self"):
            raise ValueError(f"draft_quant={draft_quant!r} applies to a draft model or draft='self', not to {draft!r}")
        if draft == "self" and draft_quant is None:
            raise ValueError("draft='self' needs draft_quant ('int8' or 'int4'): an unquantized copy of the target "
                             "costs as much as the target")
        if isinstance(draft, LoadedModel) or draft == "self":
            draft_model = target if draft == "self" else draft
            self.vocab_size = shared_vocab_size(target, draft_model)
            if tree is not None:
                self.proposer: Proposer | None = TreeDraftProposer(draft_model.model, self.vocab_size, tree,
                                                                   runner=runner, quant=draft_quant)
            else:
                self.proposer = DraftModelProposer(draft_model.model, self.vocab_size, draft_stop_below,
                                                   runner=runner, quant=draft_quant)
        else:
            self.vocab_size = shared_vocab_size(target, None)
            if draft is None or draft == "none":
                if tree is not None:
                    raise ValueError("a tree needs a drafter (a draft model, 'self' or 'ngram')")
                self.proposer = None
            elif draft == "ngram":
                self.proposer = PromptLookupProposer(tuple(ngram_sizes), tree=tree)
            elif isinstance(draft, Proposer):
                if tree is not None and (not hasattr(draft, "propose_tree") or getattr(draft, "spec", None) is None):
                    raise ValueError(f"{type(draft).__name__} cannot propose trees here: it needs propose_tree and "
                                     "its own TreeSpec (e.g. PromptLookupProposer(tree=spec))")
                self.proposer = draft
            else:
                raise ValueError(f"draft must be a loaded model, 'self', 'ngram', 'none' or a Proposer, got {draft!r}")
        self.controller = GammaController(0 if self.proposer is None else gamma, max_gamma)
        self.runner = make_runner(target.model, self.vocab_size, runner=runner)
        self.device = self.runner.device
        eos = set()
        for source in (getattr(self.tokenizer, "eos_token_id", None),
                       getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(int(x) for x in source)
        self.eos_ids = eos
        self.max_positions = self.runner.max_positions
        self.stats = SpecStats()  # pooled over every call

    # --- input handling -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty")
            if chat:
                messages = [{"role": "user", "content": prompt}]
            else:
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        elif len(prompt) and isinstance(prompt[0], dict):
            messages = list(prompt)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompt is empty")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
            return ids
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("chat=True but the tokenizer has no chat template")
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(enc, "keys"):
            enc = enc["input_ids"]
        return [int(t) for t in enc]

    def _row(self, index: int, prompt, params: SamplingParams, chat: bool) -> _Row:
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be one SamplingParams, or one per prompt")
        ids = self.encode(prompt, chat)
        if not ids:
            raise ValueError(f"prompt {index} is empty after tokenization")
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; the model's context is {self.max_positions}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()))
        return _Row(index, ids, params, torch.Generator().manual_seed(seed), list(ids))

    def _rows(self, prompts, params, chat: bool) -> list[_Row]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params must be one SamplingParams, or one per prompt")
        return [self._row(i, prompt, sp, chat) for i, (prompt, sp) in enumerate(zip(prompts, params))]

    # --- public API -----------------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                 max_new_tokens: int = 128, stop: Sequence[str] = (), chat: bool = False,
                 ignore_eos: bool = False) -> list[Completion]:
        """Generate for one prompt (str or token ids) or a list of them; returns one Completion each."""
        done: list[Completion] = []
        for event in self.stream(prompts, params, max_new_tokens=max_new_tokens, stop=stop, chat=chat,
                                 ignore_eos=ignore_eos):
            if event.completion is not None:
                done.append(event.completion)
        return sorted(done, key=lambda c: c.index)

    def stream(self, prompts, params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
               max_new_tokens: int = 128, stop: Sequence[str] = (), chat: bool = False,
               ignore_eos: bool = False) -> Iterator[StreamEvent]:
        """Like generate, but yields text deltas per request as steps are accepted."""
        max_new_tokens, stop = _check_limits(max_new_tokens, stop)
        rows = self._rows(prompts, params, chat)
        for r in rows:
            r.max_new, r.stop, r.ignore_eos = max_new_tokens, stop, ignore_eos
        return self._loop(rows)

    def session(self) -> GenerationSession:
        """A continuous-batching session: requests join (`add`) and leave (finish, `abort`) between steps."""
        return GenerationSession(self)

    def _loop(self, rows: list[_Row]) -> Iterator[StreamEvent]:
        t_start = time.perf_counter()
        sess = GenerationSession(self)
        sess.pending.extend(rows)
        while sess.num_active:
            yield from sess.step()
        pooled = sess.stats
        pooled.wall_time = time.perf_counter() - t_start
        pooled.other_time = pooled.wall_time - pooled.draft_time - pooled.verify_time
        self.last_stats = pooled
        self.stats.merge(pooled)

    # --- one step -------------------------------------------------------------------------------------
    def _view(self, rows: list[_Row], penalties: bool, prompt_mask, counts) -> BatchView:
        return BatchView(seqs=[r.seq for r in rows], params=[r.params for r in rows],
                         generators=[r.generator for r in rows], prompt_mask=prompt_mask if penalties else None,
                         output_counts=counts if penalties else None, vocab_size=self.vocab_size, device=self.device)

    def _capacity(self, rows: list[_Row]) -> int:
        """KV slots the rows can need: prompt, budget, the longest draft chunk and the pending token."""
        slack = max(self.controller.max_gamma, self.tree.cache_slots if self.tree else 0) + 2
        capacity = max(len(r.prompt) + r.max_new + slack for r in rows)
        if self.max_positions is not None:
            capacity = min(capacity, self.max_positions + slack)
        return capacity

    def _step(self, rows: list[_Row], view: BatchView, pooled: SpecStats):
        """Draft, verify in one target pass. Returns per row: drafts, accepted drafts, emitted tokens, the
        processed and raw target logprobs at the emitted positions, and the top raw alternatives (or None)."""
        dev = self.device
        caps = [min(r.max_new - len(r.tokens), (self.max_positions or 1 << 30) - len(r.seq)) - 1 for r in rows]
        if self.tree is not None:
            return self._tree_step(rows, view, pooled, caps)
        probe = self.controller.wants_plain_probe(len(rows))  # measure T(1) at this batch size once
        gammas = [max(0, min(r.gamma, c)) if r.gamma is not None
                  else 0 if probe
                  else self.controller.choose(r.successes, r.failures, c, r.stats.target_passes, batch=len(rows))
                  for r, c in zip(rows, caps)]
        t0 = time.perf_counter()
        if self.proposer is not None and max(gammas) > 0:
            prop = self.proposer.propose(view, gammas)
        else:
            prop = Proposal.empty(len(rows), dev)
        t1 = time.perf_counter()
        nd = prop.num_draft
        k = max(nd)
        drafts = prop.token_ids[:, :k]  # [B, k]
        q = prop.probs[:, :k] if prop.probs is not None else None  # [B, k, V]
        logits = self.runner.forward([[r.seq[-1]] + drafts[b, : nd[b]].tolist() for b, r in enumerate(rows)])
        logits = logits[:, : k + 1]  # [B, k+1, V]
        counts = counts_at_draft_positions(view.output_counts, drafts) if view.output_counts is not None else None
        p = probs_from_logits(logits, view.params, prompt_mask=view.prompt_mask, output_counts=counts)
        out = self.verifier(p, drafts, q, torch.tensor(nd, device=dev), view.generators, check=False)
        t2 = time.perf_counter()
        pooled.draft_time += t1 - t0
        pooled.verify_time += t2 - t1
        if k > 0:
            self.controller.observe_draft((t1 - t0) / k, len(rows))
        self.controller.observe_verify(k + 1, t2 - t1, len(rows))
        tok = out.token_ids.clamp(min=0).unsqueeze(-1)  # [B, k+1, 1] (padding -> 0, never read)
        lp = p.gather(-1, tok).squeeze(-1).log().tolist()  # log p(x) under the processed distribution
        log_z = logits.logsumexp(-1, keepdim=True)  # [B, k+1, 1]
        raw = (logits.gather(-1, tok) - log_z).squeeze(-1).tolist()  # raw log-softmax
        top = None
        n_top = max(r.top_logprobs for r in rows)
        if n_top:
            values, ids = logits.topk(n_top, dim=-1)  # [B, k+1, n_top]
            top = ((values - log_z).tolist(), ids.tolist())
        na = out.num_accepted.tolist()
        emitted = [row[: a + 1] for row, a in zip(out.token_ids.tolist(), na)]
        return nd, na, emitted, lp, raw, top, None

    def _tree_step(self, rows: list[_Row], view: BatchView, pooled: SpecStats, caps: list[int]):
        """One tree step: draft a tree per row, verify every node in one tree-masked target pass. Returns what
        _step returns, with drafted = the tree's depth, plus (accepted paths as node indices, node counts) per row."""
        dev = self.device
        caps = [0 if r.gamma == 0 else c for r, c in zip(rows, caps)]
        t0 = time.perf_counter()
        prop = self.proposer.propose_tree(view, caps)
        t1 = time.perf_counter()
        nn = prop.num_nodes
        N = max(nn, default=0)
        ids, par = prop.token_ids[:, :N], prop.parents[:, :N]  # [B, N]
        chunk = [[r.seq[-1]] + ids[b, : nn[b]].tolist() for b, r in enumerate(rows)]
        chunk_par = [[-1] + [p + 1 for p in par[b, : nn[b]].tolist()] for b in range(len(rows))]
        logits = self.runner.forward(chunk, parents=chunk_par)[:, : N + 1]  # [B, N + 1, V]: root, then nodes
        counts = counts_at_tree_nodes(view.output_counts, ids, par) if view.output_counts is not None else None
        p = probs_from_logits(logits, view.params, prompt_mask=view.prompt_mask, output_counts=counts)
        q = prop.probs[:, : N + 1] if prop.probs is not None else None
        out = self.tree_verifier(p, ids, par, q, torch.tensor(nn, device=dev), view.generators, rule=prop.rule,
                                 check=False)
        t2 = time.perf_counter()
        pooled.draft_time += t1 - t0
        pooled.verify_time += t2 - t1
        na = out.num_accepted.tolist()
        paths = [row[:a] for row, a in zip(out.path.tolist(), na)]
        slots = torch.zeros_like(out.token_ids)  # [B, D + 1]: slot of each emitted token's distribution
        for b, path in enumerate(paths):
            slots[b, 1: len(path) + 1] = torch.tensor([n + 1 for n in path], dtype=torch.int64)
        sl = slots.to(dev).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        p_e, logits_e = p.gather(1, sl), logits.gather(1, sl)  # [B, D + 1, V] at the emitted positions
        tok = out.token_ids.clamp(min=0).unsqueeze(-1)
        lp = p_e.gather(-1, tok).squeeze(-1).log().tolist()
        log_z = logits_e.logsumexp(-1, keepdim=True)
        raw = (logits_e.gather(-1, tok) - log_z).squeeze(-1).tolist()
        top = None
        n_top = max(r.top_logprobs for r in rows)
        if n_top:
            values, top_ids = logits_e.topk(n_top, dim=-1)
            top = ((values - log_z).tolist(), top_ids.tolist())
        emitted = [row[: a + 1] for row, a in zip(out.token_ids.tolist(), na)]
        return prop.depth, na, emitted, lp, raw, top, (paths, nn)

    def _take(self, r: _Row, new: list[int], lp: list[float], raw: list[float], top) -> list[int]:
        """Append a step's tokens to the row's output until EOS, the budget or the context end.
        top: None or (values [k+1][n], ids [k+1][n]) for this row."""
        returned: list[int] = []
        for j, t in enumerate(new):
            if not r.ignore_eos and t in self.eos_ids:
                self._finish(r, "stop", t)
                break
            r.tokens.append(t)
            r.logprobs.append(lp[j])
            r.raw_logprobs.append(raw[j])
            if r.top_logprobs:
                values, ids = top
                r.top.append(list(zip(ids[j][: r.top_logprobs], values[j][: r.top_logprobs])))
            returned.append(t)
            if len(r.tokens) >= r.max_new:
                self._finish(r, "length", None)
                break
        if r.done is None and self.max_positions is not None and len(r.seq) >= self.max_positions:
            self._finish(r, "length", None)
        return returned

    def _finish(self, r: _Row, reason: str, stop_reason) -> None:
        r.done = Completion(index=r.index, prompt_token_ids=r.prompt, token_ids=list(r.tokens), text="",
                            finish_reason=reason, stop_reason=stop_reason, logprobs=list(r.logprobs),
                            raw_logprobs=list(r.raw_logprobs), stats=r.stats,
                            top_logprobs=list(r.top) if r.top_logprobs else None, key=r.key)

    def _text_event(self, r: _Row, new_tokens: list[int]) -> StreamEvent:
        """Decode, apply stop strings, and return the safe text delta for this step."""
        stop = r.stop
        text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        hit = min(((text.find(s), s) for s in stop if s in text), default=None)
        if hit is not None:
            cut, s = hit
            text = text[:cut]
            n = len(r.tokens) - len(new_tokens)  # shortest token prefix whose text contains the stop string
            while n < len(r.tokens) and s not in self.tokenizer.decode(r.tokens[:n], skip_special_tokens=True):
                n += 1
            del r.tokens[n:], r.logprobs[n:], r.raw_logprobs[n:], r.top[n:]
            self._finish(r, "stop", s)
        if r.done is not None:
            r.done.text = text
            r.done.token_ids = list(r.tokens)
            r.done.logprobs, r.done.raw_logprobs = list(r.logprobs), list(r.raw_logprobs)
            r.done.top_logprobs = list(r.top) if r.top_logprobs else None
            delta = text[len(r.sent):] if text.startswith(r.sent) else ""
            r.sent = text
            return StreamEvent(r.index, delta, new_tokens, key=r.key)
        safe = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its next token
        for s in stop:  # hold back a suffix that may be the start of a stop string
            for m in range(min(len(s) - 1, len(safe)), 0, -1):
                if safe.endswith(s[:m]):
                    safe = safe[: len(safe) - m]
                    break
        delta = ""
        if safe.startswith(r.sent) and len(safe) > len(r.sent):
            delta = safe[len(r.sent):]
            r.sent = safe
        return StreamEvent(r.index, delta, new_tokens, key=r.key)


def _check_limits(max_new_tokens, stop) -> tuple[int, tuple[str, ...]]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stop = tuple(stop)
    if any(not isinstance(s, str) or s == "" for s in stop):
        raise ValueError("stop strings must be non-empty strings")
    return max_new_tokens, stop


class GenerationSession:
    """Continuous batching over one SpeculativeGenerator: requests join (`add`) and leave (they finish, or
    `abort`) between steps; `step()` runs one draft + verify step for every active request.

    A request's randomness is its own generator, and with a fixed draft length its tokens do not depend on
    which other requests share the batch (as far as the kernels are batch-invariant; see the module doc).
    Not thread-safe: drive it from one thread (the server's engine thread does).
    """

    def __init__(self, gen: SpeculativeGenerator):
        self.gen = gen
        self.rows: list[_Row] = []  # in the batch, in cache row order
        self.pending: list[_Row] = []  # join at the next step
        self.stats = SpecStats()  # pooled over this session
        self.prompt_mask: torch.Tensor | None = None  # [B, V] bool: tokens in each row's prompt
        self.counts: torch.Tensor | None = None  # [B, V] float32: each row's generated-token counts
        self._aborted: set = set()
        self.last_step: list[tuple[int, int]] = []

    @property
    def num_active(self) -> int:
        return len(self.rows) + len(self.pending)

    def add(self, prompt, params: SamplingParams = SamplingParams(), *, max_new_tokens: int = 128,
            stop: Sequence[str] = (), chat: bool = False, ignore_eos: bool = False, gamma: int | None = None,
            top_logprobs: int = 0, key: object = None, index: int = 0) -> object:
        """Queue a request (validated now; it joins the batch at the next step). Returns its key.
        gamma: this request's draft length (0 turns speculation off), None for the generator's setting;
        top_logprobs: how many best alternatives (raw target logprobs) to return per position."""
        max_new_tokens, stop = _check_limits(max_new_tokens, stop)
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0):
            raise ValueError(f"gamma must be None or an integer >= 0, got {gamma!r}")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {top_logprobs!r}")
        row = self.gen._row(index, prompt, params, chat)
        row.max_new, row.stop, row.ignore_eos = max_new_tokens, stop, ignore_eos
        row.gamma = None if gamma is None else min(gamma, self.gen.controller.max_gamma)
        if self.gen.proposer is None:
            row.gamma = 0
        row.top_logprobs = top_logprobs
        row.key = key if key is not None else object()
        self.pending.append(row)
        return row.key

    def abort(self, key: object) -> None:
        """Drop a request before the next step (its compute stops there)."""
        self._aborted.add(key)

    # --- membership ---------------------------------------------------------------------------------
    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in keep]
        if not self.rows:
            return  # the next admission starts fresh caches
        gen = self.gen
        gen.runner.select(keep)
        if gen.proposer is not None:
            gen.proposer.select(keep)
        idx = torch.tensor(keep, device=gen.device)
        self.prompt_mask, self.counts = self.prompt_mask.index_select(0, idx), self.counts.index_select(0, idx)

    def _admit(self) -> None:
        gen = self.gen
        new, self.pending = self.pending, []
        V, dev = gen.vocab_size, gen.device
        mask = torch.zeros((len(new), V), dtype=torch.bool, device=dev)
        for b, r in enumerate(new):
            mask[b, torch.as_tensor(r.prompt, device=dev)] = True
        counts = torch.zeros((len(new), V), dtype=torch.float32, device=dev)
        capacity = gen._capacity(new)
        draft_capacity = capacity + gen.controller.probe_every + 2  # a plain-decoding backlog, fed in one chunk
        view = gen._view(new, True, mask, counts)
        if not self.rows:
            gen.runner.start(len(new), capacity)
            gen.runner.prefill([r.seq[:-1] for r in new])
            if gen.proposer is not None:
                gen.proposer.start(view, draft_capacity)
            self.prompt_mask, self.counts = mask, counts
        else:
            gen.runner.add_rows([r.seq[:-1] for r in new], capacity)
            if gen.proposer is not None:
                gen.proposer.add(view, draft_capacity)
            self.prompt_mask, self.counts = torch.cat([self.prompt_mask, mask]), torch.cat([self.counts, counts])
        now = time.perf_counter()
        for r in new:
            r.t_start = now
        self.rows.extend(new)

    # --- one step -----------------------------------------------------------------------------------
    def step(self) -> list[StreamEvent]:
        """Admit queued requests, drop aborted ones, run one step; returns this step's events (a finished
        request's last event carries its Completion)."""
        gen = self.gen
        if self._aborted:
            self.pending = [r for r in self.pending if r.key not in self._aborted]
            self._keep([b for b, r in enumerate(self.rows) if r.key not in self._aborted])
            self._aborted.clear()
        if self.pending:
            self._admit()
        rows = self.rows
        if not rows:
            return []
        dev = gen.device
        penalties = any(r.params.uses_penalties for r in rows)
        view = gen._view(rows, penalties, self.prompt_mask, self.counts)
        nd, na, emitted, lp, raw, top, tree = gen._step(rows, view, self.stats)
        paths, nodes = tree if tree is not None else (None, None)
        old_lengths = [len(r.seq) for r in rows]
        if paths is None:
            gen.runner.truncate([n + a for n, a in zip(old_lengths, na)])  # pending + accepted drafts
        else:  # the pending token (chunk slot 0) and the accepted path's nodes (slots n + 1)
            gen.runner.keep_paths([n - 1 for n in old_lengths], [[0] + [n + 1 for n in path] for path in paths])
        for b, r in enumerate(rows):
            r.seq.extend(emitted[b])
            r.stats.observe(nd[b], na[b])
            self.stats.observe(nd[b], na[b])
            r.successes += na[b]
            r.failures += int(na[b] < nd[b])
            if paths is None:
                gen.controller.observe_acceptance(na[b], int(na[b] < nd[b]))
        if paths is not None:
            for b, r in enumerate(rows):
                r.stats.tree_nodes += nodes[b]
                self.stats.tree_nodes += nodes[b]
            if hasattr(gen.proposer, "update_tree"):
                gen.proposer.update_tree(view, paths)
        elif gen.proposer is not None:  # view.seqs are the rows' own lists, already extended
            gen.proposer.update(view, old_lengths, na, nd)

        self.last_step = list(zip(nd, na))  # (drafted, accepted) per row of this step, for metrics
        events: list[StreamEvent] = []
        keep: list[int] = []
        for b, r in enumerate(rows):
            row_top = None if top is None else (top[0][b], top[1][b])
            before = len(r.tokens)
            returned = gen._take(r, emitted[b], lp[b], raw[b], row_top)
            if returned:
                self.counts[b].index_add_(0, torch.tensor(returned, device=dev), torch.ones(len(returned), device=dev))
            event = gen._text_event(r, returned)
            kept = min(before, len(r.tokens))  # a stop string may cut tokens of this step
            event.token_ids = r.tokens[kept:]
            event.raw_logprobs = r.raw_logprobs[kept:]
            event.top_logprobs = r.top[kept:] if r.top_logprobs else None
            if r.done is not None:
                r.stats.output_tokens = len(r.done.token_ids)
                r.stats.wall_time = time.perf_counter() - r.t_start  # this request's latency
                self.stats.output_tokens += len(r.done.token_ids)
                event.completion = r.done
                events.append(event)
            else:
                keep.append(b)
                if event.delta or event.token_ids:
                    events.append(event)
        self._keep(keep)
        return events
