"""The one kernel registry: `get(op, device, backend)`, an op's kernels for tensors on a device.

An op is one file of this package holding its Triton kernels and launchers, their pure-torch
twins, and the custom ops over them (`torch.ops.coat_ds.<name>`, custom_ops.py) where it
has some. Its kernels come as a named tuple, the same fields whatever the backend: the
file's `TRITON` launchers ("triton") or its `TORCH` twins ("torch"); "auto" takes Triton for
CUDA tensors where it runs and the twins elsewhere (CPU tensors reach Triton only through
"triton" under TRITON_INTERPRET=1). Choosing Triton compiles the file's kernels (jit.bind).

A caller resolves its kernels once (a layer per device, an optimizer bucket, the activation
hooks per device; `get_kept` for a module) and keeps them: a call is then the launcher or the
twin itself, with no lookup and no custom-op dispatch."""
from __future__ import annotations

import torch

from . import act_codec, adamw, cast_fp8, cross_entropy, fp8_linear, group_codec, rms_norm, swiglu
from .fp8 import use_triton
from .jit import bind

__all__ = ["get", "get_kept", "OPS"]

OPS = {m.__name__.rsplit(".", 1)[1]: m for m in (act_codec, adamw, cast_fp8, cross_entropy, fp8_linear, group_codec,
                                                 rms_norm, swiglu)}


def get(op: str, device: torch.device, backend: str = "auto", option: str = "backend"):
    """The kernels of `op` (a name in OPS) for tensors on `device`: "triton", "torch" or "auto"
    (see above). Raises where "triton" cannot run there, naming `option` (the setting that
    asked for it)."""
    module = OPS.get(op)
    if module is None:
        raise ValueError(f"unknown kernel op {op!r}; expected one of {tuple(OPS)}")
    if not use_triton(device, backend, option):
        return module.TORCH
    if not torch.compiler.is_compiling():  # compiled graphs reach Triton through the custom ops
        bind(module)
    return module.TRITON


_KEPT = "_coat_ds_kernels"


def get_kept(owner, op: str, device: torch.device, backend: str, option: str = "backend"):
    """`get`, kept on `owner` (a module that calls these kernels at every call) for the device
    and backend it was asked for last."""
    kept = owner.__dict__.get(_KEPT)
    if kept is None or kept[0] != device or kept[1] != backend:
        kept = owner.__dict__[_KEPT] = (device, backend, get(op, device, backend, option))
    return kept[2]
