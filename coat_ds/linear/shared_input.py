"""One FP8 copy of an input that several converted layers read (q/k/v, gate/up).

Eagerly, sibling layers are called one after another on the same tensor object. Each would
quantize it again and backward would keep one copy per layer: three for an attention
block's input. The last input quantized in forward is remembered here, keyed on the tensor
object (a weak reference), its version counter (an in-place change is a miss) and the
recipe, so its siblings reuse the codes and save the same tensor for backward.

Under torch.compile nothing is remembered: the traced graph holds the same computation
three times, and AOTAutograd's CSE merges it into one node (Inductor may still write that
node's codes once per GEMM reading them; docs/history/benchmarks-2026-11.md). The entry is dropped when any
converted layer's backward starts (forward is over by then), so the last codes of a
forward do not stay alive through backward; without a backward (inference) one entry stays
until the next input.

A fused RMSNorm (norm.py) or SwiGLU (swiglu.py) folds its output's max while writing it
and offers that max here, keyed the same way: the first layer reading the output quantizes with it, without a
max pass of its own, and remembers the codes for its siblings as above."""
from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["clear", "lookup", "remember", "offer_max", "offered_max"]

_local = threading.local()


def _kept(slot: str, x: torch.Tensor) -> tuple | None:
    """What `slot` keeps for `x` itself (the same object, unchanged since), or None."""
    held = getattr(_local, slot, None)
    if held is None or held[0]() is not x or x._version != held[1]:
        return None
    return held[2:]


def lookup(x: torch.Tensor, recipe: tuple) -> tuple | None:
    """The codes remembered for `x` under `recipe`, or None."""
    kept = _kept("entry", x)
    return kept[1] if kept is not None and kept[0] == recipe else None


def remember(x: torch.Tensor, recipe: tuple, codes: tuple) -> None:
    _local.entry = (weakref.ref(x), x._version, recipe, codes)


def offer_max(x: torch.Tensor, amax_bits: torch.Tensor) -> None:
    """Offer `x`'s finite max |x| (int32 float bits, one element) to the layers reading it."""
    _local.offer = (weakref.ref(x), x._version, amax_bits)


def offered_max(x: torch.Tensor) -> torch.Tensor | None:
    """The max offered for `x` (unchanged since), or None."""
    kept = _kept("offer", x)
    return None if kept is None else kept[0]


def clear() -> None:
    _local.entry = None
    _local.offer = None
