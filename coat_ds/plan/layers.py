"""Where a model's decoder layers are, and one training loss for the models the planner knows."""
from __future__ import annotations

import torch
from torch import nn

from ..models.sharded_init import local_range

__all__ = ["decoder_layers", "vocab_size_of", "training_loss"]


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, layer) of the ModuleList holding most of the model's parameters: `model.layers`
    of a Hugging Face decoder, `blocks` of coat_ds.models.llama.Llama."""
    best, best_params = None, 0
    for fqn, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            n = sum(local_range(p).numel for p in m.parameters())  # whole: ZeRO-3 built them partitioned
            if n > best_params:
                best, best_params = (fqn, m), n
    if best is None:
        raise ValueError(f"{type(model).__name__}: no nn.ModuleList of layers with parameters found; the planner "
                         "plans per element of the model's layer list (model.layers, blocks, ...)")
    prefix, layers = best
    return [(f"{prefix}.{i}" if prefix else str(i), layer) for i, layer in enumerate(layers)]


def vocab_size_of(model: nn.Module) -> int:
    """The vocabulary random token ids are drawn from."""
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None)):
        v = getattr(holder, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError(f"{type(model).__name__}: no config.vocab_size or cfg.vocab_size; pass loss_fn and vocab_size")


def training_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of `ids` (batch, seq + 1): a Hugging Face causal LM through
    `labels=`, anything else (coat_ds.models.llama.Llama) as `model(inputs, targets)`."""
    if hasattr(model, "config") and hasattr(model, "get_output_embeddings"):
        return model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
    return model(ids[:, :-1], ids[:, 1:])
