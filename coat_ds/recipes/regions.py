"""`compile_regions`: under a whole-model torch.compile, each decoder layer compiled once, on its own.

Compiling a whole model (Hugging Face Trainer's torch_compile=True and Accelerate's dynamo
plugin do `model.compile()`; users write `torch.compile(model)`) inlines every decoder layer
into one graph, so the compiler works through each layer again: with FP8 linears a layer is
many more kernels than in BF16, and the first step waits for all of them. Here each layer's
class becomes a subclass whose forward, while such a compile traces it, calls the layer through
one `torch.compile` of the class's forward, shared by every layer of the class: a graph break
at each layer, and one compiled graph (per input shape) that every layer runs, as regional
compilation does. Eagerly, and where a layer is compiled on its own (`layer.compile()`, a
forward replaced on the instance: coat_ds.plan.compile_layer, recomputed layers), the forward
is the class's own."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .._compat.torch import compiled_on_its_own
from ..plan.layers import decoder_layers

__all__ = ["compile_regions", "RegionLayer"]

_REGION_CLASSES: dict[type, type] = {}


class RegionLayer(nn.Module):
    """Mixed in before a decoder layer's own class by `compile_regions`."""

    _coat_region: Callable  # the class's forward, compiled once for every layer of the class

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() and not compiled_on_its_own(self):
            return _call_region(self, args, kwargs)
        return super().forward(*args, **kwargs)


@torch.compiler.disable
def _call_region(layer: nn.Module, args, kwargs):
    # Run by the caller's compiled code as a call out of its graph; the region is compiled apart.
    return type(layer)._coat_region(layer, *args, **kwargs)


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
    whole-model torch.compile, one compiled graph serving every layer of its class; returns
    how many layers. The layer keeps its identity, parameters, hooks and state_dict keys; its
    class is swapped for a subclass. Eagerly nothing changes. The regions compile with
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
    return done
