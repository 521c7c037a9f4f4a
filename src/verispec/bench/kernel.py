"""`verispec bench kernel`: verify_chain next to a plain reference and the memory limit, in one run.

For each (B, k, V) it times, on the same inputs:
  * read pass  — one read of target_probs and draft_probs (a sum), the memory-bandwidth floor;
  * verispec   — verify_chain(check=False): the hot-path call an engine makes with trusted inputs, on p far
                 from q (rows reject early: the residual path);
  * p = q      — the same call with p = q at the draft positions: every draft accepted (the bonus path);
  * +checks    — verify_chain(check=True): the default, with input validation;
  * +per-row generators — check=False with one torch.Generator per row (per-request seeds);
  * block      — verify_block(check=False): block verification (one more read of p and q, for the block masses);
  * reference  — a plain implementation that builds the full residual at every position, row by row.
and prints the ratios. Times are medians over repeats; ratios are what to read (shared, noisy machines).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..sampling.block import verify_block
from ..sampling.chain import verify_chain
from .table import markdown_table

DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (1, 4, 32000),
    (1, 4, 151936),
    (2, 4, 151936),
    (4, 4, 151936),
    (8, 4, 151936),
    (64, 8, 32000),
    (32, 8, 151936),
)


def reference_verify_chain(target_probs: Tensor, draft_token_ids: Tensor, draft_probs: Tensor) -> Tensor:
    """Straightforward per-row implementation (what a first version usually looks like)."""
    B, K1, _ = target_probs.shape
    k = K1 - 1
    out = torch.full((B, K1), -1, dtype=torch.int64)
    for b in range(B):
        p, q = target_probs[b], draft_probs[b]
        residual = (p[:k] - q).clamp_min(0)  # full residual at every position
        residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        u = torch.rand(k)
        for j in range(k):
            t = int(draft_token_ids[b, j])
            if u[j] * q[j, t] < p[j, t]:
                out[b, j] = t
            else:
                out[b, j] = int(torch.multinomial(residual[j], 1))
                break
        else:
            out[b, k] = int(torch.multinomial(p[k], 1))
    return out


def _time(fn: Callable[[], object], repeats: int, min_seconds: float = 0.2) -> float:
    """Median seconds per call; warms up once, repeats at least `repeats` times or `min_seconds`."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(B: int, k: int, V: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    target_probs = torch.randn((B, k + 1, V), generator=g).mul_(3).softmax(-1).to(device)  # [B, k+1, V]
    draft_probs = torch.randn((B, k, V), generator=g).mul_(3).softmax(-1).to(device)  # [B, k, V]
    draft_ids = torch.multinomial(draft_probs.reshape(-1, V).cpu(), 1, generator=g).view(B, k).to(device)
    return target_probs, draft_ids, draft_probs


def run(
    shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES,
    repeats: int = 10,
    device: str = "cpu",
    reference: bool = True,
) -> list[dict]:
    return [time_shape(B, k, V, repeats, device, reference) for B, k, V in shapes]


def time_shape(B: int, k: int, V: int, repeats: int = 10, device: str = "cpu", reference: bool = True) -> dict:
    """One row of the benchmark: every timing in the module docstring at one (B, k, V)."""
    target_probs, draft_ids, draft_probs = make_inputs(B, k, V, device)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(B)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn):
        def call():
            fn()
            sync()

        return _time(call, repeats)

    r = {
        "B": B,
        "k": k,
        "V": V,
        "bytes": target_probs.numel() * target_probs.element_size() + draft_probs.numel() * draft_probs.element_size(),
    }
    r["read_s"] = timed(lambda: (target_probs.sum(), draft_probs.sum()))
    r["verispec_s"] = timed(lambda: verify_chain(target_probs, draft_ids, draft_probs, check=False))
    same = torch.cat([draft_probs, target_probs[:, -1:]], 1)  # [B, k + 1, V]: p = q at every draft position
    r["same_s"] = timed(lambda: verify_chain(same, draft_ids, draft_probs, check=False))
    r["checked_s"] = timed(lambda: verify_chain(target_probs, draft_ids, draft_probs))
    r["generators_s"] = timed(lambda: verify_chain(target_probs, draft_ids, draft_probs, generators=gens, check=False))
    r["block_s"] = timed(lambda: verify_block(target_probs, draft_ids, draft_probs, check=False))
    if reference:
        tp, di, dp = target_probs.cpu(), draft_ids.cpu(), draft_probs.cpu()
        r["reference_s"] = _time(lambda: reference_verify_chain(tp, di, dp), max(2, repeats // 4), 0.0)
    return r


def to_markdown(rows: list[dict]) -> str:
    header = [
        "B",
        "k",
        "V",
        "read pass ms",
        "verispec ms",
        "x read",
        "p = q ms",
        "x read",
        "+checks ms",
        "x read",
        "+generators ms",
        "block ms",
        "x read",
        "reference ms",
        "reference / verispec",
    ]
    cells = []
    for r in rows:
        ref = r.get("reference_s")
        cells.append(
            [
                r["B"],
                r["k"],
                r["V"],
                f"{r['read_s'] * 1e3:.3f}",
                f"{r['verispec_s'] * 1e3:.3f}",
                f"{r['verispec_s'] / r['read_s']:.2f}",
                f"{r['same_s'] * 1e3:.3f}",
                f"{r['same_s'] / r['read_s']:.2f}",
                f"{r['checked_s'] * 1e3:.3f}",
                f"{r['checked_s'] / r['read_s']:.2f}",
                f"{r['generators_s'] * 1e3:.3f}",
                f"{r['block_s'] * 1e3:.3f}",
                f"{r['block_s'] / r['read_s']:.2f}",
                f"{ref * 1e3:.1f}" if ref is not None else "-",
                f"{ref / r['verispec_s']:.1f}" if ref is not None else "-",
            ]
        )
    return "\n".join(markdown_table(header, cells))
