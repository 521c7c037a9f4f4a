"""`verispec bench runner`: the cost of decode(1) and verify(k) per model forward, side by side in one run.

Paths (same model, same context, interleaved measurements so machine noise hits all alike):
    hf          transformers' forward (`HFRunner`)
    fast        verispec's fast runner (`FastRunner`: fused, oneDNN/cuBLAS linears)
    int8-self   the fast runner on int8 weight-only copies of the same weights (a self-draft)
    int4-self   the same with int4 weights
    llamacpp    llama.cpp on the model's GGUF file, in the file's own quantization (`LlamaCppRunner`)
For each path: median seconds of one forward over k = 1..max_k new tokens after `context` cached tokens
(batch 1), the weight bytes one step reads, and the achieved read rate of decode(1), next to the machine's
measured read bandwidth (a streaming sum over a buffer far larger than the caches).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..model.fast import FastRunner
from ..model.runner import HFRunner
from ._provenance import provenance, provenance_lines
from .table import markdown_table

__all__ = ["PATHS", "measure_curve", "read_bandwidth", "run", "to_markdown"]

PATHS = ("hf", "fast", "int8-self", "int4-self", "llamacpp")
TORCH_PATHS = PATHS[:4]


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 9, device: str | torch.device = "cpu") -> tuple[float, float]:
    """(median, best) bytes per second of a streaming read: torch.sum over an nbytes float32 buffer of random
    values (not constants: a VM may deduplicate identical pages, which fakes the rate)."""
    buf = torch.rand(nbytes // 4, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for rep in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        buf.sum()
        _sync(device)
        if rep:
            times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times), buf.numel() * 4 / min(times)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _prepare(runner: HFRunner, vocab: int, context: int, max_k: int) -> None:
    runner.start(1, context + max_k + 1)
    g = torch.Generator().manual_seed(0)
    runner.prefill([torch.randint(0, vocab, (context,), generator=g).tolist()])


@torch.inference_mode()
def measure_curve(
    runners: dict[str, HFRunner], vocab: int, ks: list[int], context: int = 64, repeats: int = 7
) -> dict[str, list[float]]:
    """Median seconds of a forward over k new tokens (each k in ks) after `context` cached tokens, per runner.
    Measurements are interleaved: for each k and repeat, every runner runs once before the next repeat."""
    for r in runners.values():
        _prepare(r, vocab, context, max(ks))
    g = torch.Generator().manual_seed(1)
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in runners}
    for k in ks:
        for rep in range(repeats + 1):  # the first round warms up
            toks = torch.randint(0, vocab, (k,), generator=g).tolist()
            for name, r in runners.items():
                _sync(r.device)
                t0 = time.perf_counter()
                r.forward([toks], logits_at="all")
                _sync(r.device)
                if rep:
                    times[name][k].append(time.perf_counter() - t0)
                r.truncate([context])
    return {name: [statistics.median(times[name][k]) for k in ks] for name in runners}


@torch.inference_mode()
def batch_consistency(runner: HFRunner, vocab: int, k: int, context: int = 64, trials: int = 4) -> dict:
    """How far a verify pass's logits (k tokens in one forward) are from decoding the same tokens one at a time,
    over `trials` random token chains: max |logit difference| and max total variation between the two softmaxes."""
    g = torch.Generator().manual_seed(2)
    worst_logit = worst_tv = 0.0
    for _ in range(trials):
        _prepare(runner, vocab, context, k)
        toks = torch.randint(0, vocab, (k,), generator=g).tolist()
        batched = runner.forward([toks], logits_at="all")[0].double()  # [k, V]
        runner.truncate([context])
        single = torch.stack([runner.forward([[t]], logits_at="last")[0] for t in toks]).double()  # [k, V]
        worst_logit = max(worst_logit, (batched - single).abs().max().item())
        tv = 0.5 * (batched.softmax(-1) - single.softmax(-1)).abs().sum(-1).max().item()
        worst_tv = max(worst_tv, tv)
    return {"k": k, "max_abs_logit_diff": worst_logit, "max_tv": worst_tv}


def _step_info(name: str, r, model, vocab: int, context: int) -> tuple[int, dict, str]:
    """(bytes one decode step reads, kernels, compute dtype) of a path's runner."""
    if name == "llamacpp":  # the file's tensors (~ what a step reads); its f16 KV cache is left out
        return r.model.path.stat().st_size, {"llama.cpp": 1}, "gguf"
    wbytes = _hf_weight_bytes(model, vocab) if name == "hf" else r.weight_bytes()
    kv = 2 * r.num_layers * r.num_kv_heads * r.head_dim * context * torch.tensor([], dtype=r.dtype).element_size()
    dtype = str(r.dtype).replace("torch.", "")
    if getattr(r, "quant", None) and dtype != "bfloat16":  # quantized layers compute in bfloat16 (model.linear)
        dtype = f"bfloat16 linears, {dtype}"
    return wbytes + kv, getattr(r, "kernels", {"transformers": 1}), dtype


