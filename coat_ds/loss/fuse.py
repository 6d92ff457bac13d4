"""`fuse_lm_head_loss`: a causal LM's training loss without its full logits (linear_ce.py).

Two classes are swapped in place, each for a subclass of its own:
- The LM head (an nn.Linear) computes, when called with labels, the chunked loss
  (`linear_cross_entropy`) instead of the logits; without labels it is the nn.Linear it was.
  The loss is computed inside the head's own call because that is where every engine makes
  its weight whole: DeepSpeed ZeRO-3 and FSDP gather parameters in hooks around module calls.
- A Hugging Face *ForCausalLM model's forward, when `labels` are given, runs the base model,
  shifts the labels as Hugging Face does and calls the head with them; without labels it is the
  original forward. Its signature is the original's, so HF Trainer's `remove_unused_columns`
  keeps the columns the model takes.
Modules, parameters, hooks and state_dict keys stay as they were, so FSDP2 (which swaps classes
the same way), DeepSpeed, hooks and checkpoints see no change.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..config import Fp8LinearConfig
from .linear_ce import IGNORE_INDEX, check_fp8_head_shape, linear_cross_entropy

__all__ = ["fuse_lm_head_loss", "SUPPORTED"]

# Classes whose forward is exactly: base model -> slice_logits_to_keep -> lm_head -> ForCausalLM
# loss, checked in transformers 5.17 and 5.24. Others may scale or cap their logits (Gemma 2 and
# 3's softcapping, Cohere's logit_scale), which the fused loss would silently drop.
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "GPT2LMHeadModel")
_FUSED = "_coat_fused_head_loss"  # marks our model subclasses
_fused_classes: dict[type, type] = {}
_head_classes: dict[type, type] = {}


class LossHead(nn.Module):
    """Mixed in before an LM head's own class (nn.Linear, or the class FSDP2 made of it):
    `head(hidden)` gives the logits, `head(hidden, labels, **options)` the loss of
    `linear_cross_entropy(hidden, head.weight, labels, head.bias, **options)`."""

    def forward(self, input: torch.Tensor, labels: torch.Tensor | None = None, **loss_options) -> torch.Tensor:
        if labels is None:
            return super().forward(input)
        return linear_cross_entropy(input, self.weight, labels, self.bias, **loss_options)


def fuse_lm_head_loss(model: nn.Module, *, chunk_tokens: int | None = None,
                      fp8: Fp8LinearConfig | None = None) -> nn.Module:
    """Make `model`'s loss skip its full logits: the LM head's cross-entropy is computed in
    chunks of `chunk_tokens` tokens (default: ~256 MiB of logits per chunk, as the loss holds them), each chunk's
    gradient made at once (coat_ds.loss.linear_cross_entropy). Saves about
    vocab x (2 + 4 + 4) bytes per token under BF16 autocast (the logits, their FP32 upcast and
    its gradient); holds the head's input gradient and weight gradient from forward instead.

    `model`: a Hugging Face LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
    GemmaForCausalLM or GPT2LMHeadModel (its class is swapped in place for a same-named
    subclass with the same forward signature), or coat_ds's own `coat_ds.models.llama.Llama`
    (its `forward(idx, targets)` turns the option on). The head, which must be a plain
    nn.Linear, becomes a `LossHead` subclass of it (same parameters and state_dict keys).
    Called with `labels`, the Hugging Face model returns a CausalLMOutputWithPast (GPT-2: ...
    WithCrossAttentions) whose `loss` is the fused loss and whose `logits` is None; callers
    that need logits call it without `labels`, which runs the original forward. The loss is
    Hugging Face's ForCausalLMLoss: labels shifted left, `ignore_index` (-100) skipped, the
    mean over labelled tokens, or the sum over `num_items_in_batch` where passed (HF Trainer
    does with gradient accumulation). Tied embeddings work (one parameter, both gradients).

    The loss runs inside the head's own call, so whatever gathers the head's weight around
    that call does so here too: DeepSpeed ZeRO-1/2/3, FSDP2 with the head in the root's group
    or sharded on its own, FSDP1. Works eagerly, with compiled decoder layers or a compiled
    model (the loss itself runs eagerly: a graph break), FP8 linears (the head stays out of
    convert_to_fp8_linear) and compressed activations. Idempotent; returns `model`.

    `fp8` (off by default): the head's three GEMMs in FP8 with this Fp8LinearConfig's formats,
    backend and forward accumulation, as an Fp8Linear layer computes (linear_cross_entropy's
    `fp8`; the output gradient per chunk in its `grad_format`, E5M2 by default). Accuracy:
    docs/head_loss.md.
    """
    if isinstance(chunk_tokens, bool) or not (chunk_tokens is None or (isinstance(chunk_tokens, int)
                                                                       and chunk_tokens >= 1)):
        raise ValueError(f"fuse_lm_head_loss: chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    if fp8 is not None and not isinstance(fp8, Fp8LinearConfig):
        raise TypeError(f"fuse_lm_head_loss: fp8 must be an Fp8LinearConfig or None, got {type(fp8).__name__}")
    if hasattr(model, "fused_head_loss"):  # coat_ds.models.llama.Llama (not imported: it imports this package)
        _make_loss_head(model.head, type(model).__name__, fp8)
        model.fused_head_loss, model.head_loss_chunk_tokens, model.head_loss_fp8 = True, chunk_tokens, fp8
        return model
    hf_class = hf_causal_lm_class(type(model))
    if hf_class is None:
        raise TypeError(f"fuse_lm_head_loss: {type(model).__name__} is not supported; supported: "
                        f"{', '.join(SUPPORTED)} (Hugging Face) and coat_ds.models.llama.Llama")
    if model.base_model is model:
        raise TypeError(f"fuse_lm_head_loss: {type(model).__name__} has no base model under "
                        f"{model.base_model_prefix!r}")
    _make_loss_head(model.get_output_embeddings(), type(model).__name__, fp8)
    if not getattr(type(model), _FUSED, False):
        model.__class__ = _fused_class(type(model))
    setattr(model, "_coat_head_loss_chunk_tokens", chunk_tokens)
    setattr(model, "_coat_head_loss_fp8", fp8)
    return model


def _make_loss_head(head: nn.Module, name: str, fp8: Fp8LinearConfig | None) -> None:
    if not isinstance(head, LossHead):
        if type(head) is not nn.Linear:
            raise TypeError(f"fuse_lm_head_loss: {name}'s output embedding is {type(head).__name__}, not "
                            "nn.Linear; fuse before converting the head (e.g. convert_to_fp8_linear with the head "
                            "included) or before an engine wraps it, or leave the head as it is")
        cls = type(head)
        if cls not in _head_classes:
            _head_classes[cls] = type(cls.__name__, (LossHead, cls), {"__module__": cls.__module__,
                                                                      "__doc__": cls.__doc__})
        head.__class__ = _head_classes[cls]
    if fp8 is not None:
        # ZeRO-3 leaves a partitioned weight empty; its full shape is ds_shape.
        check_fp8_head_shape("fuse_lm_head_loss", tuple(getattr(head.weight, "ds_shape", head.weight.shape)))


def hf_causal_lm_class(cls: type) -> type | None:
    """The supported transformers class in `cls`'s bases (FSDP2 and we subclass it)."""
    for base in cls.__mro__:
        if base.__name__ in SUPPORTED and base.__module__.startswith("transformers."):
            return base
    return None


