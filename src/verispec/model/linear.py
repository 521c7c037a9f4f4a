"""Linear layers through the fastest small-M kernel on the device, dense or weight-only quantized (`make_linear`).
Dense: oneDNN's `_linear_pointwise` on CPU (no weight copy; MKL's GEMM behind `F.linear` is 2-4x slower at the
M = 1..16 rows of decoding and verification), else `F.linear` (cuBLAS on CUDA).
Quantized (weight-only, drafts only; a quantized draft stays exact, since q is what it sampled from):
  * int8: symmetric, one scale per output row: W ~= q * s, q in [-127, 127];
  * int4: asymmetric per row and group of `group_size` input columns: W ~= (q - 8) * scale + zero, q in [0, 15]
    (the tinygemm convention of torch's int4 kernels).
Each quantized layer checks its kernel (`_weight_int8pack_mm`, `_weight_int4pack_mm(_for_cpu)`) once against the
dequantized reference matmul; a kernel that is missing or disagrees is replaced by that reference (`kernel` says
which runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["QUANT_MODES", "Linear", "make_linear", "onednn_available", "quantize_int4", "quantize_int8"]

QUANT_MODES = ("int8", "int4")


def onednn_available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class Linear:
    """A callable linear layer. `nbytes`: weight bytes read per call; `kernel`: the kernel that runs."""

    kernel = "?"

    def __init__(self, out_features: int, in_features: int):
        self.out_features, self.in_features = out_features, in_features

    def __call__(self, x: Tensor) -> Tensor:  # x [..., K] -> [..., N]
        lead = x.shape[:-1]
        y = self._mm(x.reshape(-1, self.in_features))  # [M, N]
        return y.view(*lead, self.out_features)

    def _mm(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    nbytes = 0


class DenseLinear(Linear):
    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__(*weight.shape)
        self.weight = weight  # [N, K], shared with the model (no copy)
        self.bias = bias  # [N] | None
        self.nbytes = weight.numel() * weight.element_size()
        self._onednn = weight.device.type == "cpu" and onednn_available(weight.dtype)
        self.kernel = "onednn" if self._onednn else ("cublas" if weight.device.type == "cuda" else "aten")

    def _mm(self, x: Tensor) -> Tensor:
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _pad_rows(w: Tensor, multiple: int) -> Tensor:
    extra = (-w.shape[0]) % multiple
    return w if extra == 0 else torch.cat([w, w.new_zeros((extra, *w.shape[1:]))])


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> codes int8 [N, K] in [-127, 127], scale float32 [N]; W ~= codes * scale[:, None],
    with |W - W~| <= scale / 2 elementwise."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
    codes = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes.contiguous(), scale


def dequantize_int8(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.float() * scale.float()[:, None]  # [N, K]


def quantize_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] -> codes uint8 [N, K] in [0, 15], scale and zero float32 [N, K / group_size];
    W ~= (codes - 8) * scale + zero per group, with |W - W~| <= scale / 2 elementwise."""
    N, K = weight.shape
    if K % group_size:
        raise ValueError(f"int4 quantization needs in_features ({K}) divisible by group_size ({group_size})")
    g = weight.float().view(N, K // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)  # [N, K/gs, 1]
    codes = ((g - lo) / scale).round().clamp(0, 15).to(torch.uint8).view(N, K)
    zero = lo + 8.0 * scale  # the tinygemm convention: W ~= (q - 8) * scale + zero
    return codes, scale.squeeze(-1), zero.squeeze(-1)


def dequantize_int4(codes: Tensor, scale: Tensor, zero: Tensor, group_size: int) -> Tensor:
    N, K = codes.shape
    g = codes.view(N, K // group_size, group_size).to(scale.dtype)
    return ((g - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(N, K)  # [N, K]


class _Quantized(Linear):
    """A weight-only quantized layer: `_kernel_mm` (in act_dtype) where `kernel` is not `dequant`, the dequantized
    `_reference_mm` (in the input's dtype) where it is."""

    dequant = "?"

    def __init__(self, weight: Tensor, bias: Tensor | None, act_dtype: torch.dtype):
        super().__init__(*weight.shape)
        self.bias = None if bias is None else bias.to(act_dtype)
        self.act_dtype = act_dtype

    def _mm(self, x: Tensor) -> Tensor:  # in x's dtype
        y = self._reference_mm(x) if self.kernel == self.dequant else self._kernel_mm(x.to(self.act_dtype))
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class Int8Linear(_Quantized):
    dequant = "int8-dequant"

    def __init__(self, weight: Tensor, bias: Tensor | None, act_dtype: torch.dtype):
        super().__init__(weight, bias, act_dtype)
        self.q, scale = quantize_int8(weight)  # [N, K] int8, [N]
        self.scale = scale.to(act_dtype)  # [N]
        self.nbytes = self.q.numel() + self.scale.numel() * self.scale.element_size()
        self.kernel = "int8pack_mm"
        if not _kernel_agrees(self._kernel_mm, self._reference_mm, self.in_features, act_dtype, weight.device):
            self.kernel = self.dequant

    def _kernel_mm(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def _reference_mm(self, x: Tensor) -> Tensor:
        return F.linear(x, self.q.to(x.dtype) * self.scale[:, None])


class Int4Linear(_Quantized):
    dequant = "int4-dequant"

    def __init__(self, weight: Tensor, bias: Tensor | None, act_dtype: torch.dtype, group_size: int):
        super().__init__(weight, bias, act_dtype)
        K, dev = weight.shape[1], weight.device
        self.group_size = group_size
        # the CPU packing needs N % 16 == 0: zero rows are appended and their outputs sliced off
        codes, scale, zero = quantize_int4(_pad_rows(weight, 16), group_size)  # [Np, K], [Np, K/gs] x 2
        self.codes = codes
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(act_dtype)  # [K/gs, Np, 2]
        self.packed = None
        try:
            if dev.type == "cpu":
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
                self.kernel = "int4pack_mm_cpu"
            else:
                nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [Np, K/2]
                self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, 8 if K % 1024 == 0 else 2)
                self.kernel = "int4pack_mm"
        except (RuntimeError, AttributeError, NotImplementedError):
            self.kernel = self.dequant
        if self.kernel == self.dequant or not _kernel_agrees(self._kernel_mm, self._reference_mm, K, act_dtype, dev):
            self.kernel, self.packed = self.dequant, None
        else:
            self.codes = None  # the packed copy is all the kernel needs
        stored = self.packed if self.packed is not None else self.codes
        self.nbytes = stored.numel() * stored.element_size() + self.scales_zeros.numel() * 2

    def _kernel_mm(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_zeros)
        return y[:, : self.out_features]

    def _reference_mm(self, x: Tensor) -> Tensor:
        sz = self.scales_zeros.transpose(0, 1).to(x.dtype)  # [Np, K/gs, 2]
        w = dequantize_int4(self.codes, sz[..., 0], sz[..., 1], self.group_size)
        return F.linear(x, w[: self.out_features])


@torch.no_grad()
def _kernel_agrees(kernel, reference, K: int, dtype: torch.dtype, device) -> bool:
    """Run a kernel once on random rows (in dtype) and compare it with the dequantized reference matmul of the same
    rows in float32 (the exact reference, and fast on a CPU without bfloat16 matmuls)."""
    x = torch.randn((3, K), generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    try:
        got, want = kernel(x).float(), reference(x.float()).float()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()))


def make_linear(
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    quant: str | None = None,
    act_dtype: torch.dtype | None = None,
    group_size: int = 128,
) -> Linear:
    """weight [N, K], bias [N] | None. quant: None (dense), "int8" or "int4" (weight-only).

    act_dtype: the dtype quantized layers' kernels compute in (default: bfloat16, the only dtype torch's
    weight-only kernels are fast in, on every CPU measured); their output comes back in the input's dtype. Dense
    layers compute in the weight's dtype.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    if quant is None:
        return DenseLinear(weight, bias)
    act_dtype = act_dtype or torch.bfloat16
    if quant == "int8":
        return Int8Linear(weight, bias, act_dtype)
    if quant == "int4":
        return Int4Linear(weight, bias, act_dtype, group_size)
    raise ValueError(f"quant must be None, 'int8' or 'int4', got {quant!r}")
