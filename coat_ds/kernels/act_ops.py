"""Dispatch for the activation kernels: Triton launchers or their torch twins, one interface.

Kept apart from `get_ops` so that code outside `kernels/` reaches the activation kernels
without importing triton, and Triton is imported only when a Triton backend is chosen."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from . import reference
from .fp8 import use_triton

__all__ = ["get_act_ops"]

_TORCH_ACT_OPS = SimpleNamespace(
    name="torch",
    quantize_tensor=reference.act_quantize_tensor,
    dequantize_tensor=reference.act_dequantize_tensor,
    quantize_rows=reference.act_quantize_rows,
    dequantize_rows=reference.act_dequantize_rows,
)


def _triton_act_ops() -> SimpleNamespace:
    from . import act_quant

    return SimpleNamespace(name="triton", quantize_tensor=act_quant.quantize_tensor,
                           dequantize_tensor=act_quant.dequantize_tensor,
                           quantize_rows=act_quant.quantize_rows, dequantize_rows=act_quant.dequantize_rows)


def get_act_ops(device: torch.device, backend: str = "auto") -> SimpleNamespace:
    """Activation kernels for tensors on `device`: "triton", "torch" or "auto" (Triton on CUDA,
    the reference elsewhere; CPU reaches Triton only with backend="triton" under TRITON_INTERPRET=1)."""
    return _triton_act_ops() if use_triton(device, backend) else _TORCH_ACT_OPS
