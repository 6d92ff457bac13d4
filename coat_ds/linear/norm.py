"""`fuse_rms_norms`: a model's RMSNorm modules computed eagerly by one fused kernel, whose
output carries its max to the FP8 linear layers reading it.

Forward is one pass over the input (kernels/rms_norm.py): it writes the output, one
inverse RMS per row (all that backward keeps besides the input and the weight) and the
output's finite max |y|. That max is attached to the output for the layers reading it
(shared_input.offer_max): the first Fp8Linear among them (q_proj after input_layernorm,
gate_proj after post_attention_layernorm) quantizes it without a max pass of its own and
leaves the codes to its siblings. Backward is one kernel for dx and dweight's per-program
sums, plus a small sum. No consumer needs to be known: a layer that is not an Fp8Linear
never looks.

Under torch.compile the module runs its own torch code (Inductor fuses it already), so
the fusion is an eager speed-up only. Which order of roundings a module computes is
probed once, on CPU, when it is converted (see `_cast_first`), so the fused module's
output is that of the module it replaces: bit for bit on the torch twin, to one rounding
in the Triton kernels (their sum of squares is reduced in another order)."""
from __future__ import annotations

import copy
import logging
import warnings
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import Fp8LinearConfig
from ..kernels.registry import get_kept
from ..kernels.rms_norm import rms_norm_forward
from . import shared_input

__all__ = ["fuse_rms_norms"]

logger = logging.getLogger("coat_ds.linear")
_EPS_NAMES = ("variance_epsilon", "eps")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_CLASSES: dict[type, type] = {}


class _FusedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_nd, weight, eps, cast_first, kernels):
        x = x_nd if x_nd.is_contiguous() else x_nd.contiguous()
        ctx.backward_kernel = kernels.backward
        y, rstd, amax_bits = kernels.forward(x, weight, eps, cast_first)
        ctx.save_for_backward(x, weight, rstd)
        ctx.cast_first = cast_first
        ctx.mark_non_differentiable(amax_bits)
        return y, amax_bits

    @staticmethod
    def backward(ctx, dy, _amax_grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.backward_kernel(dy.contiguous(), x, weight, rstd, ctx.cast_first)
        return dx, dw, None, None, None


def _eps(eps: float | None) -> float:
    """torch.nn.RMSNorm's eps=None is FP32's epsilon for every input dtype we take (the
    opmath type's, measured on CPU, where its docs say the input's; the probe checks it)."""
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


def _fusable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernels take this input and weight (else the module's own code runs, and
    raises where the shapes do not fit)."""
    return (x.dtype in _FLOATS and w.dtype in _FLOATS and w.dim() == 1 and w.is_contiguous() and x.dim() > 0
            and x.shape[-1] == w.shape[0] and x.device == w.device and not isinstance(w, DTensor) and not isinstance(x, DTensor))


class _FusedRMSNorm(nn.Module):
    """Mixed in before an RMSNorm's own class (fuse_rms_norms); its forward falls back to
    the class's own wherever the fused one does not apply."""

    _fused_cast_first: bool
    _fused_eps_name: str
    fused_norm_backend: str

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        x = hidden_states
        if torch.compiler.is_compiling() or not _fusable(x, w):
            return super().forward(hidden_states)
        kernels = get_kept(self, "rms_norm", x.device, self.fused_norm_backend, "Fp8LinearConfig.backend")
        if x.shape[-1] > kernels.max_hidden:
            return super().forward(hidden_states)
        eps = _eps(getattr(self, self._fused_eps_name))
        y, amax_bits = _FusedRMSNormFunction.apply(x, w, eps, self._fused_cast_first, kernels)
        shared_input.offer_max(y, amax_bits)
        return y


def _candidate(m: nn.Module) -> str | None:
    """The name of `m`'s epsilon attribute where `m` looks like an RMSNorm over one dim."""
    if not type(m).__name__.endswith("RMSNorm"):
        return None
    w = m._parameters.get("weight")
    if w is None or w.dim() != 1:
        return None
    return next((name for name in _EPS_NAMES if hasattr(m, name)), None)


def _cast_first(m: nn.Module, eps_name: str) -> bool | None:
    """Which order of roundings `m`'s own forward computes: True for Hugging Face's
    LlamaRMSNorm (x * rstd rounded to x's dtype, then times the weight), False for
    torch.nn.RMSNorm's (x * rstd * weight rounded once), None for anything else (a
    GemmaRMSNorm's 1 + weight, an Idefics one): found by running it, bit for bit, on a
    random BF16 input with a random weight of each of BF16 and FP32 (the second tells the
    orders apart by output dtype too). Runs a CPU stand-in: the weight may be sharded, on
    a GPU or on the meta device."""
    gen = torch.Generator().manual_seed(0)
    hidden = m._parameters["weight"].shape[0]
    x = (torch.randn(16, hidden, generator=gen) * 3).to(torch.bfloat16)
    eps = _eps(getattr(m, eps_name))
    orders = {True, False}
    for w_dtype in (torch.bfloat16, torch.float32):
        stand_in = copy.copy(m)
        stand_in._parameters = {**m._parameters, "weight": nn.Parameter(
            torch.randn(hidden, generator=gen).to(w_dtype), requires_grad=False)}
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.nn.RMSNorm's note on mixed dtypes
                got = type(m).forward(stand_in, x)
        except Exception:  # a forward taking other arguments, or failing on CPU: not ours to fuse
            return None
        for order in list(orders):
            want = rms_norm_forward(x, stand_in.weight, eps, order)[0]
            if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)):
                orders.discard(order)
    return orders.pop() if len(orders) == 1 else None


