"""The one kernel library: Triton kernels and their pure-torch twins behind one interface,
each also the custom op `torch.ops.coat_ds.<name>` (ops.py).

Code outside this package calls `get_ops(device, backend)` and never imports triton."""
from __future__ import annotations

import torch

from . import host, linear_ops, reference
from .fp8 import E4M3, E5M2, Fp8Format, get_format, kernel_isa, set_fp8_conversions, triton_usable
from .layout import AdamWHyper, AdamWSlot, GroupLayout, QuantizedGroups, group_layout
from .ops import Kernels, kernels_for, torch_kernels

__all__ = [
    "get_ops",
    "Kernels",
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


def get_ops(device: torch.device, backend: str = "auto") -> Kernels:
    """Kernels for tensors on `device`: "triton", "torch" (reference) or "auto" (Triton on
    CUDA, the reference elsewhere; CPU tensors reach Triton only through backend="triton"
    under TRITON_INTERPRET=1). Which FP8 conversions the Triton kernels use is chosen per
    device by `kernel_isa`. The one kernel table: see ops.py."""
    return kernels_for(device, backend)


torch_kernels()  # built now, not first while torch.compile traces a layer asking for it
