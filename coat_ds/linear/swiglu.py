"""`fuse_swiglu`: Hugging Face SwiGLU MLPs compute silu(gate) * up in one kernel, in place.

A Llama-style MLP is down_proj(act_fn(gate_proj(x)) * up_proj(x)) with act_fn SiLU. Eagerly
that is a silu kernel and a multiply forward and their two backward kernels, each over
tensors of the intermediate size, and then down_proj's FP8 cast reads the product again
for its max. Fused (kernels/swiglu.py): one kernel writes h = silu(gate) * up and folds
h's finite max; where down_proj is an Fp8Linear, that max is attached to h for it
(shared_input.offer_max, as a fused RMSNorm attaches its own), so its cast reads no max of
its own. Backward is one kernel from dh, gate and up (the two tensors saved; h is not).

Compiled, the module runs Hugging Face's ops: Inductor fuses them itself, max included.
Without Triton (CPU) the kernels' torch twins run: the same results as Hugging Face's ops,
bit for bit, so nothing is gained there but nothing changes either."""
from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Callable

import torch
from torch import nn

from ..config import Fp8LinearConfig
from ..kernels.registry import get, get_kept
from . import shared_input
from .layer import Fp8Linear

__all__ = ["fuse_swiglu", "swiglu"]

logger = logging.getLogger("coat_ds.linear")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, kernels, with_max):
        ctx.backward_kernel = kernels.backward
        h, amax_bits = kernels.forward(gate, up, with_max)
        ctx.save_for_backward(gate, up)
        if amax_bits is not None:
            ctx.mark_non_differentiable(amax_bits)
        return h, amax_bits

    @staticmethod
    def backward(ctx, dh, _):
        gate, up = ctx.saved_tensors
        dgate, dup = ctx.backward_kernel(dh, gate, up)
        return dgate, dup, None, None


def _fusable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _DTYPES
            and gate.device == up.device and gate.device.type in ("cuda", "cpu"))


def swiglu(gate: torch.Tensor, up: torch.Tensor, down: nn.Module | None = None, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up, rounded as Hugging Face's eager ops round it, in one kernel forward and
    one backward (kernels/swiglu.py; `backend`, or down's own where `down` is an Fp8Linear:
    "triton", "torch" twins or "auto"). Where `down`, the layer that reads the result, is an
    Fp8Linear, the max the kernel folded is offered to it: its FP8 cast of h then reads no
    max of its own. Compiling, or for inputs the kernels do not take (shapes or dtypes that
    differ, other dtypes or devices), plain torch ops."""
    return _swiglu(gate, up, down, backend, None)


def _swiglu(gate, up, down, backend, owner: nn.Module | None) -> torch.Tensor:
    """`swiglu`, its kernels kept on `owner` where one calls it at every call (get_kept)."""
    if torch.compiler.is_compiling() or not _fusable(gate, up):
        return nn.functional.silu(gate) * up
    fp8_down = isinstance(down, Fp8Linear)
    if fp8_down:
        backend = down.fp8_config.backend
    if owner is None:
        kernels = get("swiglu", gate.device, backend, "Fp8LinearConfig.backend")
    else:
        kernels = get_kept(owner, "swiglu", gate.device, backend, "Fp8LinearConfig.backend")
    h, amax_bits = _SwiGLUFunction.apply(gate, up, kernels, fp8_down)
    if fp8_down:
        shared_input.offer_max(h, amax_bits)
    return h


def _fused_forward(self, x):
    if torch.compiler.is_compiling():
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    down = self.down_proj
    return down(_swiglu(self.gate_proj(x), self.up_proj(x), down, self.swiglu_config.backend, self))


_FUSED: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """A subclass of `cls` whose forward is the fused one: the module keeps its identity (its
    class is swapped, as convert_to_fp8_linear does), and isinstance checks of it still hold."""
    if cls not in _FUSED:
        _FUSED[cls] = type(f"SwiGLU{cls.__name__}", (cls,), {"forward": _fused_forward})
    return _FUSED[cls]


def _is_silu(act: nn.Module) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    # transformers maps "silu" to its own SiLUActivation (F.silu); only where it is loaded.
    hf = sys.modules.get("transformers.activations")
    return hf is not None and type(act) is getattr(hf, "SiLUActivation", None)


def _refusal(m: nn.Module) -> str | None:
    """Why the gated MLP `m` (it has gate_proj, up_proj and down_proj) is not fused, or None."""
    act = getattr(m, "act_fn", None)
    if not isinstance(act, nn.Module) or not _is_silu(act):
        return f"act_fn is {type(act).__name__}, not SiLU"
    if not all(isinstance(getattr(m, name), nn.Linear) for name in _PARTS[:3]):
        return "gate_proj, up_proj or down_proj is not an nn.Linear"
    extra = sorted(set(dict(m.named_children())) - set(_PARTS))
    if extra or next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None:
        # Its forward may do more than down_proj(act_fn(gate_proj(x)) * up_proj(x)).
        return f"it holds more than {', '.join(_PARTS)}" + (f" ({', '.join(extra)})" if extra else "")
    return None


def fuse_swiglu(model: nn.Module, *, config: Fp8LinearConfig | None = None,
                module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> int:
    """Make the SwiGLU MLPs of `model` compute silu(gate) * up in one kernel, in place; returns
    how many modules are fused (those fused before included).

    Fused: modules with gate_proj, up_proj and down_proj (nn.Linear, Fp8Linear included), an
    act_fn that is SiLU (nn.SiLU or transformers' SiLUActivation) and nothing else, whose
    forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) as Hugging Face's LlamaMLP,
    MistralMLP and Qwen2MLP are, and that `module_filter_fn(module, fqn)` accepts (default:
    all). Others with those three layers are left as they are, and the log says why. The
    module keeps its identity, parameters, hooks and state_dict keys; its class becomes a
    subclass of its own. `config` (default Fp8LinearConfig()) gives the kernels' `backend`
    where down_proj is not an Fp8Linear; where it is, down_proj's own. Eager only:
    compiled, the original ops run."""
    config = config if config is not None else Fp8LinearConfig()
    if not isinstance(config, Fp8LinearConfig):
        raise TypeError(f"config must be an Fp8LinearConfig, got {type(config).__name__}")
    fused = skipped_filter = 0
    refused: Counter = Counter()
    for fqn, m in list(model.named_modules()):
        if not all(hasattr(m, name) for name in _PARTS[:3]):
            continue
        if type(m).forward is _fused_forward:  # fused before (and maybe given to FSDP2 since)
            m.swiglu_config = config
            fused += 1
            continue
        why = _refusal(m)
        if why is not None:
            refused[(type(m).__name__, why)] += 1
            continue
        if module_filter_fn is not None and not module_filter_fn(m, fqn):
            skipped_filter += 1
            continue
        m.__class__ = _fused_class(type(m))
        m.swiglu_config = config
        fused += 1
    logger.info("fuse_swiglu: %d SwiGLU MLP(s) fused, %d skipped by the filter, %d left as they are", fused,
                skipped_filter, sum(refused.values()))
    for (name, why), n in sorted(refused.items()):
        logger.info("fuse_swiglu: %d %s left as they are: %s", n, name, why)
    return fused
