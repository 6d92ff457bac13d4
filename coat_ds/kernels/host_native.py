"""The fused C++ host step (host_adamw.cpp): its JIT build and its ctypes entry point.

The library is built on first use with torch's extension builder (g++, as DeepSpeed builds
its CPU Adam) for the SIMD level torch itself dispatches to on this CPU, so its vector
log2/exp2 are the ones torch.log2/torch.exp2 run. The build is cached by torch under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), one folder per SIMD level and
source version, and reused by later processes. If it fails (no compiler, no headers), one
log line says so and the host step keeps the chunked torch reference. ctypes releases the GIL for each call, so threads run ranges in parallel.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from .fp8 import K_MAX_CODE, K_MIN_CODE, K_ONE, Fp8Format
from .layout import AdamWHyper, AdamWSlot, QuantizedGroups
from .master import remainder_bits

__all__ = ["library", "slot_args", "step_consts", "step_range", "DISABLE_ENV"]

# Set to 1 to skip the build and run the chunked torch reference (benchmarks, debugging).
DISABLE_ENV = "COAT_DS_HOST_KERNEL_DISABLE"
_SOURCE = Path(__file__).with_name("host_adamw.cpp")
_HEADER = Path(__file__).with_name("host_fp8.h")  # included by the source; torch tracks only sources
# -ffp-contract=off: no fused multiply-adds, which would round unlike the reference's ops.
_COMMON = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-DNDEBUG"]
_SIMD = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
_log = logging.getLogger("coat_ds.kernels")
_lib: list = [None, False]  # the loaded library, and whether loading was tried
_lock = threading.Lock()

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _I, _P, _P, _P, _P, _I, _I64, _I64, _P, _P, _P, _I, _P, _I64, _I64]


def _build() -> ctypes.CDLL:
    from torch.utils.cpp_extension import load

    cap = torch.backends.cpu.get_cpu_capability()
    simd = _SIMD.get(cap, ["-DCPU_CAPABILITY=DEFAULT"])
    # The sources' hash in the name: two versions of coat_ds on one machine (or checkouts
    # run side by side) keep their own builds instead of rebuilding over each other's, and an
    # edit of the header alone still rebuilds.
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in (_SOURCE, _HEADER))).hexdigest()[:12]
    path = load(name=f"coat_ds_host_adamw_{cap.lower()}_{digest}", sources=[str(_SOURCE)],
                extra_cflags=_COMMON + simd, is_python_module=False, verbose=False)
    lib = ctypes.CDLL(path)
    fn = lib.coat_host_adamw_step
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int64
    return lib


def library() -> ctypes.CDLL | None:
    """The built library, or None where it is disabled or did not build (logged once)."""
    if _lib[1]:
        return _lib[0]
    with _lock:
        if not _lib[1]:
            if os.environ.get(DISABLE_ENV) == "1":
                _log.info(f"coat_ds host step: fused C++ kernel disabled ({DISABLE_ENV}=1); chunked torch reference")
            else:
                try:
                    _lib[0] = _build()
                except Exception as e:  # no compiler, headers or linker: the reference still runs
                    _log.warning("coat_ds host step: the fused C++ kernel did not build (%s: %s); using the "
                                 "chunked torch reference", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _lib[1] = True
    return _lib[0]


_PDTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _moment(mom, shape) -> tuple | None:
    if isinstance(mom, QuantizedGroups):
        parts = (mom.codes, mom.center, mom.kcode, mom.sexp)
        dtypes = (torch.uint8, torch.float32, torch.uint8, torch.int8)
        if mom.codes.shape != shape or any(t.dtype != d or not t.is_contiguous() or t.device.type != "cpu"
                                           for t, d in zip(parts, dtypes)):
            return None
        return tuple(t.data_ptr() for t in parts)
    if mom.dtype != torch.float32 or mom.shape != shape or not mom.is_contiguous() or mom.device.type != "cpu":
        return None
    return (mom.data_ptr(), None, None, None)


def slot_args(slot: AdamWSlot, fmt_m: Fp8Format, fmt_v: Fp8Format, cols: int) -> tuple | None:
    """The per-slot head of the kernel's arguments (its last element: the per-group skip
    counts' address, or None), or None for a slot it does not take (another dtype or device,
    non-contiguous tensors): that slot goes to the reference."""
    p, g = slot.param, slot.grad
    skips = slot.skips
    if skips is not None and (skips.dtype != torch.int32 or not skips.is_contiguous() or skips.device.type != "cpu"):
        return None
    if p.dtype not in _PDTYPES or g.dtype not in _PDTYPES or g.shape != p.shape:
        return None
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in (p, g)):
        return None
    m, v = _moment(slot.exp_avg, p.shape), _moment(slot.exp_avg_sq, p.shape)
    if m is None or v is None:
        return None
    rem = slot.remainder
    if rem is not None and (p.dtype != torch.bfloat16 or rem.shape != p.shape or not rem.is_contiguous()
                            or rem.device.type != "cpu"):
        return None
    mf = fmt_m.id if isinstance(slot.exp_avg, QuantizedGroups) else -1
    vf = fmt_v.id if isinstance(slot.exp_avg_sq, QuantizedGroups) else -1
    return (p.data_ptr(), _PDTYPES[p.dtype], None if rem is None else rem.data_ptr(), remainder_bits(rem),
            g.data_ptr(), _PDTYPES[g.dtype], *m, mf, *v, vf, cols,
            None if skips is None else skips.data_ptr())


def step_consts(hyper: AdamWHyper, fmt_m: Fp8Format, fmt_v: Fp8Format) -> tuple:
    """The scalars every range of one step shares, as C arrays (kept alive by the caller)."""
    bound = hyper.m_bound
    h = (ctypes.c_double * 13)(1 - hyper.lr * hyper.weight_decay, hyper.beta1, hyper.beta2, hyper.eps,
                               hyper.step_size, 1.0 / hyper.bias_correction2_sqrt, 1 - hyper.beta1, 1 - hyper.beta2,
                               hyper.lr, hyper.step, *hyper.log2_betas(), float("inf") if bound is None else bound)
    dre = (ctypes.c_double * 2)(K_ONE * fmt_m.dre_log2_range, K_ONE * fmt_v.dre_log2_range)
    k = (ctypes.c_int64 * 3)(K_ONE, K_MIN_CODE, K_MAX_CODE)
    return h, dre, k


def step_range(lib: ctypes.CDLL, head: tuple, group_size: int, consts: tuple, dre: bool, g0: int, g1: int) -> int:
    """Groups [g0, g1) of one slot; returns how many were skipped (non-finite)."""
    h, fdre, k = consts
    return lib.coat_host_adamw_step(*head[:-1], group_size, h, fdre, k, int(dre), head[-1], g0, g1)
