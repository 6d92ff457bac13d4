"""One FP8 copy of an input that several converted layers read (q/k/v, gate/up), held by the
input itself.

Eagerly, sibling layers are called one after another on the same tensor object. Each would
quantize it again and backward would keep one copy per layer: three for an attention
block's input. The first Fp8Linear to quantize a tensor keeps the codes in a `SharedInput`
attached to it (`on`), with the recipe they were made for and the tensor's version counter
then (an in-place change is a miss); its siblings find them there, reuse them and save the
same tensor for backward. The codes live as long as the tensor does (the layers hold them only
weakly), or until a layer that used them starts its backward (`release`: forward is over by
then), so the last codes of a forward do not stay alive through backward.

A fused RMSNorm (norm.py) or SwiGLU (swiglu.py) folds its output's finite max while writing
it and attaches it the same way (`offer_max`): the first Fp8Linear reading the output
quantizes with it, without a max pass of its own, and keeps the codes for its siblings. A
layer that is not an Fp8Linear never looks.

Under torch.compile nothing is attached: the traced graph holds the same computation per
layer, and AOTAutograd's CSE merges it into one node (Inductor may still write that node's
codes once per GEMM reading them; docs/benchmarks.md)."""
from __future__ import annotations

import torch

__all__ = ["SharedInput", "on", "offer_max"]

_ATTR = "coat_ds_shared_input"


class SharedInput:
    """What the FP8 layers reading one tensor share of it: its finite max where its producer
    offered it (`amax`, int32 float bits, one element), and the codes the first of them made
    (`codes`, for `recipe`)."""

    __slots__ = ("version", "amax", "recipe", "codes", "__weakref__")

    def __init__(self, version: int, amax: torch.Tensor | None = None):
        self.version, self.amax, self.recipe, self.codes = version, amax, None, None

    def codes_for(self, recipe: tuple) -> tuple | None:
        """The codes kept for `recipe`, or None."""
        return self.codes if self.recipe == recipe else None

    def keep(self, recipe: tuple, codes: tuple) -> tuple:
        self.recipe, self.codes = recipe, codes
        return codes

    def release(self) -> None:
        self.amax = self.recipe = self.codes = None


def on(x: torch.Tensor) -> SharedInput:
    """The SharedInput of `x`, attached now where it has none for its current version."""
    shared = getattr(x, _ATTR, None)
    version = x._version
    if shared is None or shared.version != version:
        shared = SharedInput(version)
        setattr(x, _ATTR, shared)
    return shared


def offer_max(x: torch.Tensor, amax_bits: torch.Tensor) -> None:
    """Offer `x`'s finite max |x| (int32 float bits, one element) to the layers reading it."""
    setattr(x, _ATTR, SharedInput(x._version, amax_bits))
