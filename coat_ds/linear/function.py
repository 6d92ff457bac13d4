"""The autograd function of an FP8 linear layer: three GEMMs, one FP8 copy of the input.

Forward quantizes the input once per tensor (E4M3) into two layouts: row-major for the
forward GEMM and transposed for the weight-gradient GEMM, which contracts over tokens. Only
the transposed codes and their scale are saved; no high-precision copy of the input is
kept, and layers reading the same input share one copy (shared_input.py). The weight is
saved as the Parameter it is (alive anyway; FSDP2 and ZeRO-3 gather it again for backward)
and quantized again there, straight into the transposed layout the input-gradient GEMM
reads, with the exponent kept from forward: one pass, no second max. With
keep_weight_codes, forward writes that transposed copy beside its own in the same pass and
backward reads it: a weight read less per step for 1 byte per weight element held.

Where the device has no FP8 GEMMs, forward computes in the input's precision from the
input itself and backward's weight gradient from the dequantized FP8 copy: the memory
saving stays, the speed-up does not."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .._compat.torch import scaled_mm
from ..kernels.fp8 import Fp8Format
from ..kernels.fp8_linear import linear_dequantize
from ..kernels.fp8_torch import pow2
from . import shared_input

__all__ = ["Fp8LinearSpec", "fp8_linear", "fp8_mm", "input_max_split"]

# Maxima reduced in runs of this many elements (fp8_linear.linear_finite_absmax): the
# activation codec's group size, so Inductor can put them in one kernel with its group maxima.
_MAX_SPLIT = 16


@dataclass(frozen=True)
class Fp8LinearSpec:
    """What an Fp8Linear layer computes with on one device, besides its tensors and the output
    dtype: made once from its config (Fp8Linear._spec), passed to the autograd function as one
    constant (torch.compile traces a frozen dataclass of constants as one).

    `quantize` and `quantize_kept` are the registry's "fp8_linear" kernels for the layer's
    device and backend (`quantize` the twin for "auto" when compiled); `recipe`, what another
    layer's codes of the same input must have been made for to be shared; `input_split`, how
    the input's max is reduced (input_max_split)."""

    f_in: Fp8Format
    f_w: Fp8Format
    f_g: Fp8Format
    fp8_gemm: bool
    fast_accum: bool
    keep_w: bool
    recipe: tuple
    input_split: int
    quantize: Callable
    quantize_kept: Callable


def input_max_split(weight_shape: torch.Size) -> int:
    """How forward reduces the input's max. An input wider than the output is an MLP's
    intermediate (SwiGLU's silu(gate) * up): a pointwise function of GEMM outputs that
    compress_activations also quantizes per group, and split, its max joins those group
    maxima in one read of the GEMM outputs. Other inputs come from a norm, whose row
    reduction Inductor fuses the unsplit max into and a split max would leave. Both measured
    compiled (docs/benchmarks.md)."""
    return _MAX_SPLIT if weight_shape[1] > weight_shape[0] else 0