def _fused_class(cls: type) -> type:
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (_FusedRMSNorm, cls), {"__module__": cls.__module__})
    return _FUSED_CLASSES[cls]


def fuse_rms_norms(model: nn.Module, *, config: Fp8LinearConfig | None = None,
                   module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> int:
    """Make the RMSNorm modules of `model` compute eagerly in one fused kernel, in place;
    returns how many are fused.

    Selected: modules whose class name ends in "RMSNorm" (Hugging Face's LlamaRMSNorm,
    MistralRMSNorm, Qwen2RMSNorm and the like; torch.nn.RMSNorm over one dim), with a 1-D
    `weight` and a `variance_epsilon` or `eps`, whose own forward computes one of the two
    RMSNorm orders (probed once on CPU; others, such as GemmaRMSNorm's 1 + weight, are left
    alone), and that `module_filter_fn(module, fqn)` accepts (default: all). Each keeps
    its identity, parameters, state_dict keys and hooks; its class is swapped.

    The fused forward also finds its output's max, so the Fp8Linear layers reading the
    output (after `convert_to_fp8_linear`) quantize it without a max pass of their own.
    Only `config.backend` is read: "triton" kernels, "torch" twins, or "auto" (Triton on
    CUDA, the twins elsewhere). Under torch.compile the modules run their own code. An
    eager speed-up only; off unless called."""
    config = config if config is not None else Fp8LinearConfig()
    if not isinstance(config, Fp8LinearConfig):
        raise TypeError(f"config must be an Fp8LinearConfig, got {type(config).__name__}")
    fused = skipped_filter = unknown = 0
    for fqn, m in list(model.named_modules()):
        if isinstance(m, _FusedRMSNorm):
            m.fused_norm_backend = config.backend
            fused += 1
            continue
        eps_name = _candidate(m)
        if eps_name is None:
            continue
        if module_filter_fn is not None and not module_filter_fn(m, fqn):
            skipped_filter += 1
            continue
        cast_first = _cast_first(m, eps_name)
        if cast_first is None:
            unknown += 1
            continue
        m.__class__ = _fused_class(type(m))
        m._fused_cast_first, m._fused_eps_name, m.fused_norm_backend = cast_first, eps_name, config.backend
        fused += 1
    logger.info("fuse_rms_norms: %d RMSNorm modules fused (backend %r), %d skipped by the filter, %d left "
                "unfused (their forward is neither RMSNorm order)", fused, config.backend, skipped_filter, unknown)
    return fused
