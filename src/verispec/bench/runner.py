"""`verispec bench runner`: the cost of decode(1) and verify(k) per model forward for each path (PATHS), side by side
in one run; what it measures: docs/benchmarks.md, "What each benchmark measures"."""

from __future__ import annotations

import statistics
import time

import torch

from ..model.fast import FastRunner
from ..model.llamacpp import LlamaCppRunner
from ..model.runner import HFRunner
from .harness import report_head, started, table

__all__ = ["PATHS", "measure_curve", "read_bandwidth", "run", "to_markdown"]

PATHS = ("hf", "fast", "int8-self", "int4-self", "llamacpp")
TORCH_PATHS = PATHS[:4]


def _timed(device, fn, *args, **kwargs) -> float:
    """Seconds of fn(*args, **kwargs), a CUDA device synchronized before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    sync()
    return time.perf_counter() - t0


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 9, device: str | torch.device = "cpu") -> tuple[float, float]:
    """(median, best) bytes per second of a streaming read: torch.sum over an nbytes float32 buffer of random
    values (not constants: a VM may deduplicate identical pages, which fakes the rate)."""
    buf = torch.rand(nbytes // 4, generator=torch.Generator().manual_seed(0)).to(device)
    times = [_timed(device, buf.sum) for _ in range(repeats + 1)][1:]  # the first round warms up
    return buf.numel() * 4 / statistics.median(times), buf.numel() * 4 / min(times)


def _prepare(runner, vocab: int, context: int, max_k: int, batch: int = 1) -> None:
    runner.start(batch, context + max_k + 1)
    g = torch.Generator().manual_seed(0)
    runner.prefill([torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)])


@torch.inference_mode()
def measure_curve(runners: dict, vocab: int, ks: list[int], context: int = 64, repeats: int = 7, batch: int = 1):
    """{name: median seconds of a forward over k new tokens per row (each k in ks) after `context` cached tokens, at
    `batch` rows}. Interleaved: for each k and repeat, every runner runs once before the next repeat."""
    for r in runners.values():
        _prepare(r, vocab, context, max(ks), batch)
    g = torch.Generator().manual_seed(1)
    times: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in runners}
    for k in ks:
        for rep in range(repeats + 1):  # the first round warms up
            toks = [torch.randint(0, vocab, (k,), generator=g).tolist() for _ in range(batch)]
            for name, r in runners.items():
                times[name][k] += [_timed(r.device, r.forward, toks, logits_at="all")] if rep else []
                r.truncate([context] * batch)
    return {name: [statistics.median(times[name][k]) for k in ks] for name in runners}


@torch.inference_mode()
def batch_consistency(runner, vocab: int, k: int, context: int = 64, trials: int = 4) -> dict:
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
        worst_tv = max(worst_tv, 0.5 * (batched.softmax(-1) - single.softmax(-1)).abs().sum(-1).max().item())
    return {"k": k, "max_abs_logit_diff": worst_logit, "max_tv": worst_tv}


def _step_info(name: str, r, model, context: int) -> tuple[int, dict, str]:
    """(bytes one decode step reads, kernels, compute dtype) of a path's runner."""
    if name == "llamacpp":  # the file's tensors (~ what a step reads); its f16 KV cache is left out
        return r.model.path.stat().st_size, {"llama.cpp": 1}, "gguf"
    if name == "hf":  # every parameter but the input embedding (one row is gathered); a tied output layer counts
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb or p is head)
    else:
        wbytes = r.weight_bytes()
    kv = 2 * r.num_layers * r.num_kv_heads * r.head_dim * context * torch.tensor([], dtype=r.dtype).element_size()
    dtype = str(r.dtype).replace("torch.", "")
    if getattr(r, "quant", None) and dtype != "bfloat16":  # quantized layers compute in bfloat16 (model.linear)
        dtype = f"bfloat16 linears, {dtype}"
    return wbytes + kv, getattr(r, "kernels", {"transformers": 1}), dtype


def _runner(name: str, model, vocab: int, llamacpp_model):
    if name == "hf":
        return HFRunner(model, vocab)
    if name == "llamacpp":
        if llamacpp_model is None:
            raise ValueError("path llamacpp needs the model loaded by llama.cpp (a .gguf file)")
        return LlamaCppRunner(llamacpp_model, vocab)
    return FastRunner(model, vocab, quant={"fast": None, "int8-self": "int8", "int4-self": "int4"}[name])


