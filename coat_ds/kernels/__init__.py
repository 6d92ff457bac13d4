"""The one kernel library: per op, one file with its Triton kernels, their pure-torch twins
and its custom ops (`torch.ops.coat_ds.<name>`), all reached through one registry.

Code outside this package takes kernels from `get(op, device, backend)` (registry.py) and
never imports triton."""
from __future__ import annotations

from . import reference
from .fp8 import E4M3, E5M2, Fp8Format, get_format, kernel_isa, set_fp8_conversions, triton_usable
from .layout import AdamWHyper, AdamWSlot, GroupLayout, QuantizedGroups, group_layout
from .registry import get

__all__ = [
    "get",
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

