"""What the EAGLE-1, Medusa and MTP tests share: reference forwards written from the papers' and vLLM's equations on
the checkpoints' raw tensors (read with safetensors, not through verispec's loader or modules), the runners under
test over a target, a target whose heads can agree with it, and session driving.

The reference decoder layer is Llama's: y = RMSNorm(x) (none for EAGLE-1's first layer), q / k / v = W y, RoPE
(theta 10000, rotate-half) at the pair's position, causal softmax(q k^T / sqrt(D)) v with the key / value heads
repeated for grouped queries, a = x + o_proj(attn), out = a + down(SiLU(gate(RMSNorm(a))) * up(RMSNorm(a))).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor

from verispec.certify.stats import chisquare_gof
from verispec.engine import SpeculativeGenerator
from verispec.heads import bind_head, head_runner, load_head
from verispec.model.fast import make_runner
from verispec.model.loading import LoadedModel
from verispec.sampling import SamplingParams, probs_from_logits

from ..helpers.heads import HEADS, KV
from ..helpers.tiny import EOS, V, make_model, make_tokenizer

RUNNERS = ("fast", "hf")
TOL = 1e-4
EPS = 1e-6
D = 32 // HEADS

Forward = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (e [T, H], h [T, H], pos [T]) -> logits, fed


# --- the reference --------------------------------------------------------------------------------------------------
def rms(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x: Tensor, pos: Tensor) -> Tensor:
    """x [n, T, D] at positions pos [T]."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos.double().unsqueeze(1) * inv  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def decoder_layer(w: dict, p: str, x: Tensor, pos: Tensor, input_norm: bool = True) -> Tensor:
    """One Llama decoder layer over x [T, H] (tensors w[p + name]); causal attention."""
    T = x.shape[0]
    y = rms(x, w[p + "input_layernorm.weight"]) if input_norm else x
    q = (y @ w[p + "self_attn.q_proj.weight"].T).view(T, HEADS, D).transpose(0, 1)
    k = (y @ w[p + "self_attn.k_proj.weight"].T).view(T, KV, D).transpose(0, 1)
    v = (y @ w[p + "self_attn.v_proj.weight"].T).view(T, KV, D).transpose(0, 1)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = (s.softmax(-1) @ v).transpose(0, 1).reshape(T, HEADS * D)
    h = x + a @ w[p + "self_attn.o_proj.weight"].T
    z = rms(h, w[p + "post_attention_layernorm.weight"])
    return (
        h
        + (F.silu(z @ w[p + "mlp.gate_proj.weight"].T) * (z @ w[p + "mlp.up_proj.weight"].T))
        @ w[p + "mlp.down_proj.weight"].T
    )


def tensors(path: Path, prefix: str = "") -> dict[str, Tensor]:
    """The float64 tensors under `prefix` (removed) of every safetensors file in a directory."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k.startswith(prefix):
                out[k[len(prefix) :]] = v.double()
    return out


@torch.no_grad()
def target_hidden(model, ids: list[int]) -> Tensor:
    """[T, H] float64: the target's final normed hidden state at every position (one full forward, no cache)."""
    return model.model(torch.tensor([ids])).last_hidden_state[0].double()


def embed(model) -> Tensor:
    return model.get_input_embeddings().weight.detach().double()


def unrolled(forward: Forward, E: Tensor, tokens: list[int], target_h: Tensor, held: int) -> Tensor:
    """A pair head's logits [len(tokens), V] by full forwards, no cache (row 0: NaN, slot 0 holds no pair): slot j
    pairs x_j with h_{j-1} — the target's where it holds token j - 1 (j - 1 < held), else the head's own output at
    slot j - 1 (EAGLE drafting), at position j - 1."""
    rows, hs, fed = [torch.full((V,), float("nan"), dtype=torch.float64)], [], None
    for j in range(1, len(tokens)):
        hs.append(target_h[j - 1] if j - 1 < held else fed)
        logits, out = forward(E[torch.tensor(tokens[1 : j + 1])], torch.stack(hs), torch.arange(j))
        rows.append(logits[-1])
        fed = out[-1]
    return torch.stack(rows)


# --- the runners under test -----------------------------------------------------------------------------------------
def runners(model, head_dir: Path, runner: str):
    """(target runner, head runner) over `model` for the head in head_dir (loaded and bound afresh)."""
    head = load_head(head_dir)
    vocab = bind_head(head, LoadedModel(model, make_tokenizer(), "tiny"))
    target = make_runner(model, vocab, runner=runner)
    return target, head_runner(head.model, target, vocab)


