"""torch.compile under ZeRO-3, one graph per decoder layer.

ZeRO-3 gathers and releases parameters in hooks around every module call; compiled around
them, those hooks break each layer into small graphs and their per-module state recompiles
them (the parameters' sizes change as they are gathered and released). Here each decoder
layer becomes a ZeRO-3 leaf module instead: DeepSpeed gathers all of its parameters at the
layer's own call and hooks none of its submodules. Only the layer's forward is compiled, so
the layer's hooks stay eager around one graph, which every layer of the same shape reuses.
The layer's parameters are then whole from its first line to its last, as under FSDP2."""
from __future__ import annotations

from torch import nn

from ...plan.layers import decoder_layers
from ...plan.recompute import compile_layer

__all__ = ["compile_zero3_layers"]


def compile_zero3_layers(model: nn.Module, **compile_kwargs) -> int:
    """Make each decoder layer of `model` (the ModuleList holding most of its parameters:
    `model.layers` of a Hugging Face decoder, `blocks` of coat_ds's Llama) a ZeRO-3 leaf
    module and compile its forward with `torch.compile(**compile_kwargs)`; returns how many.
    Call before `deepspeed.initialize` / `coat_ds.deepspeed_initialize`, which place the
    hooks, and after `coat_ds.prepare` (layers recomputed from FP8 inputs compile inside their
    checkpoint). Under ZeRO-1/2 or without DeepSpeed the leaf flag does nothing."""
    from deepspeed.utils import set_z3_leaf_module

    layers = decoder_layers(model)
    for _, layer in layers:
        set_z3_leaf_module(layer, True)
        compile_layer(layer, forward_only=True, **compile_kwargs)
    return len(layers)
