"""FP8 kernels for the linear layers: per-tensor quantization, optionally transposed.

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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_launch import launch
from .codec import encode_fp8, pow2, scale_exponent
from .fp8 import GEMM_ALIGN, get_format, kernel_isa
from .layout import new_weight_guess

__all__ = ["linear_quantize", "new_guess"]

_ABSMAX_BLOCK = 4096
# A 64 x 128 tile: 16-byte loads of BF16 along K, and a transposed store whose rows are 64
# codes long; few program instances under the interpreter (its cost is per instance).
_BM = 64
_BK = 128
_NUM_WARPS = 4


@triton.jit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN compares false too


@triton.jit
def _finite_absmax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    a = _finite_abs(tl.load(x_ptr + base + offs, mask=offs < n - base, other=0.0).to(tl.float32))
    tl.atomic_max(amax_bits_ptr, tl.max(a, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _exponent_of_max(bits, FMT: tl.constexpr):
    return tl.minimum(tl.maximum(scale_exponent(bits.to(tl.float32, bitcast=True), FMT), -126), 126)


@triton.jit
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
        a = _finite_abs(x)
        tl.atomic_max(src_ptr + 1, tl.max(tl.max(a, axis=1), axis=0).to(tl.int32, bitcast=True))
        if pid == 0:
            tl.store(src_ptr + 2, e)
    if not FIXUP:
        if pid == 0:
            tl.store(exp_ptr, e)
    codes = encode_fp8(x * pow2(-e), FMT, ISA)
    if ROW:
        tl.store(codes_ptr + offs, codes, mask=mask)
    if TRANS:
        # Rows M..MP-1 were loaded as 0: they become the zero padding columns.
        offs_t = rk[:, None].to(tl.int64) * MP + rm[None, :]
        tl.store(codes_t_ptr + offs_t, tl.trans(codes), mask=store_t)


def linear_quantize(x: torch.Tensor, fmt="e4m3", rowwise: bool = True, transposed: bool = False,
                    pad: int = GEMM_ALIGN, exp: torch.Tensor | None = None, guess: torch.Tensor | None = None,
                    amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 of a contiguous 2-D (M, K) `x`: (codes (M, K) or None, transposed
    codes (K, M padded to a multiple of `pad`) or None, int32 exponent of shape ()), codes
    uint8 with x ~ q * 2**e; with `exp` (int32, one element, on x's device) that exponent is
    used and the max pass is skipped. With `guess` (`new_guess`'s state, on x's device) the
    codes are written with its exponent and written again only where the max says otherwise;
    the state, updated in place, then holds the exponent found. With `amax` (int32, one
    element: the float bits of x's finite max |x|, which the fused RMSNorm or SwiGLU that
    wrote x folded) the max pass is skipped and the codes are those it would give.
    See reference.linear_quantize."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"linear_quantize takes a contiguous 2-D tensor, got shape {tuple(x.shape)}")
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
    """A guess state for `linear_quantize` whose guess is `exp` (int32, one element)."""
    state = new_weight_guess(exp.device)
    state[0] = exp.reshape(())
    return state
