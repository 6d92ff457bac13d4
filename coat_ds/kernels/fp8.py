"""FP8 format constants shared by the Triton kernels and their pure-torch twins."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

# The Triton versions this package declares, and the installed one (older: the torch reference).
from .._compat.triton import TRITON_MIN, triton_version

__all__ = ["Fp8Format", "E4M3", "E5M2", "get_format", "triton_usable", "K_ONE", "K_MIN_CODE", "K_MAX_CODE", "GEMM_ALIGN", "select_isa",
           "kernel_isa", "set_fp8_conversions", "triton_version", "ISA_GENERIC", "ISA_NVIDIA", "ISA_NVIDIA_FP8", "use_triton",
           "FP8_CAPABILITY", "has_fp8", "cuda_has_fp8"]

# DRE exponents are stored as uint8 multiples of 1/16 (k = code / 16), which is why the
# reference implementation rounds k down to a multiple of 1/16.
K_ONE = 16
# k = 8 is the largest useful expansion.
K_MAX_CODE = 128
# torch._scaled_mm (cuBLASLt) wants both dims of each FP8 operand in multiples of 16.
GEMM_ALIGN = 16
# k >= 1/4: FP8's rounding error of the mapped value is raised to the power 1/k, so k = 1/16
# gave up to 150 % (E4M3) on every element of a group spanning 40+ decades. With k >= 1/4
# the top 16 decades of any group keep E4M3's error under 79 % (26 % where the mapped value
# is normal) and E5M2's under 52 % (docs/optimizer.md); elements further down are coarser,
# and those below the format's range decode to the group's smallest code instead of 0, so
# no second moment is flushed.
K_MIN_CODE = 4


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding: its limits and the Dynamic Range Expansion target."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    exponent_bias: int
    min_normal_exp: int
    code_max: int  # the saturated code for +max (sign bit clear)
    dre_log2_range: float  # log2 of the max/min ratio that DRE stretches a group to

    @property
    def log2_max(self) -> float:
        return math.log2(self.max)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value of the format."""
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)

    @property
    def id(self) -> int:
        """Integer tag passed to kernels as a constexpr."""
        return 0 if self.name == "e4m3" else 1


def _dre_range(max_value: float, min_normal_exp: int, mantissa_bits: int) -> float:
    # After power-of-two scaling a group's max lands in (max/2, max]. Its min may reach
    # into the subnormals by all but one mantissa bit: measured on real AdamW moments
    # (tests/test_dre.py), the larger k wins more than the coarse subnormals lose (keeping
    # every min normal raised the MSE of m / sqrt(v) by 31 %, E4M3), while one bit further
    # flushes the smallest second moments to zero. The price is each group's smallest
    # elements: up to 79 % error instead of 26 % (E4M3, docs/optimizer.md).
    return math.log2(max_value / 2) - min_normal_exp + (mantissa_bits - 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 7, -6, 0x7E, _dre_range(448.0, -6, 3))
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 15, -14, 0x7B, _dre_range(57344.0, -14, 2))

_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def get_format(name: str | Fp8Format) -> Fp8Format:
    if isinstance(name, Fp8Format):
        return name
    key = str(name).lower().replace("_", "").replace("fn", "")
    if key not in _FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(_FORMATS)}")
    return _FORMATS[key]


# What the compiled kernels may use, passed to each of them as the constexpr ISA.
ISA_GENERIC = 0  # plain Triton (interpreter, ROCm): precise log2/exp2, FP8 coded in integer ops
ISA_NVIDIA = 1  # NVIDIA PTX special-function approximations, FP8 coded in integer ops (portable FP8)
ISA_NVIDIA_FP8 = 2  # NVIDIA compute capability 8.9+: also the hardware FP8 conversions (cvt ... e4m3x2)

PATH_NAMES = {ISA_GENERIC: "Triton, portable FP8 (generic Triton, no PTX)",
              ISA_NVIDIA: "Triton, portable FP8 (software encode/decode)",
              ISA_NVIDIA_FP8: "Triton, hardware FP8 conversions"}

_FP8_MODES = ("auto", "portable")
FP8_ENV = "COAT_DS_FP8_CONVERSIONS"
_log = logging.getLogger("coat_ds.kernels")


def _triton_importable() -> bool:
    v = triton_version()
    if v is None:
        return False
    if v < TRITON_MIN:
        _once(("old-triton", v), f"coat_ds: Triton {v[0]}.{v[1]} is older than the {TRITON_MIN[0]}.{TRITON_MIN[1]} "
              "these kernels are tested with; using the torch reference kernels")
        return False
    return True


def triton_usable(device: torch.device) -> bool:
    """True where the Triton kernels can run on tensors of `device`.

    CUDA tensors use compiled kernels; CPU tensors only under TRITON_INTERPRET=1 (tests)."""
    if not _triton_importable():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


