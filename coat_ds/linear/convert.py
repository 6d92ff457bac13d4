"""`convert_to_fp8_linear`: turn chosen nn.Linear modules of a model into Fp8Linear, in place."""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from ..config import Fp8LinearConfig
from ..kernels.fp8 import GEMM_ALIGN
from .layer import Fp8Linear, compute_device, fp8_gemm_available

__all__ = ["convert_to_fp8_linear"]

logger = logging.getLogger("coat_ds.linear")
_HEAD_NAMES = ("lm_head", "output", "head")
_FSDP_CLASSES: dict[type, type] = {}


def _fp8_class(m: nn.Module) -> type | None:
    """The class `m` becomes, or None where it is not a plain nn.Linear.

    The module keeps its identity (its class is swapped): FSDP2, ZeRO-3 and hooks hold the
    module and set its parameters by name, so a new module would never see them. A linear
    already given to FSDP2's fully_shard has a class FSDP made for it; the converted one gets
    the same mix-in over Fp8Linear."""
    cls = type(m)
    if cls is nn.Linear:
        return Fp8Linear
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    if issubclass(cls, FSDPModule) and cls.__bases__ == (FSDPModule, nn.Linear):
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{Fp8Linear.__name__}", (FSDPModule, Fp8Linear), {})
        return _FSDP_CLASSES[cls]
    return None


def _default_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep(m: nn.Module, fqn: str) -> bool:
        return m is not head and fqn.rsplit(".", 1)[-1] not in _HEAD_NAMES

    return keep


def _describe_path(model: nn.Module, config: Fp8LinearConfig) -> tuple[int, str]:
    """(log level, what the parameters' device computes): a fallback is a warning, so that
    nobody takes the memory-only path for the fast one."""
    dev = compute_device(model)
    if config.fp8_gemm == "off" or (config.fp8_gemm == "auto" and not fp8_gemm_available(dev)):
        why = "fp8_gemm='off'" if config.fp8_gemm == "off" else f"{dev} has no FP8 GEMMs (needs CUDA capability 8.9+)"
        return logging.WARNING, (f"{why}: GEMMs run in the input's precision; the input is still saved in FP8 "
                                 f"({config.input_format})")
    return logging.INFO, (f"GEMMs in FP8 on {dev} (torch._scaled_mm; input/weight "
                          f"{config.input_format}/{config.weight_format}, output gradient {config.grad_format})")


def convert_to_fp8_linear(model: nn.Module, *, config: Fp8LinearConfig | None = None,
                          module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Make the selected nn.Linear modules of `model` Fp8Linear, in place; returns `model`.

    Selected: plain nn.Linear modules (also after FSDP2's fully_shard) whose in and out
    features are multiples of 16 (FP8 GEMMs need it) and that `module_filter_fn(module, fqn)`
    accepts; the default filter skips the output head (`get_output_embeddings()`, or a
    module named lm_head/output/head). Parameters, state_dict keys and hooks are unchanged;
    each converted layer gains a non-persistent buffer (Fp8Linear's weight guess).
    Logs how many layers it converted and which compute path the parameters' device takes
    (INFO; WARNING for the path without FP8 GEMMs). The path is chosen per call from the
    input's device: a model moved later follows."""
    config = config if config is not None else Fp8LinearConfig()
    if not isinstance(config, Fp8LinearConfig):
        raise TypeError(f"config must be an Fp8LinearConfig, got {type(config).__name__}")
    chosen = module_filter_fn if module_filter_fn is not None else _default_filter(model)
    converted = skipped_dims = skipped_filter = 0
    for fqn, m in list(model.named_modules()):
        if isinstance(m, Fp8Linear):
            # Converted before: the filter chooses again, so calls with different configs and
            # disjoint filters configure disjoint layers.
            if not chosen(m, fqn):
                skipped_filter += 1
                continue
            m.fp8_config = config
            m._weight_guess(m.weight)
            converted += 1
            continue
        cls = _fp8_class(m)
        if cls is None:
            continue
        if m.in_features % GEMM_ALIGN or m.out_features % GEMM_ALIGN:
            skipped_dims += 1
            continue
        if not chosen(m, fqn):
            skipped_filter += 1
            continue
        m.__class__ = cls
        m.fp8_config = config
        m._weight_guess(m.weight)  # a buffer from the start, so that Module.to and engines move it
        converted += 1
    level, path = _describe_path(model, config)
    logger.log(level, "convert_to_fp8_linear: %d nn.Linear converted, %d skipped (dims not multiples of %d), "
               "%d skipped by the filter; %s", converted, skipped_dims, GEMM_ALIGN, skipped_filter, path)
    return model
