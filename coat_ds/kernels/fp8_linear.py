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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_launch import launch
from .codec import encode_fp8, pow2, scale_exponent
from .fp8 import GEMM_ALIGN, get_format, kernel_isa

__all__ = ["linear_quantize"]

_ABSMAX_BLOCK = 4096
# A 64 x 128 tile: 16-byte loads of BF16 along K, and a transposed store whose rows are 64
# codes long; few program instances under the interpreter (its cost is per instance).
_BM = 64
_BK = 128
_NUM_WARPS = 4


@triton.jit
def _finite_absmax_kernel(x_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    a = tl.abs(tl.load(x_ptr + base + offs, mask=offs < n - base, other=0.0).to(tl.float32))
    a = tl.where(a < float("inf"), a, 0.0)  # NaN compares false too
    tl.atomic_max(amax_bits_ptr, tl.max(a, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _quantize_t_kernel(x_ptr, src_ptr, exp_ptr, codes_ptr, codes_t_ptr, M, K, MP, n_k,
                       FMT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ROW: tl.constexpr,
                       TRANS: tl.constexpr, GIVEN_EXP: tl.constexpr, ISA: tl.constexpr):
    pid = tl.program_id(0)
    pm = pid // n_k
    pk = pid % n_k
    rm = pm * BM + tl.arange(0, BM)
    rk = pk * BK + tl.arange(0, BK)
    in_k = rk[None, :] < K
    mask = (rm[:, None] < M) & in_k
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # src_ptr holds the exponent itself (GIVEN_EXP) or the max pass's float bits.
    if GIVEN_EXP:
        e = tl.load(src_ptr)
    else:
        e = tl.minimum(tl.maximum(scale_exponent(tl.load(src_ptr).to(tl.float32, bitcast=True), FMT), -126), 126)
    if pid == 0:
        tl.store(exp_ptr, e)
    codes = encode_fp8(x * pow2(-e), FMT, ISA)
    if ROW:
        tl.store(codes_ptr + offs, codes, mask=mask)
    if TRANS:
        # Rows M..MP-1 were loaded as 0: they become the zero padding columns.
        offs_t = rk[:, None].to(tl.int64) * MP + rm[None, :]
        tl.store(codes_t_ptr + offs_t, tl.trans(codes), mask=(rk[:, None] < K) & (rm[None, :] < MP))


def linear_quantize(x: torch.Tensor, fmt="e4m3", rowwise: bool = True, transposed: bool = False,
                    pad: int = GEMM_ALIGN, exp: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 of a contiguous 2-D (M, K) `x`: (codes (M, K) or None, transposed
    codes (K, M padded to a multiple of `pad`) or None, int32 exponent of shape ()), codes
    uint8 with x ~ q * 2**e; with `exp` (int32, one element, on x's device) that exponent is
    used and the max pass is skipped. See reference.linear_quantize."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"linear_quantize takes a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    isa = kernel_isa(x.device)
    m, k = x.shape
    mp = -(-m // pad) * pad if transposed else m
    dev = x.device
    codes = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    codes_t = torch.empty((k, mp), dtype=torch.uint8, device=dev) if transposed else None
    given = exp is not None
    if given:
        src = exp.to(device=dev, dtype=torch.int32).reshape(1)
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
    launch(_quantize_t_kernel, n_prog, (x, src, exp, out, out_t, m, k, mp, n_k),
           (get_format(fmt).id, _BM, _BK, rowwise, transposed, given, isa), _NUM_WARPS)
    return codes, codes_t, exp
