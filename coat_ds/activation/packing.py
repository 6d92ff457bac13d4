"""One saved tensor stored in FP8, and how it is restored for backward."""
from __future__ import annotations

import weakref

import torch

__all__ = ["PER_TENSOR", "PER_GROUP", "FP8Saved", "FP8View", "memory_order"]

PER_TENSOR = "per_tensor"
PER_GROUP = "per_group"


def memory_order(t: torch.Tensor) -> list[int] | None:
    """A permutation under which `t` is contiguous, or None if `t` overlaps itself or has
    gaps (an expanded or strided view: compressing its logical elements could cost more
    than its storage). Quantizing in memory order keeps the original strides on restore
    (some backward kernels expect them) and puts groups along the stride-1 dim."""
    if t.is_contiguous():
        return list(range(t.dim()))
    perm = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)
    return perm if t.permute(perm).is_contiguous() else None


class FP8Saved:
    """FP8 codes plus power-of-two scale exponents of one saved tensor."""

    __slots__ = ("codes", "exps", "kind", "fmt", "group_size", "dtype", "perm", "ops", "_restored",
                 "origin", "shape", "stride", "__weakref__")

    def __init__(self, t: torch.Tensor, perm: list[int], kind: str, fmt: str, group_size: int, ops):
        x = t.detach().permute(perm)
        if kind == PER_TENSOR:
            self.codes, self.exps = ops.quantize_tensor(x, fmt)
        else:
            self.codes, self.exps = ops.quantize_rows(x, group_size, fmt)
        self.kind, self.fmt, self.group_size, self.ops = kind, fmt, group_size, ops
        self.dtype, self.perm = t.dtype, perm
        self.shape, self.stride = tuple(t.shape), t.stride()
        self._restored = None
        self.origin = None  # weak reference to the tensor compressed, set by the hooks

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.exps.numel() * self.exps.element_size()

    def restore(self) -> torch.Tensor:
        """The dequantized tensor, with the original shape and strides. Several backward
        nodes unpacking the same save share one restored tensor while it is alive."""
        x = self._restored() if self._restored is not None else None
        if x is not None:
            return x
        if self.kind == PER_TENSOR:
            x = self.ops.dequantize_tensor(self.codes, self.exps, self.fmt, self.dtype)
        else:
            x = self.ops.dequantize_rows(self.codes, self.exps, self.group_size, self.fmt, self.dtype)
        inverse = [0] * len(self.perm)
        for i, d in enumerate(self.perm):
            inverse[d] = i
        x = x.permute(inverse)
        self._restored = weakref.ref(x)
        return x


class FP8View:
    """Another view of the memory an FP8Saved holds (same first element, same element count,
    both dense): an attention output saved as (B, H, S, D) and, reshaped, as o_proj's input."""

    __slots__ = ("saved", "shape", "stride")

    def __init__(self, saved: FP8Saved, t: torch.Tensor):
        self.saved, self.shape, self.stride = saved, tuple(t.shape), t.stride()

    def restore(self) -> torch.Tensor:
        x = self.saved.restore()
        return x.as_strided(self.shape, self.stride, x.storage_offset())
