"""`verispec bench kernel`: verify_chain next to a plain reference and the memory limit, in one run (`time_shape`;
docs/benchmarks.md, "What each benchmark measures")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..sampling.block import verify_block
from ..sampling.chain import verify_chain
from .harness import Col, median_seconds, report_head, started, table

DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = ((1, 4, 32000), (1, 4, 151936), (2, 4, 151936), (4, 4, 151936))
DEFAULT_SHAPES += ((8, 4, 151936), (64, 8, 32000), (32, 8, 151936))


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


def make_inputs(B: int, k: int, V: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    target_probs = torch.randn((B, k + 1, V), generator=g).mul_(3).softmax(-1).to(device)  # [B, k+1, V]
    draft_probs = torch.randn((B, k, V), generator=g).mul_(3).softmax(-1).to(device)  # [B, k, V]
    draft_ids = torch.multinomial(draft_probs.reshape(-1, V).cpu(), 1, generator=g).view(B, k).to(device)
    return target_probs, draft_ids, draft_probs


def run(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, repeats=10, device="cpu", reference=True) -> dict:
    """The result: the provenance, the device, and one row per shape (`time_shape`)."""
    result = started(device=device)  # the code, date and command at the start of the run
    return result | {"rows": [time_shape(B, k, V, repeats, device, reference) for B, k, V in shapes]}


def time_shape(B: int, k: int, V: int, repeats: int = 10, device: str = "cpu", reference: bool = True) -> dict:
    """One row of the benchmark at one (B, k, V), the same inputs for all: one read of p and q (the memory floor);
    verify_chain(check=False) on p far from q (the residual path) and on p = q (the bonus path); with checks; with
    one generator per row; verify_block; and a plain per-row reference that builds the full residual."""
    p, ids, q = make_inputs(B, k, V, device)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(B)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn):
        return median_seconds(lambda: (fn(), sync()), repeats, min_seconds=0.2)

    r = dict(B=B, k=k, V=V, bytes=p.numel() * p.element_size() + q.numel() * q.element_size())
    r["read_s"] = timed(lambda: (p.sum(), q.sum()))
    r["verispec_s"] = timed(lambda: verify_chain(p, ids, q, check=False))
    same = torch.cat([q, p[:, -1:]], 1)  # [B, k + 1, V]: p = q at every draft position (made after the timings above)
    r["same_s"] = timed(lambda: verify_chain(same, ids, q, check=False))
    r["checked_s"] = timed(lambda: verify_chain(p, ids, q))
    r["generators_s"] = timed(lambda: verify_chain(p, ids, q, generators=gens, check=False))
    r["block_s"] = timed(lambda: verify_block(p, ids, q, check=False))
    if reference:
        tp, di, dp = p.cpu(), ids.cpu(), q.cpu()
        r["reference_s"] = median_seconds(lambda: reference_verify_chain(tp, di, dp), max(2, repeats // 4))
    return r


def _ms(header: str, key: str, spec: str = ".3f") -> Col:
    return Col(header, lambda r: None if r.get(key) is None else 1e3 * r[key], spec)


def _x(key: str, of: str = "read_s", header: str = "x read", spec: str = ".2f") -> Col:
    return Col(header, lambda r: None if r.get(key) is None else r[key] / r[of], spec)


COLUMNS = ["B", "k", "V", _ms("read pass ms", "read_s"), _ms("verispec ms", "verispec_s")]
COLUMNS += [_x("verispec_s"), _ms("p = q ms", "same_s"), _x("same_s"), _ms("+checks ms", "checked_s"), _x("checked_s")]
COLUMNS += [_ms("+generators ms", "generators_s"), _ms("block ms", "block_s"), _x("block_s")]
COLUMNS += [_ms("reference ms", "reference_s", ".1f"), _x("reference_s", "verispec_s", "reference / verispec", ".1f")]


def to_markdown(result: dict) -> str:
    head = report_head(
        result,
        f"verify_chain on {result['device']}, torch {result['torch']}, {result['threads']} threads; median times; "
        "'x read' = time / one read pass over the inputs",
    )
    return "\n".join(head + table(result["rows"], COLUMNS))