def _hf_weight_bytes(model, vocab: int) -> int:
    """Bytes the transformers forward reads per decode step: every parameter except the input embedding
    (a single row is gathered) — the output layer counts with all its rows."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    # model.parameters() yields a tied embedding / output matrix once; it is read whole by the output layer
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb or p is head)


def run(
    model,
    vocab: int,
    *,
    max_k: int = 16,
    context: int = 64,
    repeats: int = 7,
    paths: tuple[str, ...] = PATHS,
    bandwidth_bytes: int = 1 << 30,
    log=lambda m: None,
    llamacpp_model=None,
) -> dict:
    """Build the runners for `paths` on one model (a torch model, None when only llamacpp runs; llamacpp_model: the
    same file loaded by llama.cpp, for the llamacpp path) and measure them side by side."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown path(s) {sorted(unknown)}; choose from {', '.join(PATHS)}")
    if max_k < 1 or context < 1 or repeats < 1:
        raise ValueError("max_k, context and repeats must be >= 1")
    origin = provenance()  # the code, date and command at the start of the run
    runners: dict[str, HFRunner] = {}
    for name in paths:
        log(f"building {name} ...")
        if name == "hf":
            runners[name] = HFRunner(model, vocab)
        elif name == "llamacpp":
            from ..model.llamacpp import LlamaCppRunner

            if llamacpp_model is None:
                raise ValueError("path llamacpp needs the model loaded by llama.cpp (a .gguf file)")
            runners[name] = LlamaCppRunner(llamacpp_model, vocab)
        else:
            quant = {"fast": None, "int8-self": "int8", "int4-self": "int4"}[name]
            runners[name] = FastRunner(model, vocab, quant=quant)
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    log("measuring read bandwidth ...")
    bandwidth, best_bandwidth = read_bandwidth(bandwidth_bytes, device=device)
    ks = list(range(1, max_k + 1))
    log(f"measuring k = 1..{max_k} ({repeats} repeats, interleaved) ...")
    curves = measure_curve(runners, vocab, ks, context, repeats)
    info = {}
    for name, r in runners.items():
        step_bytes, kernels, dtype = _step_info(name, r, model, vocab, context)
        info[name] = {
            "kernels": kernels,
            "compute_dtype": dtype,
            "bytes_per_step": step_bytes,
            "decode_gbps": step_bytes / curves[name][0] / 1e9,
            "fraction_of_bandwidth": step_bytes / curves[name][0] / bandwidth,
            "batch_consistency": batch_consistency(r, vocab, min(max_k, 8), context),
        }
    return {
        **origin,  # commit, dirty, date, command, verispec, python, torch, threads
        "device": str(device),
        "context": context,
        "repeats": repeats,
        "ks": ks,
        "read_bandwidth_gbps": bandwidth / 1e9,
        "read_bandwidth_best_gbps": best_bandwidth / 1e9,
        "curves": curves,
        "paths": info,
    }


def to_markdown(res: dict) -> str:
    names = list(res["curves"])
    curves = res["curves"]
    ref = "fast" if "fast" in curves else names[0]
    lines = [
        *provenance_lines(res),
        f"Device {res['device']}, {res['threads']} threads, context {res['context']} tokens, median of "
        f"{res['repeats']} (interleaved). Measured read bandwidth (streaming sum over 1 GiB): median "
        f"{res['read_bandwidth_gbps']:.1f} GB/s, best {res.get('read_bandwidth_best_gbps', 0):.1f} GB/s; "
        "'of read bandwidth' below is relative to the median.",
        "",
    ]
    lines += [*markdown_table(*_curve_table(res)), ""]
    header = [
        "path",
        "compute dtype",
        "kernels",
        "MB read per step",
        "decode GB/s",
        "of read bandwidth",
        "verify5 / decode1",
        f"decode1 / {ref} decode1",
        "verify(k) vs k decode(1): max |Δlogit| / max TV",
    ]
    rows = []
    for n in names:
        p = res["paths"][n]
        rows.append(
            [
                n,
                p["compute_dtype"],
                ", ".join(f"{k}×{v}" for k, v in p["kernels"].items()),
                f"{p['bytes_per_step'] / 1e6:.0f}",
                f"{p['decode_gbps']:.1f}",
                f"{p['fraction_of_bandwidth']:.0%}",
                f"{curves[n][4] / curves[n][0]:.2f}" if len(res["ks"]) >= 5 else "-",
                f"{curves[n][0] / curves[ref][0]:.2f}",
                _consistency_cell(p.get("batch_consistency")),
            ]
        )
    return "\n".join(lines + markdown_table(header, rows))


def _consistency_cell(c: dict | None) -> str:
    return "-" if not c else f"k={c['k']}: {c['max_abs_logit_diff']:.2g} / {c['max_tv']:.2g}"


def _curve_table(res: dict) -> tuple[list[str], list[list[str]]]:
    """Per k: each path's milliseconds, each path's T(k) / T(1), and hf / fast when both ran."""
    curves = res["curves"]
    names = list(curves)
    both = "hf" in curves and "fast" in curves
    header = ["k"] + [f"{n} ms" for n in names] + [f"{n} T(k)/T(1)" for n in names] + (["hf / fast"] if both else [])
    rows = []
    for i, k in enumerate(res["ks"]):
        row = (
            [str(k)]
            + [f"{curves[n][i] * 1e3:.1f}" for n in names]
            + [f"{curves[n][i] / curves[n][0]:.2f}" for n in names]
        )
        if both:
            row.append(f"{curves['hf'][i] / curves['fast'][i]:.2f}")
        rows.append(row)
    return header, rows
