"""FP8 for the linear layers (registry op "fp8_linear"; custom op `fp8_linear_quantize`):
per-tensor quantization, optionally transposed, as Triton kernels and as their torch twin.

A linear layer's FP8 GEMMs need each operand once per tensor in E4M3/E5M2 with one
power-of-two scale, and the GEMMs that contract over the token dim (the weight gradient)
need the input and the output gradient transposed. So one kernel reads a (M, K) tile once
and writes its codes row-major, transposed (K, M padded to a multiple of 16 with zero
columns: cuBLASLt wants inner dims in multiples of 16), or both. The scale needs the
tensor's max first: a first kernel folds each block's max of finite |x| into one int32
with `atomic_max` (non-negative float bits order like the floats), and the quantizer reads
it back from device memory: two launches and a memset, no host sync. Non-finite values do
not set the scale (a -inf would make every finite value encode to 0); they saturate.

A weight changes little from one step to the next, and its scale, a power of two, rarely.
Given a guess of the exponent (the one its last quantization found), one pass writes the
codes with it and folds the tile maxima as the max pass would; a second launch reads that
max, and only where the exponent it gives differs from the guess do its programs write
the codes again with it. The codes are always those of the current tensor's own scale;
the weight is read once, not twice, whenever the guess holds.

The twin is plain torch ops, which Inductor fuses into the kernels around it. A GEMM's FP8
input uses the whole format: its max takes the top code, and the codes have no inf (saved
activations do: act_codec.py). The custom op (with a fake implementation giving output
shapes) lets torch.compile trace a converted layer over the Triton kernels without a graph
break; eagerly the launcher is called directly, without the op's dispatch per call.
"""
from __future__ import annotations

import sys
from typing import Callable, NamedTuple

import torch

from .._compat.torch import force_stride_order
from .fp8 import GEMM_ALIGN, Fp8Format, get_format, kernel_isa, triton_usable
from .fp8_torch import decode_fp8, pow2, scale_exponent
from .fp8_triton import encode_fp8 as encode_fp8_tl
from .fp8_triton import finite_abs
from .fp8_triton import pow2 as pow2_tl
from .fp8_triton import scale_exponent as scale_exponent_tl
from .jit import bind, jit, launch
from .layout import new_weight_guess

