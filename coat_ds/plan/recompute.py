"""A recomputed layer: torch's non-reentrant checkpoint around its forward, and optionally its
input kept between forward and backward as FP8 codes rather than as the tensor itself.

Recomputation keeps one thing per layer alive until backward: the layer's input, which a model
with FP32 master weights carries in FP32 (4 bytes per element; 1.07 GB per 2048-token sample of
a 32-layer 7B model). Kept as FP8 codes with one power-of-two scale per group of consecutive
elements, it costs (1 + 1/G) bytes per element. Forward uses the exact input; backward
recomputes the layer from the dequantized one, so its gradients carry the same kind of error as
compressed saved activations (the layer's own input gradient flows back unchanged)."""
from __future__ import annotations

import functools
import warnings

import torch

from .._compat.torch import detach_unseen, inside_checkpoint
from ..config import ActivationConfig
from ..kernels.registry import get
from ..kernels.fp8 import get_format

__all__ = ["recomputed", "is_recomputed", "compile_layer"]


class _LayerInput:
    """The first input of one call of a recomputed layer: the tensor while the layer's forward
    runs, then only its FP8 codes (`compress`); `get` hands either to the layer."""

    __slots__ = ("tensor", "codes", "exps", "shape", "dtype", "requires_grad", "version", "counter",
                 "ops", "fmt", "group_size")

    def __init__(self, x: torch.Tensor, ops, fmt, group_size: int):
        self.tensor = x
        self.codes = self.exps = None
        self.shape, self.dtype, self.requires_grad = x.shape, x.dtype, x.requires_grad
        self.ops, self.fmt, self.group_size = ops, fmt, group_size
        self.version, self.counter = None, None

    def compress(self) -> None:
        x = self.tensor
        self.codes, self.exps = self.ops.quantize_rows(x.detach().contiguous(), self.group_size, self.fmt)
        # Recomputing from values changed in place since forward would be silently wrong. The
        # version counter, shared by this alias, outlives the input's storage; made unseen, as
        # compressed activations' are, so that the CPU storage meter does not count it.
        alias = detach_unseen(x)
        self.version, self.counter = x._version, alias
        alias.data = torch.empty(0, dtype=x.dtype, device=x.device)
        self.tensor = None

    def get(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        if self.counter._version != self.version:
            raise RuntimeError(f"the input of a recomputed layer ({self.dtype}, {list(self.shape)}) was modified "
                               f"in place after its forward (version {self.counter._version}, saved at "
                               f"{self.version}): backward cannot recompute the layer; clone it before modifying it")
        x = self.ops.dequantize_rows(self.codes, self.exps, self.group_size, self.fmt, self.dtype).view(self.shape)
        return x.requires_grad_(self.requires_grad)


def _layer_input(args, kwargs):
    """The layer's input (its hidden states: first positional, or `hidden_states=`) and where
    it was passed (0 or "hidden_states"), or (None, None) when it is not a float tensor."""
    if args and isinstance(args[0], torch.Tensor):
        x, key = args[0], 0
    else:
        x, key = kwargs.get("hidden_states"), "hidden_states"
    return (x, key) if isinstance(x, torch.Tensor) and x.is_floating_point() else (None, None)


class RecomputedForward:
    """A layer's forward, checkpointed: set as the layer's `forward` by `recomputed`."""

    def __init__(self, forward, fp8_input: ActivationConfig | None):
        functools.update_wrapper(self, forward)
        self.inner = forward
        self.fp8_input = fp8_input
        self._warned = False
        if fp8_input is not None:
            self._fmt = get_format(fp8_input.other_format)
            # torch.compile would trace the checkpoint into a graph that saves the exact input
            # itself; this stays eager, and `compile_layer` compiles the layer inside it.
            self._checkpoint_fp8 = torch.compiler.disable(self._checkpoint_fp8)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or inside_checkpoint():
            # Inside another checkpoint (Hugging Face's gradient checkpointing around the
            # layer), that one already recomputes the layer.
            return self.inner(*args, **kwargs)
        x, key = _layer_input(args, kwargs) if self.fp8_input is not None else (None, None)
        if x is not None and not self._warned and torch.compiler.is_compiling():
            # Traced from outside (layer.compile()): the checkpoint below is a graph break,
            # and the layer inside it then runs uncompiled.
            self._warned = True
            warnings.warn("a layer recomputed from FP8 inputs was compiled with layer.compile() or torch.compile "
                          "around it: its checkpoint runs eagerly and the layer inside it uncompiled; compile it "
                          "with coat_ds.plan.compile_layer(layer) instead", stacklevel=2)
        if x is None:
            # Non-reentrant: keyword arguments (Hugging Face layers take most of theirs that
            # way) pass through, and the recomputation's saved tensors are freed as backward goes.
            return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)
        return self._checkpoint_fp8(x, key, args, kwargs)

    def _checkpoint_fp8(self, x, key, args, kwargs):
        box = _LayerInput(x, get("act_codec", x.device, self.fp8_input.backend), self._fmt, self.fp8_input.group_size)
        inner = self.inner
        # The layer reads its input from the box: the tensor in forward, the dequantized codes
        # when backward recomputes it (checkpoint matches the saved tensors by order and
        # metadata, which both runs share).
        if key == 0:
            def run(box, *rest, **kw):
                return inner(box.get(), *rest, **kw)
            args = args[1:]
        else:
            def run(box, *rest, **kw):
                return inner(*rest, hidden_states=box.get(), **kw)
            kwargs = {k: v for k, v in kwargs.items() if k != key}
        out = torch.utils.checkpoint.checkpoint(run, box, *args, use_reentrant=False, **kwargs)
        box.compress()
        return out


def recomputed(forward, *, fp8_input: ActivationConfig | None = None) -> RecomputedForward:
    """`forward` run under activation checkpointing; with `fp8_input`, the layer's first input
    (positional, or `hidden_states=`) is kept as FP8 codes (its `other_format`, `group_size`,
    `backend`) between forward and backward."""
    return RecomputedForward(forward, fp8_input)


def is_recomputed(layer: torch.nn.Module) -> bool:
    return isinstance(layer.__dict__.get("forward"), RecomputedForward)


def compile_layer(layer: torch.nn.Module, *, forward_only: bool = False, **compile_kwargs) -> None:
    """`layer.compile(**compile_kwargs)`, except for a layer recomputed from an FP8 input, whose
    forward inside the checkpoint is compiled instead (the checkpoint itself runs eagerly).
    `forward_only`: compile the layer's forward but not the hooks around its call (engines'
    hooks that gather and release parameters then run eagerly, outside the graph)."""
    forward = layer.__dict__.get("forward")
    if isinstance(forward, RecomputedForward) and forward.fp8_input is not None:
        forward.inner = torch.compile(forward.inner, **compile_kwargs)
    elif forward_only:
        layer.forward = torch.compile(layer.forward, **compile_kwargs)
    else:
        layer.compile(**compile_kwargs)
