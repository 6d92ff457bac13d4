"""`fuse_lm_head_loss`: a causal LM's training loss without its full logits (linear_ce.py).

For Hugging Face *ForCausalLM models the model's class is swapped in place for a subclass
with the same name whose forward, when `labels` are given, runs the base model, shifts the
labels as Hugging Face does and takes the loss from `linear_cross_entropy`; without labels
it is the original forward. The module, its parameters, hooks and state_dict keys stay as
they were, so FSDP2 (which swaps classes the same way), hooks and checkpoints see no change.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._compat.deepspeed import zero3_partitioned
from ..config import Fp8LinearConfig
from .linear_ce import IGNORE_INDEX, check_fp8_head_shape, linear_cross_entropy

__all__ = ["fuse_lm_head_loss", "SUPPORTED"]

# Classes whose forward is exactly: base model -> slice_logits_to_keep -> lm_head -> ForCausalLM
# loss, checked in transformers 5.24. Others may scale or cap their logits (Gemma's softcapping,
# Cohere's logit_scale), which the fused loss would silently drop.
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
_FUSED = "_coat_fused_head_loss"  # marks our subclasses
_fused_classes: dict[type, type] = {}


def fuse_lm_head_loss(model: nn.Module, *, chunk_tokens: int | None = None,
                      fp8: Fp8LinearConfig | None = None) -> nn.Module:
    """Make `model`'s loss skip its full logits: the LM head's cross-entropy is computed in
    chunks of `chunk_tokens` tokens (default: ~256 MiB of logits per chunk, as the loss holds them), each chunk's
    gradient made at once (coat_ds.loss.linear_cross_entropy). Saves about
    vocab x (2 + 4 + 4) bytes per token under BF16 autocast (the logits, their FP32 upcast and
    its gradient); holds the head's input gradient and weight gradient from forward instead.

    `model`: a Hugging Face LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
    GPT2LMHeadModel (its class is swapped in place for a same-named subclass), or coat_ds's
    own `coat_ds.models.llama.Llama` (its `forward(idx, targets)` turns the option on).
    Called with `labels`, the Hugging Face model returns a CausalLMOutputWithPast (GPT-2: ...
    WithCrossAttentions) whose `loss` is the fused loss and whose `logits` is None; callers
    that need logits call it without `labels`, which runs the original forward. The loss is
    Hugging Face's ForCausalLMLoss: labels shifted left, `ignore_index` (-100) skipped, the
    mean over labelled tokens, or the sum over `num_items_in_batch` where passed (HF Trainer
    does with gradient accumulation). Tied embeddings work (one parameter, both gradients).

    Works eagerly, with compiled decoder layers (the loss itself runs eagerly: a graph break),
    FP8 linears (the head must stay nn.Linear, convert_to_fp8_linear's default), compressed
    activations, FSDP2 with fully_shard on the root (the head's weight is unsharded during the
    root's forward) and DeepSpeed ZeRO-1/2. Refused at the first forward with labels: DeepSpeed
    ZeRO-3 (the weight is partitioned outside the head's own call), a head sharded on its own
    (fully_shard(lm_head)), a head that is not a plain nn.Linear. Idempotent; returns `model`.

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
        if fp8 is not None:
            _check_fp8_head(model.head.weight)
        model.fused_head_loss, model.head_loss_chunk_tokens, model.head_loss_fp8 = True, chunk_tokens, fp8
        return model
    hf_class = _hf_class(type(model))
    if hf_class is None:
        raise TypeError(f"fuse_lm_head_loss: {type(model).__name__} is not supported; supported: "
                        f"{', '.join(SUPPORTED)} (Hugging Face) and coat_ds.models.llama.Llama")
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise TypeError(f"fuse_lm_head_loss: {type(model).__name__}'s output embedding is "
                        f"{type(head).__name__}, not nn.Linear; fuse before converting the head (e.g. "
                        "convert_to_fp8_linear with the head included) or leave the head as it is")
    if fp8 is not None:
        _check_fp8_head(head.weight)
    if model.base_model is model:
        raise TypeError(f"fuse_lm_head_loss: {type(model).__name__} has no base model under "
                        f"{model.base_model_prefix!r}")
    if not getattr(type(model), _FUSED, False):
        model.__class__ = _fused_class(type(model))
    setattr(model, "_coat_head_loss_chunk_tokens", chunk_tokens)
    setattr(model, "_coat_head_loss_fp8", fp8)
    return model


def _check_fp8_head(weight: torch.Tensor) -> None:
    # ZeRO-3 leaves a partitioned weight empty; its full shape is ds_shape.
    check_fp8_head_shape("fuse_lm_head_loss", tuple(getattr(weight, "ds_shape", weight.shape)))


def _hf_class(cls: type) -> type | None:
    """The supported transformers class in `cls`'s bases (FSDP2 and we subclass it)."""
    for base in cls.__mro__:
        if base.__name__ in SUPPORTED and base.__module__.startswith("transformers."):
            return base
    return None


def _fused_class(cls: type) -> type:
    if cls not in _fused_classes:
        # The same name: save_pretrained writes it into config.architectures.
        _fused_classes[cls] = type(cls.__name__, (cls,), {"forward": _forward, _FUSED: True,
                                                          "__doc__": cls.__doc__})
    return _fused_classes[cls]


def _named_arguments(fn, self, args, kwargs) -> dict:
    """`fn(self, *args, **kwargs)`'s arguments by name, its **kwargs spread among them."""
    sig = inspect.signature(fn)
    bound = sig.bind(self, *args, **kwargs).arguments
    spread = [name for name, p in sig.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD]
    named = {k: v for k, v in list(bound.items())[1:] if k not in spread}
    for name in spread:
        named.update(bound.get(name, {}))
    return named


def _forward(self, *args, **kwargs):
    plain = _hf_class(type(self)).forward
    named = _named_arguments(plain, self, args, kwargs)
    if named.get("labels") is None:
        return plain(self, *args, **kwargs)
    return _fused_forward(self, named)


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
    weight, bias = head_params(self.get_output_embeddings(), type(self).__name__)
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, shift_labels.reshape(-1), bias,
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


def head_params(head: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias as model `name`'s forward sees them, or a clear refusal."""
    if type(head) is not nn.Linear:
        raise TypeError(f"fuse_lm_head_loss: {name}'s output embedding became {type(head).__name__} after "
                        "fuse_lm_head_loss; the fused loss computes the head itself, so it must stay nn.Linear "
                        "(convert_to_fp8_linear leaves it so by default; FSDP1 must not wrap it on its own)")
    weight = head.weight
    if zero3_partitioned(weight):
        raise RuntimeError(f"fuse_lm_head_loss: {name}'s LM head weight is partitioned (DeepSpeed ZeRO-3 "
                           f"gathers it only inside the head's own call; shape {tuple(weight.shape)}); the fused "
                           "head loss does not support ZeRO-3: use ZeRO-1/2 or FSDP2, or leave it off")
    if isinstance(weight, DTensor):
        raise RuntimeError(f"fuse_lm_head_loss: {name}'s LM head weight is a sharded DTensor during forward: "
                           "the head was sharded on its own (fully_shard(lm_head)); fully_shard the root only "
                           "(its forward unshards the head) or leave the fused loss off")
    return weight, head.bias