def fp8_mm(a, a_fmt, sa, b_t, b_fmt, sb, out_dtype, bias=None, fast_accum=False, out=None):
    """a (M, K) row-major codes @ b_t.t() (b_t: (N, K) row-major codes): cuBLASLt's layout;
    `sa`, `sb` their scales (pow2 of their exponents: eagerly each made once per tensor, as
    it costs host time per GEMM)."""
    args = (a.view(a_fmt.dtype), b_t.view(b_fmt.dtype).t(), sa, sb)
    if out is None:
        return scaled_mm(*args, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return scaled_mm(*args, bias=bias, out_dtype=out_dtype, use_fast_accum=fast_accum, out=out)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nd, weight, bias, w_guess, out_dtype, spec: Fp8LinearSpec):
        x = x_nd.reshape(-1, x_nd.shape[-1])
        if not x.is_contiguous():
            x = x.contiguous()
        f_in, f_w, fp8_gemm, quantize = spec.f_in, spec.f_w, spec.fp8_gemm, spec.quantize
        eager = not torch.compiler.is_compiling()
        shared = shared_input.on(x_nd) if eager else None
        codes = shared.codes_for(spec.recipe) if eager else None
        if codes is None:
            # A fused RMSNorm's or SwiGLU's output comes with its max: no max pass here.
            xq, xq_t, ex = quantize(x, f_in, fp8_gemm, True, split=spec.input_split,
                                    amax=shared.amax if eager else None)
            codes = (xq, xq_t, ex, pow2(ex) if fp8_gemm else None)
            if eager:
                shared.keep(spec.recipe, codes)
        xq, xq_t, ex, sx = codes
        ew = wq_t = sw = None
        if fp8_gemm:
            # Our kernels start from the exponent in w_guess, the weight's last step's, and
            # update it there (one read of the weight where a max pass takes two). A kept
            # copy comes from the custom op even when compiling: AOTAutograd would recompute
            # a twin's cast of a parameter in backward rather than save it. Otherwise,
            # compiled, the twin's cast measured as fast as the op or faster (benchmarks.md).
            if spec.keep_w:
                wq, wq_t, ew = spec.quantize_kept(weight, f_w, True, True, guess=w_guess)
            else:
                wq, _, ew = quantize(weight, f_w, True, False, guess=w_guess)
            sw = pow2(ew)
            # cuBLASLt takes a bias only with a 16-bit output; an FP32 one is added after.
            fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
            b = bias.to(out_dtype) if fused_bias else None
            n = weight.shape[0]
            if torch.compiler.is_compiling():
                # Functional, as measured: an out= call would be functionalized into a GEMM
                # plus a copy.
                y = fp8_mm(xq, f_in, sx, wq, f_w, sw, out_dtype, b, spec.fast_accum).view(*x_nd.shape[:-1], n)
            else:
                # Eagerly written into the N-D output: a reshaped view as a module's output
                # trips FSDP2's check on outputs that are views.
                y = x.new_empty((*x_nd.shape[:-1], n), dtype=out_dtype)
                fp8_mm(xq, f_in, sx, wq, f_w, sw, out_dtype, b, spec.fast_accum, out=y.view(-1, n))
            if bias is not None and not fused_bias:
                y = y + bias.to(out_dtype)
        else:
            y = torch.nn.functional.linear(x_nd.to(out_dtype), weight.to(out_dtype),
                                           None if bias is None else bias.to(out_dtype))
        ctx.save_for_backward(xq_t, ex, wq_t if spec.keep_w else weight, ew)
        # Weakly: a strong reference would keep the row-major codes, which only the siblings'
        # forwards read, alive until backward.
        ctx.spec, ctx.shared = spec, (weakref.ref(shared) if shared is not None else None)
        # Eagerly the scales go to backward as they are (four bytes each, not through the
        # saved-tensor hooks), with the exponents they were made from: a checkpoint that
        # recomputes this forward hands backward the recomputed exponents, and the input it
        # recomputes from may differ (kept as FP8 codes), so the scales are then made again.
        # Compiled, backward makes them from the saved exponents as it always has, and the
        # partitioner decides.
        ctx.scales = (ex, sx, ew, sw) if eager and fp8_gemm else None
        ctx.m, ctx.x_dtype, ctx.x_shape, ctx.out_dtype = x.shape[0], x.dtype, x_nd.shape, out_dtype
        ctx.w_dtype, ctx.bias_dtype = weight.dtype, (bias.dtype if bias is not None else None)
        return y

    @staticmethod
    def backward(ctx, gy):
        shared = ctx.shared() if ctx.shared is not None else None  # None compiled, or gone with its tensor
        if shared is not None:
            shared.release()
        xq_t, ex, weight_or_codes, ew = ctx.saved_tensors
        spec = ctx.spec
        f_in, f_w, f_g = spec.f_in, spec.f_w, spec.f_g
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        gy = gy.reshape(-1, gy.shape[-1])
        if not gy.is_contiguous():
            gy = gy.contiguous()
        dx = dw = db = None
        if spec.fp8_gemm and (need_dx or need_dw):
            quantize = spec.quantize
            # Split, the maxima of sibling output gradients (gate's and up's, from one
            # SiLU-mul backward) are computed in one kernel that recomputes their producer;
            # unsplit, Inductor had the producer write both in BF16 for two max kernels to
            # read (docs/benchmarks.md).
            gq, gq_t, eg = quantize(gy, f_g, need_dx, need_dw, split=_MAX_SPLIT)
            sg = pow2(eg)
            if ctx.scales is not None and ctx.scales[0] is ex and ctx.scales[2] is ew:
                sx, sw = ctx.scales[1], ctx.scales[3]
            else:
                sx, sw = (pow2(ex) if need_dw else None), (pow2(ew) if need_dx else None)
            if need_dx:
                # The forward scale, so no max pass over the weight again: the weight has
                # not changed, and the codes equal forward's.
                wq_t = weight_or_codes if spec.keep_w else quantize(weight_or_codes, f_w, False, True, ew)[1]
                # In the compute dtype, then cast, as nn.Linear under autocast does: an FP32
                # input (an FP32 RMSNorm's output) would otherwise get an FP32 GEMM output,
                # twice the bytes written and read again by the next kernel.
                dx = fp8_mm(gq, f_g, sg, wq_t, f_w, sw, ctx.out_dtype).to(ctx.x_dtype)
            if need_dw:
                # Both transposed copies carry the same zero padding of the token dim.
                # Compiled, the scale made again as it was traced before (graphs unchanged).
                dw = fp8_mm(gq_t, f_g, sg if ctx.scales is not None else pow2(eg), xq_t, f_in, sx, ctx.w_dtype)
        elif need_dx or need_dw:
            if need_dx:
                dx = (gy @ weight_or_codes.to(gy.dtype)).to(ctx.x_dtype)
            if need_dw:
                x_hat = linear_dequantize(xq_t[:, :ctx.m], ex, f_in, gy.dtype)
                dw = (gy.t() @ x_hat.t()).to(ctx.w_dtype)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        if need_db and ctx.bias_dtype is not None:
            db = gy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_guess: torch.Tensor | None,
               out_dtype: torch.dtype, spec: Fp8LinearSpec) -> torch.Tensor:
    """y = x @ weight.t() + bias over x's last dim in `out_dtype`, as described above.
    `weight_guess`: the weight's exponent-guess state (kernels/layout.new_weight_guess, on its
    device), which the Triton kernels read and update in place; None quantizes the weight
    from its max."""
    return _Fp8LinearFunction.apply(x, weight, bias, weight_guess, out_dtype, spec)
