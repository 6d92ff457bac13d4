"""`compile_regions`: under a whole-model torch.compile, each decoder layer compiled once, on its own,
and the rest of the model eager.

Compiling a whole model (Hugging Face Trainer's torch_compile=True and Accelerate's dynamo
plugin do `model.compile()`; users write `torch.compile(model)`) inlines every decoder layer
into one graph, so the compiler works through each layer again: with FP8 linears a layer is
many more kernels than in BF16, and the first step waits for all of them. Here each layer's
class becomes a subclass whose forward runs the layer through one `torch.compile` of the class's
forward, shared by every layer of the class, as regional compilation does. The model's own
class becomes a subclass whose forward, while such a compile traces it, steps out of the trace
and runs eagerly: the layers are then called from eager code, one compiled call each, with no
graph break and resumed frame around every layer (host time the GPU waited on in a layer's
forward), and the code between them (embedding, mask, norm, head) runs as it does eagerly:
Hugging Face builds no causal mask there when nothing is padded, where a traced build hands
attention a materialized one. Eagerly, and where a layer is compiled on its own
(`layer.compile()`, a forward replaced on the instance: coat_ds.plan.compile_layer, recomputed
layers), runs inside an activation checkpoint or without gradients (a reentrant checkpoint's
first pass, which its recomputation would not match), the forward is the class's own."""
from __future__ import annotations

import contextvars
import functools
from typing import Callable

import torch
from torch import nn

from .._compat.torch import compiled_on_its_own, inside_checkpoint
from ..plan.layers import decoder_layers

__all__ = ["compile_regions", "RegionLayer", "RegionModel"]

_REGION_CLASSES: dict[type, type] = {}
_MODEL_CLASSES: dict[type, type] = {}
# Set while a RegionModel's forward runs eagerly in place of a whole-model compile's trace.
_STEPPED_OUT = contextvars.ContextVar("coat_ds_regions_stepped_out", default=False)


class RegionLayer(nn.Module):
    """Mixed in before a decoder layer's own class by `compile_regions`."""

    _coat_region: Callable  # the class's forward, compiled once for every layer of the class

    def forward(self, *args, **kwargs):
        if not compiled_on_its_own(self):
            # A checkpoint recomputes the layer in backward, outside the model's call: the layer
            # runs its own forward then, so it must run it the first time too.
            if _STEPPED_OUT.get() and torch.is_grad_enabled() and not inside_checkpoint():
                return type(self)._coat_region(self, *args, **kwargs)
            if torch.compiler.is_compiling():
                return _call_region(self, args, kwargs)
        return super().forward(*args, **kwargs)


class RegionModel(nn.Module):
    """Mixed in before the model's own class by `compile_regions`; the subclass's forward is
    `_stepping_out` of the class's own."""


def _stepping_out(plain: Callable) -> Callable:
    # plain's signature (functools.wraps): HF Trainer reads it to keep the batch's columns.
    @functools.wraps(plain)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return _step_out(plain, self, args, kwargs)
        return plain(self, *args, **kwargs)

    return forward


@torch.compiler.disable
def _step_out(plain: Callable, model: nn.Module, args, kwargs):
    # Run by the whole-model compile as a call out of its trace: the model's own forward, eagerly.
    token = _STEPPED_OUT.set(True)
    try:
        return plain(model, *args, **kwargs)
    finally:
        _STEPPED_OUT.reset(token)


@torch.compiler.disable
def _call_region(layer: nn.Module, args, kwargs):
    # Run by the caller's compiled code as a call out of its graph; the region is compiled apart.
    return type(layer)._coat_region(layer, *args, **kwargs)


def _model_class(cls: type) -> type:
    if cls not in _MODEL_CLASSES:
        _MODEL_CLASSES[cls] = type(cls.__name__, (RegionModel, cls), {
            "__module__": cls.__module__, "__doc__": cls.__doc__, "forward": _stepping_out(cls.forward)})
    return _MODEL_CLASSES[cls]


def _region_class(cls: type) -> type:
    if cls not in _REGION_CLASSES:
        plain = cls.forward
        _REGION_CLASSES[cls] = type(cls.__name__, (RegionLayer, cls), {
            "__module__": cls.__module__, "__doc__": cls.__doc__,
            # staticmethod: called with the layer as its first argument, shared by every instance.
            "_coat_region": staticmethod(torch.compile(plain))})
    return _REGION_CLASSES[cls]


def compile_regions(model: nn.Module, *, module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> int:
    """Make each decoder layer of `model` (the ModuleList holding most of its parameters) that
    `module_filter_fn(layer, fqn)` accepts (default: all) compile on its own under a
    whole-model torch.compile, one compiled graph serving every layer of its class, and the
    rest of `model` run eagerly under it; returns how many layers. The layers and the model keep
    their identity, parameters, hooks and state_dict keys; their classes are swapped for
    subclasses of the same name. Eagerly nothing changes. The regions compile with
    torch.compile's defaults, whatever options the whole model is compiled with."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        return 0
    done = 0
    for fqn, layer in layers:
        if module_filter_fn is not None and not module_filter_fn(layer, fqn):
            continue
        if not isinstance(layer, RegionLayer):
            layer.__class__ = _region_class(type(layer))
        done += 1
    if done and not isinstance(model, (RegionModel, RegionLayer)):
        model.__class__ = _model_class(type(model))
    return done
