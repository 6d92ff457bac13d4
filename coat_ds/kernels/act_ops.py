"""The activation kernels' view of the kernel table (ops.py).

Kept apart from `get_ops` so that code outside `kernels/` reaches the activation kernels
without importing triton, and Triton is imported only when a Triton backend is chosen."""
from __future__ import annotations

import torch

from .ops import Kernels, kernels_for

__all__ = ["get_act_ops"]


def get_act_ops(device: torch.device, backend: str = "auto") -> Kernels:
    """Activation kernels (`quantize_tensor`, `dequantize_tensor`, `quantize_rows`,
    `dequantize_rows`) for tensors on `device`: "triton", "torch" or "auto" (Triton on CUDA,
    the reference elsewhere; CPU reaches Triton only with backend="triton" under TRITON_INTERPRET=1)."""
    return kernels_for(device, backend)