__all__ = ["linear_scale_exponent", "linear_finite_absmax", "linear_quantize", "linear_dequantize",
           "linear_quantize_triton", "new_guess", "Fp8LinearKernels", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen


# ---- The torch twin -----------------------------------------------------------------------


def linear_scale_exponent(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Smallest e with amax * 2**-e <= fmt.max, clamped to [-126, 126] (int32), read from
    amax's bits: both formats' maxima are 1.75 * 2**E."""
    return scale_exponent(amax.to(torch.float32).contiguous(), fmt).clamp_(-126, 126)


def linear_finite_absmax(x: torch.Tensor, split: int = 0) -> torch.Tensor:
    """max |x| over the finite elements of `x` (float32, shape ()); 0 when none is finite.

    A -inf in a masked input must not make the scale infinite: every finite value would
    then encode to 0. With `split` (dividing x.numel()), the max is taken over runs of
    `split` consecutive elements first: the same value, but compiled, Inductor can compute
    the runs' maxima in one kernel with other reductions of that shape over the same inputs."""
    if not x.numel():
        return x.new_zeros((), dtype=torch.float32)
    a = _exact_scaling_dtype(x).abs()
    a = torch.where(a < float("inf"), a, 0.0)
    if split and x.numel() % split == 0:
        a = a.reshape(-1, split).amax(-1)
    return a.amax().to(torch.float32)


def _exact_scaling_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` itself where scaling it by a power of two is exact (BF16 has FP32's exponent
    range), else as FP32. Not upcasting a BF16 tensor matters under torch.compile: Inductor
    folds `to(bf16).to(fp32)` chains, and the FP32 tensor it then materializes for two
    consumers (max, cast) doubles the bytes moved."""
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.float32)


def linear_quantize(x: torch.Tensor, fmt="e4m3", rowwise: bool = True, transposed: bool = False,
                    pad: int = 16, exp: torch.Tensor | None = None, split: int = 0,
                    amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 of a 2-D (M, K) `x` with a power-of-two scale 2**e from its finite max,
    or with the given int32 exponent `exp` (the max is then not read: a weight quantized
    again in backward keeps its forward scale).

    Returns (codes (M, K) or None, transposed codes (K, M padded with zero columns to a
    multiple of `pad`) or None, int32 exponent e of shape ()); codes are uint8, x ~ q * 2**e.
    The transposed copy is what a GEMM that contracts over M (the weight gradient) reads.
    `split`: how the max is reduced (linear_finite_absmax); it does not change the result.
    `amax`: that max already found, as int32 float bits of one element (rms_norm_forward's or
    swiglu_forward's), so it is not read again."""
    fmt = get_format(fmt)
    if exp is not None:
        e = exp.to(torch.int32).reshape(())
    else:
        top = linear_finite_absmax(x, split) if amax is None else amax.reshape(()).view(torch.float32)
        e = linear_scale_exponent(top, fmt)
    # A saturating cast (clamp, then torch's RNE cast) equals encode_fp8 on every non-NaN
    # value, and compiles to one Inductor kernel without encode_fp8's integer sign fix-up.
    codes = (_exact_scaling_dtype(x) * pow2(-e)).clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)
    codes_t = None
    if transposed:
        m = x.shape[0]
        codes_t = codes.t()
        if m % pad:
            codes_t = torch.nn.functional.pad(codes_t, (0, pad - m % pad))
        codes_t = codes_t.contiguous()
    return (codes if rowwise else None), codes_t, e


def linear_dequantize(codes: torch.Tensor, exp: torch.Tensor, fmt="e4m3",
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of `linear_quantize`'s codes at exponent `exp`, in `dtype` (clamped to its
    finite range: the max rounds up at the top of the fp16 range, 65504 -> 65536)."""
    out_max = torch.finfo(dtype).max
    return (decode_fp8(codes, get_format(fmt)) * pow2(exp)).clamp_(-out_max, out_max).to(dtype)


# ---- The Triton kernels -------------------------------------------------------------------

_ABSMAX_BLOCK = 4096
# A 64 x 128 tile: 16-byte loads of BF16 along K, and a transposed store whose rows are 64
# codes long; few program instances under the interpreter (its cost is per instance).
_BM = 64
_BK = 128
_NUM_WARPS = 4


@jit
def _finite_absmax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    a = finite_abs(tl.load(x_ptr + base + offs, mask=offs < n - base, other=0.0).to(tl.float32))
    tl.atomic_max(amax_bits_ptr, tl.max(a, axis=0).to(tl.int32, bitcast=True))


@jit
def _exponent_of_max(bits, FMT: tl.constexpr):
    return tl.minimum(tl.maximum(scale_exponent_tl(bits.to(tl.float32, bitcast=True), FMT), -126), 126)


@jit
def _quantize_t_kernel(x_ptr, src_ptr, exp_ptr, codes_ptr, codes_t_ptr, M, K, MP, n_k,
                       FMT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ROW: tl.constexpr,
                       TRANS: tl.constexpr, GIVEN_EXP: tl.constexpr, ISA: tl.constexpr,
                       GUESS: tl.constexpr, FIXUP: tl.constexpr):
    pid = tl.program_id(0)
    pm = pid // n_k
    pk = pid % n_k
    rm = pm * BM + tl.arange(0, BM)
    rk = pk * BK + tl.arange(0, BK)
    in_k = rk[None, :] < K
    mask = (rm[:, None] < M) & in_k
    store_t = (rk[:, None] < K) & (rm[None, :] < MP)
    # src_ptr holds the exponent itself (GIVEN_EXP), the max pass's float bits, or (GUESS,
    # FIXUP) a guess state: [guessed exponent, max bits folded by the guess pass, exponent
    # that pass used].
    if FIXUP:
        e = _exponent_of_max(tl.load(src_ptr + 1), FMT)
        redo = e != tl.load(src_ptr + 2)
        # Masked off, the guess held: nothing is read or written again. (A bound that is 0
        # when it held, rather than `mask & redo`: Triton's interpreter rejects a mask
        # broadcast from a scalar.)
        rows = tl.where(redo, M, 0)
        mask = mask & (rm[:, None] < rows)
        store_t = store_t & (rm[None, :] < tl.where(redo, MP, 0))
        if pid == 0:
            if redo:
                tl.store(exp_ptr, e)
                tl.store(src_ptr, e)
    elif GIVEN_EXP or GUESS:
        e = tl.load(src_ptr)
    else:
        e = _exponent_of_max(tl.load(src_ptr), FMT)
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if GUESS:
        a = finite_abs(x)
        tl.atomic_max(src_ptr + 1, tl.max(tl.max(a, axis=1), axis=0).to(tl.int32, bitcast=True))
        if pid == 0:
            tl.store(src_ptr + 2, e)
    if not FIXUP:
        if pid == 0:
            tl.store(exp_ptr, e)
    codes = encode_fp8_tl(x * pow2_tl(-e), FMT, ISA)
    if ROW:
        tl.store(codes_ptr + offs, codes, mask=mask)
    if TRANS:
        # Rows M..MP-1 were loaded as 0: they become the zero padding columns.
        offs_t = rk[:, None].to(tl.int64) * MP + rm[None, :]
        tl.store(codes_t_ptr + offs_t, tl.trans(codes), mask=store_t)


def linear_quantize_triton(x: torch.Tensor, fmt="e4m3", rowwise: bool = True, transposed: bool = False,
                           pad: int = GEMM_ALIGN, exp: torch.Tensor | None = None, guess: torch.Tensor | None = None,
                           amax: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 of a contiguous 2-D (M, K) `x`: (codes (M, K) or None, transposed
    codes (K, M padded to a multiple of `pad`) or None, int32 exponent of shape ()), codes
    uint8 with x ~ q * 2**e; with `exp` (int32, one element, on x's device) that exponent is
    used and the max pass is skipped. With `guess` (`new_guess`'s state, on x's device) the
    codes are written with its exponent and written again only where the max says otherwise;
    the state, updated in place, then holds the exponent found. With `amax` (int32, one
    element: the float bits of x's finite max |x|, which the fused RMSNorm or SwiGLU that
    wrote x folded) the max pass is skipped and the codes are those it would give.
    See linear_quantize, the twin."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"linear_quantize_triton takes a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    isa = kernel_isa(x.device)
    m, k = x.shape
    mp = -(-m // pad) * pad if transposed else m
    dev = x.device
    codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    codes_t = torch.empty((k, mp), dtype=torch.uint8, device=dev) if transposed else None
    given = exp is not None
    # One-element tensors of any shape: the kernels read their first element (a reshape
    # would be one more op per call on the host).
    if given:
        src = exp.to(device=dev, dtype=torch.int32)
    elif amax is not None:
        src = amax
    elif guess is not None:
        src = guess
        guess[1].zero_()
    else:
        src = torch.zeros(1, dtype=torch.int32, device=dev)
        if m * k:
            launch(_finite_absmax_kernel, triton.cdiv(m * k, _ABSMAX_BLOCK), (x, src, m * k), (_ABSMAX_BLOCK,),
                   _NUM_WARPS)
    # A fresh tensor even when given (a custom op's outputs may not alias its inputs), and
    # its own allocation, not a view: Inductor asserts that a custom op's outputs are
    # 16-byte aligned. The kernel's first program writes it.
    exp = torch.empty((), dtype=torch.int32, device=dev)
    n_k = max(1, triton.cdiv(k, _BK))
    n_prog = max(1, triton.cdiv(mp, _BM) * n_k)
    # Absent outputs get a valid pointer; the constexpr flags keep the kernel off them.
    out = codes if codes is not None else src
    out_t = codes_t if codes_t is not None else src
    consts = (get_format(fmt).id, _BM, _BK, rowwise, transposed, given, isa)
    guessing = guess is not None and not given and amax is None
    launch(_quantize_t_kernel, n_prog, (x, src, exp, out, out_t, m, k, mp, n_k), consts + (guessing, False),
           _NUM_WARPS)
    if guessing:
        launch(_quantize_t_kernel, n_prog, (x, src, exp, out, out_t, m, k, mp, n_k), consts + (False, True),
               _NUM_WARPS)
    return codes, codes_t, exp


def new_guess(exp: torch.Tensor) -> torch.Tensor:
    """A guess state for `linear_quantize_triton` whose guess is `exp` (int32, one element)."""
    state = new_weight_guess(exp.device)
    state[0] = exp.reshape(())
    return state


# ---- The custom op and the registry's kernels ---------------------------------------------

_FORMATS = ("e4m3", "e5m2")


def _split(codes, codes_t, e, rowwise: bool, transposed: bool):
    # A custom op returns tensors only: an absent output travels as an empty tensor.
    empty = e.new_empty((0,), dtype=torch.uint8)
    return (codes if rowwise else empty), (codes_t if transposed else empty), e


def _launch(x, fmt, rowwise, transposed, exp, guess, amax):
    return linear_quantize_triton(x.contiguous(), fmt, rowwise, transposed, GEMM_ALIGN, exp, guess, amax)


# `guess`: new_guess's state, which the Triton kernels start from and update in place (the
# twin ignores it). It has no default: torch 2.11 drops a trailing argument left at its
# default before bumping the version of each mutated one, and then fails indexing it.
# `amax`: x's finite max already found (linear_quantize's), eager calls only.
@torch.library.custom_op("coat_ds::fp8_linear_quantize", mutates_args=("guess",))
def _quantize_op(x: torch.Tensor, fmt_id: int, rowwise: bool, transposed: bool, guess: torch.Tensor | None,
                 exp: torch.Tensor | None = None, twin: bool = False,
                 amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = _FORMATS[fmt_id]
    if not twin and triton_usable(x.device):
        bind(sys.modules[__name__])
        out = _launch(x, fmt, rowwise, transposed, exp, guess, amax)
    else:
        out = linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp, amax=amax)
        if exp is not None:
            out = (out[0], out[1], out[2].clone())  # a custom op's outputs may not alias its inputs
    return _split(*out, rowwise, transposed)


@_quantize_op.register_fake
def _(x, fmt_id, rowwise, transposed, guess, exp=None, twin=False, amax=None):
    m, k = x.shape
    mp = -(-m // GEMM_ALIGN) * GEMM_ALIGN
    codes = x.new_empty((m, k) if rowwise else (0,), dtype=torch.uint8)
    codes_t = x.new_empty((k, mp) if transposed else (0,), dtype=torch.uint8)
    return codes, codes_t, x.new_empty((), dtype=torch.int32)


def _triton_quantize(x, fmt, rowwise, transposed, exp=None, split=0, guess=None, twin=False, amax=None):
    # `split` shapes the twin's max reduction for Inductor; the Triton kernel has its own blocks.
    if not twin and not torch.compiler.is_compiling():
        # Eagerly the launcher itself, as the op would run it: the op's dispatch costs host
        # time per call (small layers wait on the host) and an empty tensor per absent
        # output. (These are the registry's kernels only where Triton runs on x's device.)
        return _launch(x, fmt, rowwise, transposed, exp, guess, amax)
    codes, codes_t, e = _quantize_op(x, get_format(fmt).id, rowwise, transposed, guess, exp, twin, amax)
    return (codes if rowwise else None), (codes_t if transposed else None), e


def _kept_twin(x, fmt, rowwise, transposed, exp=None, split=0, guess=None, amax=None):
    # Not handed the guess: the twin never reads it, and a compiled graph would copy it back.
    return _triton_quantize(x, fmt, rowwise, transposed, exp, split, twin=True, amax=amax)


def _torch_quantize(x, fmt, rowwise, transposed, exp=None, split=0, guess=None, amax=None):
    codes, codes_t, e = linear_quantize(x, fmt, rowwise, transposed, GEMM_ALIGN, exp, split, amax)
    if torch.compiler.is_compiling():
        codes, codes_t = _one_buffer(codes), _one_buffer(codes_t)
    return codes, codes_t, e


def _one_buffer(codes):
    """Inductor's _scaled_mm lowering writes a pointwise cast once per GEMM that reads it
    (q/k/v: three identical FP8 copies of their input); a fixed layout makes the cast one
    buffer that all of them read. Eagerly a no-op (the strides already match)."""
    if codes is None:
        return None
    return force_stride_order(codes)


class Fp8LinearKernels(NamedTuple):
    """The per-tensor quantizer, `quantize(x2d, fmt, rowwise, transposed, exp=None, split=0,
    guess=None, amax=None) -> (codes | None, codes_t | None, exp)` (`exp`: use this exponent
    instead of reading the max; `split`: linear_finite_absmax's, for the twin; `guess`: a
    weight's new_guess state on its device, which the Triton kernels start from and update
    in place, the twin ignores it; `amax`: x's finite max, found by the fused RMSNorm or
    SwiGLU that wrote x, as int32 float bits), and `quantize_kept`, the same always through
    the custom op (the twin inside it where that is the backend): compiled graphs save what
    a custom op returns rather than recompute it in backward."""

    quantize: Callable
    quantize_kept: Callable


TORCH = Fp8LinearKernels(_torch_quantize, _kept_twin)
TRITON = Fp8LinearKernels(_triton_quantize, _triton_quantize)