def run(
    model, vocab, *, max_k=16, context=64, repeats=7, paths=PATHS, bandwidth_bytes=2**30, log=None, llamacpp_model=None
) -> dict:
    """Build the runners for `paths` on one model (a torch model, None when only llamacpp runs; llamacpp_model: the
    same file loaded by llama.cpp, for the llamacpp path) and measure them side by side."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown path(s) {sorted(unknown)}; choose from {', '.join(PATHS)}")
    if max_k < 1 or context < 1 or repeats < 1:
        raise ValueError("max_k, context and repeats must be >= 1")
    result = started()  # the code, date and command at the start of the run
    log = log or (lambda m: None)
    runners = {}
    for name in paths:
        log(f"building {name} ...")
        runners[name] = _runner(name, model, vocab, llamacpp_model)
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    log("measuring read bandwidth ...")
    bandwidth, best_bandwidth = read_bandwidth(bandwidth_bytes, device=device)
    ks = list(range(1, max_k + 1))
    log(f"measuring k = 1..{max_k} ({repeats} repeats, interleaved) ...")
    curves = measure_curve(runners, vocab, ks, context, repeats)
    info = {}
    for name, r in runners.items():
        step_bytes, kernels, dtype = _step_info(name, r, model, context)
        rate = step_bytes / curves[name][0]
        info[name] = dict(kernels=kernels, compute_dtype=dtype, bytes_per_step=step_bytes, decode_gbps=rate / 1e9)
        info[name]["fraction_of_bandwidth"] = rate / bandwidth
        info[name]["batch_consistency"] = batch_consistency(r, vocab, min(max_k, 8), context)
    result |= dict(device=str(device), context=context, repeats=repeats, ks=ks, read_bandwidth_gbps=bandwidth / 1e9)
    return result | dict(read_bandwidth_best_gbps=best_bandwidth / 1e9, curves=curves, paths=info)


def to_markdown(res: dict) -> str:
    curves, ks = res["curves"], res["ks"]
    names = list(curves)
    ref = "fast" if "fast" in curves else names[0]
    head = report_head(
        res,
        f"Device {res['device']}, {res['threads']} threads, context {res['context']} tokens, median of "
        f"{res['repeats']} (interleaved). Measured read bandwidth (streaming sum over 1 GiB): median "
        f"{res['read_bandwidth_gbps']:.1f} GB/s, best {res.get('read_bandwidth_best_gbps', 0):.1f} GB/s; "
        "'of read bandwidth' below is relative to the median.",
    )
    per_k = [{"k": k, **{n: c[i] for n, c in curves.items()}} for i, k in enumerate(ks)]  # seconds per path
    cols = ["k"] + [(f"{n} ms", lambda r, n=n: 1e3 * r[n], ".1f") for n in names]
    cols += [(f"{n} T(k)/T(1)", lambda r, n=n: r[n] / curves[n][0], ".2f") for n in names]
    cols += [("hf / fast", lambda r: r["hf"] / r["fast"], ".2f")] if {"hf", "fast"} <= set(names) else []
    paths = [{"path": n, "c": curves[n], **res["paths"][n]} for n in names]
    kernels = ("kernels", lambda p: ", ".join(f"{k}×{v}" for k, v in p["kernels"].items()))
    path_cols = ["path", ("compute dtype", "compute_dtype"), kernels]
    path_cols += [("MB read per step", lambda p: p["bytes_per_step"] / 1e6, ".0f")]
    path_cols += [("decode GB/s", "decode_gbps", ".1f"), ("of read bandwidth", "fraction_of_bandwidth", ".0%")]
    path_cols += [("verify5 / decode1", lambda p: p["c"][4] / p["c"][0] if len(ks) >= 5 else None, ".2f")]
    path_cols += [(f"decode1 / {ref} decode1", lambda p: p["c"][0] / curves[ref][0], ".2f")]
    consistency = "verify(k) vs k decode(1): max |Δlogit| / max TV"
    path_cols += [(consistency, lambda p: _consistency_cell(p.get("batch_consistency")))]
    return "\n".join(head + table(per_k, cols) + [""] + table(paths, path_cols))


def _consistency_cell(c: dict | None) -> str:
    return "-" if not c else f"k={c['k']}: {c['max_abs_logit_diff']:.2g} / {c['max_tv']:.2g}"