def _fused_class(cls: type) -> type:
    if cls not in _fused_classes:
        # The same name: save_pretrained writes it into config.architectures.
        _fused_classes[cls] = type(cls.__name__, (cls,), {"forward": _fused_forward_of(cls.forward), _FUSED: True,
                                                          "__doc__": cls.__doc__})
    return _fused_classes[cls]


def _fused_forward_of(plain):
    """A forward with `plain`'s signature (functools.wraps: HF Trainer reads it to keep
    columns) that takes the fused loss when given labels. The positional names are read once
    here, not per call: inspect is slow, and torch.compile traces the call."""
    params = list(inspect.signature(plain).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    @functools.wraps(plain)
    def forward(self, *args, **kwargs):
        if len(args) > len(positional):
            return plain(self, *args, **kwargs)  # its own error
        named = {**dict(zip(positional, args)), **kwargs}
        if named.get("labels") is None:
            return plain(self, *args, **kwargs)
        return _fused_forward(self, named)

    return forward


def _fused_forward(self, named: dict):
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast

    return_dict = named.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    labels, logits_to_keep = named.pop("labels"), named.pop("logits_to_keep", 0)
    # As Hugging Face's forward: every other argument goes to the base model, and the loss
    # reads its own (num_items_in_batch, ignore_index, shift_labels) from the same kwargs.
    outputs = self.base_model(**named)
    hidden = _slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    ignore_index = named.get("ignore_index", IGNORE_INDEX)
    shift_labels = named.get("shift_labels")
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.numel() * hidden.shape[-1] != hidden.numel():
        raise ValueError(f"fuse_lm_head_loss: {shift_labels.numel()} labels for {hidden.numel() // hidden.shape[-1]} "
                         f"positions of hidden states (logits_to_keep={logits_to_keep!r} keeps fewer than labels "
                         "has)")
    head = loss_head(self.get_output_embeddings(), type(self).__name__)
    loss = head(hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1),
                num_items_in_batch=named.get("num_items_in_batch"), ignore_index=ignore_index,
                chunk_tokens=getattr(self, "_coat_head_loss_chunk_tokens", None),
                fp8=getattr(self, "_coat_head_loss_fp8", None))
    cls = CausalLMOutputWithCrossAttentions if hasattr(outputs, "cross_attentions") else CausalLMOutputWithPast
    fields = {f: getattr(outputs, f) for f in cls.__dataclass_fields__ if f not in ("loss", "logits")
              and hasattr(outputs, f)}
    out = cls(loss=loss, logits=None, **fields)
    return out if return_dict else out.to_tuple()


def _slice_logits_to_keep(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # transformers before it was factored out: the forwards' own slice
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden[:, keep, :]
    return slice_logits_to_keep(hidden, logits_to_keep)


def loss_head(head: nn.Module, name: str) -> nn.Module:
    """`head` (or FSDP1's wrapper of it) where it still computes the loss, else a clear refusal."""
    inner = head
    while not isinstance(inner, LossHead) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module  # FSDP1's FullyShardedDataParallel: its call reaches the head's
    if not isinstance(inner, LossHead):
        raise TypeError(f"fuse_lm_head_loss: {name}'s output embedding became {type(head).__name__} after "
                        "fuse_lm_head_loss; the fused loss is computed by the head it made, so leave the head "
                        "in place (convert_to_fp8_linear leaves it so by default)")
    return head