def chain_logits(target, head, prompts: list[list[int]], drafts: list[list[int]]) -> list[Tensor]:
    """As the engine drives them: target and head hold prompt[:-1]; the head is fed the pending token, then one draft
    per forward (rows whose drafts ran out are fed nothing). Per row: [1 + len(drafts[b]), V] logits."""
    target.fill([p[:-1] for p in prompts], 64)
    head.fill([p[:-1] for p in prompts], 64)
    out = [[row] for row in head.forward([[p[-1]] for p in prompts], "last")]
    for j in range(max(len(d) for d in drafts)):
        feed = [[d[j]] if j < len(d) else [] for d in drafts]
        logits = head.forward(feed, "last")
        for b, d in enumerate(drafts):
            if j < len(d):
                out[b].append(logits[b])
    return [torch.stack(rows) for rows in out]


def tree_logits(target, head, prompt: list[int], tokens: list[int], parents: list[int], levels: list[int]) -> Tensor:
    """The pending token, then a tree (tokens with parents, -1 below the pending token) fed level by level as
    `grow_tree` feeds it: nodes levels[i - 1]:levels[i] in forward i, parents over the whole tree so far. [1 + n, V]."""
    target.fill([prompt[:-1]], 64)
    head.fill([prompt[:-1]], 64)
    out = [head.forward([[prompt[-1]]], "last")]
    start, done = list(head.lengths), 0
    for end in levels:
        out.append(head.forward([tokens[done:end]], parents=[parents[:end]], tree_start=start)[0])
        done = end
    return torch.cat(out)


def paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's path of tokens from the pending token (exclusive) down to it."""
    out = []
    for i in range(len(tokens)):
        path, n = [], i
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(path[::-1])
    return out


# --- a target the heads can agree with ------------------------------------------------------------------------------
def bigram_target(seed: int = 0, shrink: float = 0.2):
    """The 4-layer tiny target with its attention and MLP outputs scaled by `shrink`: mostly a bigram model (the
    next token mostly the current token's), so heads built from its embedding and output layer agree with it often
    (greedy and law tests need accepted drafts, and rejected ones)."""
    model = make_model(seed, layers=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(shrink)
            layer.mlp.down_proj.weight.mul_(shrink)
    return model


def loaded(model) -> LoadedModel:
    return LoadedModel(model, make_tokenizer(), "tiny-bigram")


def greedy_run(gen: SpeculativeGenerator, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = gen.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=n, ignore_eos=True)
    return [o.token_ids for o in outs]


def session_run(gen: SpeculativeGenerator, prompts: list[list[int]], budgets: list[int], max_batch: int) -> list:
    """Every prompt greedy through a session of at most max_batch rows (rows leave as their budgets end, waiting ones
    join: `select` and `add_rows`): the token ids of each, in prompt order."""
    sess = gen.session(max_batch=max_batch)
    keys = [
        sess.add(p, SamplingParams(temperature=0.0), max_new_tokens=n, ignore_eos=True)
        for p, n in zip(prompts, budgets)
    ]
    done = {}
    while not sess.idle:
        for event in sess.step():
            if event.completion is not None:
                done[event.completion.key] = event.completion.token_ids
    return [done[k] for k in keys]


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by full forwards (no cache), past EOS."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


# --- the pair heads' checks (EAGLE-1, MTP) --------------------------------------------------------------------------
P1, P2, P3 = [3, 17, 8, 22, 5, 11], [9, 4, 30], [14, 6, 25, 7, 19, 12, 28, 10]


def close(got: Tensor, ref: Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), ref, atol=TOL, rtol=TOL, msg=lambda m: f"{what}: {m}")


