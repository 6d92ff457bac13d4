"""A fused RMSNorm (registry op "rms_norm"; eager only, so no custom op: compiled, the module
runs its own torch code): one pass forward, one kernel backward, the eager path of
linear/norm.py, and their torch twins.

Eagerly, Hugging Face's RMSNorm is about six torch kernels, each reading a full tensor
(cast, square, mean, rsqrt-multiply, cast, weight multiply), and its backward as many
again. Here forward reads a row once and writes its output and its inverse RMS; it also
folds the output's finite max |y| into one int32 (atomic_max of non-negative float bits,
as fp8_linear's max pass does), so an FP8 linear layer reading the output gets its
per-tensor scale without reading it again (linear/shared_input.py). Backward reads x, dy
and the saved inverse RMS once for dx and each program's share of dweight, which a small
sum over programs finishes.

Numerics (the torch twin's, which matches the module it replaces bit for bit): x, weight
and the statistics in FP32, rstd = 1 / sqrt(mean(x^2) + eps) with correctly rounded sqrt
and division (torch's rsqrt on CPU). Then, CAST_FIRST (Hugging Face's LlamaRMSNorm):
n = x * rstd rounded to x's dtype, y = weight * n rounded to the promoted dtype of weight
and x; otherwise (torch.nn.RMSNorm, Olmo-style norms): y = x * rstd * weight rounded once
to x's dtype. Only the row's sum of squares is reduced in another order than torch's, so
the kernel's y may differ from the twin's by one rounding of its dtype.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .fp8_linear import linear_finite_absmax
from .fp8_triton import finite_abs, round_to
from .jit import jit, launch

__all__ = ["rms_norm_forward", "rms_norm_backward", "rms_norm_forward_triton", "rms_norm_backward_triton",
           "MAX_HIDDEN", "RMSNormKernels", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen


# ---- The torch twins ----------------------------------------------------------------------


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` over its last dim: (y of x's shape, float32 rstd per row, int32 (1,)
    float bits of max finite |y|, the linear layers' linear_finite_absmax).

    Computed as Hugging Face's LlamaRMSNorm computes it, bit for bit: FP32 statistics,
    rstd = rsqrt(mean(x^2) + eps); with `cast_first` (LlamaRMSNorm's order) n = x * rstd is
    rounded to x's dtype and then multiplied by the weight in their promoted dtype (a
    product of two 16-bit floats is exact in FP32, so one rounding of the FP32 product);
    otherwise (torch.nn.RMSNorm's order) x * rstd * weight is rounded once to x's dtype."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    n = x32 * rstd
    if cast_first:
        y_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = (n.to(x.dtype).to(torch.float32) * weight.to(torch.float32)).to(y_dtype)
    else:
        y = (n * weight.to(torch.float32)).to(x.dtype)
    amax = linear_finite_absmax(y).reshape(1).view(torch.int32)
    return y, rstd.reshape(-1), amax


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      cast_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dweight in weight's dtype) of rms_norm_forward's y, in FP32 from
    the saved rstd: dx = rstd * (dy*w - n * mean(dy*w * n)), n = x * rstd (the roundings
    of forward pass the gradient through), dweight = sum over rows of dy * n, n rounded to
    x's dtype where forward multiplied the weight by the rounded value."""
    n_feat = x.shape[-1]
    x32 = x.reshape(-1, n_feat).to(torch.float32)
    dy32 = dy.reshape(-1, n_feat).to(torch.float32)
    r = rstd.reshape(-1, 1)
    n = x32 * r
    dn = dy32 * weight.to(torch.float32)
    dx = r * (dn - n * ((dn * n).sum(-1, keepdim=True) / n_feat))
    if cast_first:
        n = n.to(x.dtype).to(torch.float32)
    dw = (dy32 * n).sum(0)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype)


# ---- The Triton kernels -------------------------------------------------------------------

# A row is one block in registers: wider rows would spill (Hugging Face models reach 16384).
MAX_HIDDEN = 65536
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SM_COUNT: dict = {}


@jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, amax_bits_ptr, N, eps,
                         BLOCK: tl.constexpr, CAST_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=0), tl.cast(N, tl.float32)) + eps))
    n = x * rstd
    if CAST_FIRST:
        n = round_to(n, x_ptr.dtype.element_ty)
    y = round_to(n * w, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)
    # The value stored, so the max is the one a max pass over y would find.
    tl.atomic_max(amax_bits_ptr, tl.max(finite_abs(y), axis=0).to(tl.int32, bitcast=True))


@jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, M, N, rows_per_prog,
                         BLOCK: tl.constexpr, CAST_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_prog):
        r = pid * rows_per_prog + i
        # Past the last row the bound is 0: nothing is read or written. (Not `mask & (r <
        # M)`: the interpreter rejects a mask broadcast from a scalar.)
        mask = cols < tl.where(r < M, N, 0)
        offs = r.to(tl.int64) * N + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(r, M - 1))
        n = x * rstd
        dn = dy * w
        dx = rstd * (dn - n * tl.div_rn(tl.sum(dn * n, axis=0), tl.cast(N, tl.float32)))
        tl.store(dx_ptr + offs, round_to(dx, x_ptr.dtype.element_ty).to(dx_ptr.dtype.element_ty), mask=mask)
        if CAST_FIRST:
            n = round_to(n, x_ptr.dtype.element_ty)  # the weight multiplied the rounded value
        dw += dy * n
    tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw, mask=cols < N)


def _settings(n: int) -> tuple[int, int]:
    """(block, warps) for rows of n elements: the whole row in one block."""
    if n > MAX_HIDDEN:
        raise ValueError(f"fused RMSNorm takes rows of at most {MAX_HIDDEN} elements, got {n}")
    block = triton.next_power_of_2(max(n, 1))
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


def _check_dtypes(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise ValueError(f"fused RMSNorm takes float32, bfloat16 or float16 tensors, got {t.dtype}")


def rms_norm_forward_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of contiguous `x` over its last dim: (y of x's shape, float32 rstd per row,
    int32 (1,) float bits of max finite |y|). y's dtype: the promoted one of weight and x
    with `cast_first`, else x's. See rms_norm_forward, the twin."""
    if not x.is_contiguous():
        raise ValueError("rms_norm_forward takes a contiguous tensor")
    _check_dtypes(x, weight)
    n = x.shape[-1]
    m = x.numel() // max(n, 1)
    y_dtype = torch.promote_types(weight.dtype, x.dtype) if cast_first else x.dtype
    block, warps = _settings(n)
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    amax_bits = torch.zeros((1,), dtype=torch.int32, device=x.device)
    if m and n:
        launch(_rms_norm_fwd_kernel, m, (x, weight, y, rstd, amax_bits, n, float(eps)),
               (block, cast_first), warps)
    return y, rstd, amax_bits


def _programs(device: torch.device, m: int) -> int:
    """Backward's program count: a few per SM on a GPU, so that each reduces many rows of
    dweight in registers and the partial sums stay small; few under the interpreter."""
    if device.type != "cuda":
        return max(1, min(m, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(m, 2 * _SM_COUNT[index]))


def rms_norm_backward_triton(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                             cast_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype and shape, dweight in weight's dtype) for rms_norm_forward's y;
    `dy` and `x` contiguous, of x's shape. See rms_norm_backward, the twin."""
    if not (dy.is_contiguous() and x.is_contiguous()):
        raise ValueError("rms_norm_backward takes contiguous dy and x")
    _check_dtypes(x, weight)
    n = x.shape[-1]
    m = x.numel() // max(n, 1)
    block, warps = _settings(n)
    dx = torch.empty_like(x)
    if not (m and n):
        return dx, torch.zeros_like(weight)
    progs = _programs(x.device, m)
    rows_per_prog = triton.cdiv(m, progs)
    partial = torch.empty((progs, n), dtype=torch.float32, device=x.device)
    launch(_rms_norm_bwd_kernel, progs, (dy, x, weight, rstd, dx, partial, m, n, rows_per_prog),
           (block, cast_first), warps)
    return dx, partial.sum(0).to(weight.dtype)


class RMSNormKernels(NamedTuple):
    """`forward(x, weight, eps, cast_first) -> (y, rstd, amax_bits)`, `backward(dy, x,
    weight, rstd, cast_first) -> (dx, dweight)`, for rows of at most `max_hidden` elements."""

    forward: Callable
    backward: Callable
    max_hidden: float


TORCH = RMSNormKernels(rms_norm_forward, rms_norm_backward, float("inf"))
TRITON = RMSNormKernels(rms_norm_forward_triton, rms_norm_backward_triton, MAX_HIDDEN)