# The first CUDA compute capability with FP8 in hardware (and every later one): its
# conversions for the kernels, its GEMMs for torch._scaled_mm.
FP8_CAPABILITY = (8, 9)


def has_fp8(capability: tuple[int, int]) -> bool:
    """Whether a CUDA device of `capability` has FP8 conversions and GEMMs in hardware."""
    return tuple(capability) >= FP8_CAPABILITY


@torch.compiler.assume_constant_result
def cuda_has_fp8(index: int) -> bool:
    """`has_fp8` of CUDA device `index`; a constant to torch.compile, which would otherwise
    guard on (or break the graph at) the capability query."""
    return has_fp8(torch.cuda.get_device_capability(index))


def select_isa(capability: tuple[int, int] | None, hip: bool, force_portable: bool = False) -> int:
    """The kernels' ISA for a device: `capability` of a CUDA device (None for CPU, under the
    interpreter), `hip` for ROCm builds (no PTX at all). FP8 conversions are hardware ones
    only from compute capability 8.9 on (FP8_CAPABILITY), unless `force_portable`."""
    if capability is None or hip:
        return ISA_GENERIC
    if has_fp8(capability) and not force_portable:
        return ISA_NVIDIA_FP8
    return ISA_NVIDIA


_ISA: dict = {}
# (is_cuda, device index) -> ISA, for `tensor_isa`; cleared with _ISA.
_TENSOR_ISA: dict = {}
_LOGGED: set = set()
_forced: list[str | None] = [None]


def _once(key, msg: str) -> None:
    # Dynamo cannot trace a Logger call: logging while a graph is traced would break the
    # graph at the first converted layer. The eager call that follows logs it.
    if torch.compiler.is_compiling():
        return
    if key not in _LOGGED:
        _LOGGED.add(key)
        _log.info(msg)


def set_fp8_conversions(mode: str | None) -> None:
    """"portable" makes every CUDA kernel launched from now on code FP8 in software (as on
    GPUs before compute capability 8.9), "auto" picks by capability, None defers to the
    environment variable COAT_DS_FP8_CONVERSIONS (same values, default "auto")."""
    if mode is not None and mode not in _FP8_MODES:
        raise ValueError(f"FP8 conversions mode must be one of {_FP8_MODES} or None, got {mode!r}")
    _forced[0] = mode
    _ISA.clear()
    _TENSOR_ISA.clear()


def _fp8_mode() -> str:
    mode = _forced[0] or os.environ.get(FP8_ENV, "auto")
    if mode not in _FP8_MODES:
        raise ValueError(f"{FP8_ENV} must be one of {_FP8_MODES}, got {mode!r}")
    return mode


def kernel_isa(device: torch.device) -> int:
    """The ISA constexpr for kernels on `device` (cached per device; logs the path once)."""
    key = (device.type, device.index)
    isa = _ISA.get(key)
    if isa is None:
        cap = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            cap = torch.cuda.get_device_capability(index)
        isa = _ISA[key] = select_isa(cap, torch.version.hip is not None, _fp8_mode() == "portable")
        where = f"{device.type}" + (f", compute capability {cap[0]}.{cap[1]}" if cap else "")
        _once((key, isa), f"coat_ds kernels on {where}: {PATH_NAMES[isa]}")
    return isa


def tensor_isa(x: torch.Tensor) -> int:
    """`kernel_isa(x.device)` without building a device object and its key: on the
    activation path every saved tensor asks twice (pack and unpack), and that construction
    cost more than the rest of the launcher's checks."""
    key = (x.is_cuda, x.get_device())
    isa = _TENSOR_ISA.get(key)
    if isa is None:
        isa = _TENSOR_ISA[key] = kernel_isa(x.device)
    return isa


def use_triton(device: torch.device, backend: str, option: str = "backend") -> bool:
    """Whether kernels for tensors on `device` are the Triton ones, for a `backend` of
    "triton", "torch" or "auto" (Triton on CUDA where it runs, the reference elsewhere; CPU
    tensors reach Triton only with "triton" under TRITON_INTERPRET=1). Logs the reference
    path once; raises where "triton" cannot run, naming `option`."""
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or not triton_usable(device))):
        log_reference_path(device, backend)
        return False
    if not triton_usable(device):
        raise RuntimeError(
            f"{option}='triton' cannot run on {device.type} tensors"
            + (" (set TRITON_INTERPRET=1 to use Triton's interpreter on CPU)" if device.type == "cpu" else ""))
    return True


def log_reference_path(device: torch.device, backend: str) -> None:
    """The one line saying that tensors on `device` get the torch reference kernels, and why."""
    why = ("backend='torch'" if backend == "torch" else
           f"Triton missing or older than {TRITON_MIN[0]}.{TRITON_MIN[1]}" if device.type == "cuda" else
           f"{device.type} tensors")
    _once((device.type, device.index, "torch"), f"coat_ds kernels on {device.type}: torch reference ({why})")