def check_pair_head(model, head_dir: Path, runner: str, forward: Forward, E: Tensor) -> None:
    """The head runner's logits equal the reference's (`unrolled`) where the target holds the tokens (a prefill's
    logits), for the pending token and drafted chains in a batch of rows of different lengths (one prompt twice:
    prefilled once), for a row that joins (`add_rows`) and after `select`, and for a tree fed level by level."""
    # target-fed slots: the target holds the whole prompt, the head reads it in one chunk
    target, head = runners(model, head_dir, runner)
    target.fill([P3], 64)
    head.start(1, 64)
    got = head.forward([P3], "all")[0]
    ref = unrolled(forward, E, P3, target_hidden(model, P3), len(P3))
    close(got[1:], ref[1:], "target-fed slots")
    # chains, as the engine drives them
    prompts, drafts = [P1, P2, P1], [[5, 9, 4], [7], [5, 9, 4]]
    got = chain_logits(target, head, prompts, drafts)
    for b, (p, d) in enumerate(zip(prompts, drafts)):
        ref = unrolled(forward, E, p + d, target_hidden(model, p[:-1]), len(p) - 1)
        close(got[b], ref[len(p) - 1 :], f"chain row {b}")
    target.add_rows([P3[:-1]], 64)
    head.add_rows([P3[:-1]], 64)
    joined = head.forward([[], [], [], [P3[-1]]], "last")[3]
    ref3 = unrolled(forward, E, P3 + [2], target_hidden(model, P3[:-1]), len(P3) - 1)
    close(joined, ref3[len(P3) - 1], "a row that joined")
    target.select([3, 1])
    head.select([3, 1])
    after = head.forward([[2], [13]], "last")
    close(after[0], ref3[len(P3)], "the joined row's draft after select")
    ref2 = unrolled(forward, E, P2 + [7, 13], target_hidden(model, P2[:-1]), len(P2) - 1)
    close(after[1], ref2[-1], "a kept row's draft after select")
    # a tree: two children of the pending token, a grandchild, a great-grandchild
    tokens, parents = [5, 27, 9, 4], [-1, -1, 0, 2]
    target, head = runners(model, head_dir, runner)
    got = tree_logits(target, head, P1, tokens, parents, levels=[2, 3, 4])
    h = target_hidden(model, P1[:-1])
    close(got[0], unrolled(forward, E, P1, h, len(P1) - 1)[-1], "tree root")
    for i, path in enumerate(paths(tokens, parents)):
        close(got[1 + i], unrolled(forward, E, P1 + path, h, len(P1) - 1)[-1], f"tree node {i}")


# --- the target's law -----------------------------------------------------------------------------------------------
LEVEL = 1e-3
L = 3  # tokens per sample
Outcome = tuple[tuple[int, ...], str]


class Law:
    """An exact law of (output ids, finish reason) and the chi-square test of samples against it (as
    tests/crossvocab/test_law.py: bins merged to expected counts >= 5, one probability-0 bin for anything else)."""

    def __init__(self, law: dict[Outcome, float]):
        self.outcomes = sorted(law)
        self.probs = np.array([law[o] for o in self.outcomes])
        assert abs(self.probs.sum() - 1) < 1e-9
        self.probs /= self.probs.sum()
        self._index = {o: i for i, o in enumerate(self.outcomes)}

    def gof(self, completions):
        counts = np.zeros(len(self.outcomes) + 1)
        for c in completions:
            counts[self._index.get((tuple(c.token_ids), c.finish_reason), len(self.outcomes))] += 1
        return chisquare_gof(counts, np.append(self.probs, 0.0))


@torch.no_grad()
def exact_law(model, prompt: list[int], params: SamplingParams, budget: int = L) -> Law:
    """The target's law of (output, finish reason) after prompt: full forwards over prompt + prefix, level by level,
    EOS ending an output."""
    law: dict[Outcome, float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        ids = torch.tensor([prompt + list(p) for p, _ in frontier])
        probs = probs_from_logits(model(ids).logits[:, -1].double(), params)  # [n, V]
        nxt = []
        for (prefix, mass), row in zip(frontier, probs.tolist()):
            for t, pt in enumerate(row):
                if pt <= 0:
                    continue
                if t == EOS:
                    law[(prefix, "stop")] = mass * pt
                elif len(prefix) + 1 == budget:
                    law[(prefix + (t,), "length")] = mass * pt
                else:
                    nxt.append((prefix + (t,), mass * pt))
        frontier = nxt
    return Law(law)


def sample(gen: SpeculativeGenerator, prompt: list[int], n: int, seed0: int = 1000):
    """n seeded samples of prompt at temperature 1 in one generate call."""
    rows = [SamplingParams(temperature=1.0, seed=seed0 + i) for i in range(n)]
    return gen.generate([prompt] * n, rows, max_new_tokens=L)


def check_law(gen: SpeculativeGenerator, completions, law: Law, what: str) -> None:
    """The samples pass the test, and speculation happened with acceptances and rejections."""
    result = law.gof(completions)
    assert not result.rejects(LEVEL), (what, result)
    s = gen.last_stats
    assert 0 < s.accepted < s.drafted, (what, s.drafted, s.accepted)
