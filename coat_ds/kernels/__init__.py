"""The one kernel library: Triton kernels and their pure-torch twins behind one interface.

Code outside this package calls `get_ops(device, backend)` and never imports triton."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import host, reference
from .fp8 import E4M3, E5M2, Fp8Format, get_format, kernel_isa, set_fp8_conversions, triton_usable, use_triton
from .layout import AdamWHyper, AdamWSlot, GroupLayout, QuantizedGroups, group_layout

__all__ = [
    "get_ops",
    "reference",
    "E4M3",
    "E5M2",
    "Fp8Format",
    "get_format",
    "triton_usable",
    "kernel_isa",
    "set_fp8_conversions",
    "AdamWHyper",
    "AdamWSlot",
    "GroupLayout",
    "QuantizedGroups",
    "group_layout",
]


def _triton_ops() -> SimpleNamespace:
    from . import adamw, quantize

    return SimpleNamespace(name="triton", quantize_groups=quantize.quantize_groups,
                           dequantize_groups=quantize.dequantize_groups, adamw_step=adamw.adamw_step,
                           prepare_adamw_step=adamw.PreparedStep,
                           cast_fp8=quantize.cast_fp8)


# The reference step, chunked on host tensors (ZeRO-Offload): see host.py.
_TORCH_OPS = SimpleNamespace(name="torch", quantize_groups=reference.quantize_groups,
                             dequantize_groups=reference.dequantize_groups, adamw_step=host.adamw_step,
                             prepare_adamw_step=None,  # per-tensor work here dwarfs the Python around it
                             cast_fp8=reference.cast_fp8)


def get_ops(device: torch.device, backend: str = "auto") -> SimpleNamespace:
    """Kernels for tensors on `device`: "triton", "torch" (reference) or "auto" (Triton on
    CUDA, the reference elsewhere; CPU tensors reach Triton only through backend="triton"
    under TRITON_INTERPRET=1). Which FP8 conversions the Triton kernels use is chosen per
    device by `kernel_isa`."""
    return _triton_ops() if use_triton(device, backend) else _TORCH_OPS
