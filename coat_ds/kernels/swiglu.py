"""SwiGLU's activation, h = silu(gate) * up, fused: one kernel forward, one backward (registry
op "swiglu"; eager only, so no custom op), and their torch twins: Hugging Face's eager ops
themselves (F.silu, then a multiply; silu's backward op), which round where the kernels do,
so the twins are bit-equal to Hugging Face's eager MLP on the same device.

Hugging Face's eager Llama MLP computes `act_fn(gate) * up` as two kernels forward (silu,
mul) and two backward (mul's, silu's), each reading and writing whole tensors of the
intermediate size. Here forward reads gate and up once, writes h, and folds max |h| over
its finite values into an int32 (as fp8_linear's max pass does, with `atomic_max`): the
max down_proj's per-tensor FP8 cast of h needs, so that cast skips its own read of h.
Backward reads dh, gate and up once and writes dgate and dup; h is not kept.

The math is in FP32, rounded where Hugging Face's eager kernels round, so that in BF16 the
result is theirs: silu(gate) is rounded to the input dtype before the product (the silu
kernel's output), and so is dh * up before silu's backward reads it (mul's backward's
output). silu(x) = x / (1 + exp(-x)) and its derivative
sigmoid(x) * (1 + x * (1 - sigmoid(x))) are torch's formulas. Compiled, Triton's exp is the
GPU's approximate one: an FP32 intermediate may then differ from torch's in its last bit.
Rounding to BF16 is done in integer operations (fp8_triton.round_to; round to nearest even):
Triton's interpreter truncates in its own cast (1 + 3 * 2**-9 -> 1.0), and the tests run there.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .fp8_linear import linear_finite_absmax
from .fp8_triton import finite_abs, round_to
from .jit import jit, launch

__all__ = ["swiglu_forward", "swiglu_backward", "swiglu_forward_triton", "swiglu_backward_triton",
           "SwiGLUKernels", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen


# ---- The torch twins ----------------------------------------------------------------------


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, with_max: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h = silu(gate) * up, silu rounded to gate's dtype first; with `with_max`, the int32
    bits of linear_finite_absmax(h) as a (1,) tensor, else None)."""
    h = (torch.nn.functional.silu(gate) * up).contiguous()
    amax = linear_finite_absmax(h).reshape(1).view(torch.int32) if with_max else None
    return h, amax


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup): dup = dh * silu(gate) (silu rounded to gate's dtype), dgate = silu's
    derivative at gate times dh * up (rounded to gate's dtype)."""
    dup = dh * torch.nn.functional.silu(gate)
    dgate = torch.ops.aten.silu_backward(dh * up, gate)
    return dgate, dup


# ---- The Triton kernels -------------------------------------------------------------------

# Elementwise: 4096 elements per program, 16 per thread at 8 warps; few program instances
# under the interpreter (its cost is per instance). Not yet tuned on a GPU.
_BLOCK = 4096
_NUM_WARPS = 8


@jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, amax_bits_ptr, n, BLOCK: tl.constexpr, MAX: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    s = round_to(g / (1.0 + tl.exp(-g)), dtype)
    h = round_to(s * u, dtype)
    tl.store(h_ptr + offs, h.to(dtype), mask=mask)
    if MAX:
        # The max of the stored values, which down_proj's cast scales; masked lanes are 0.
        a = finite_abs(h)
        tl.atomic_max(amax_bits_ptr, tl.max(a, axis=0).to(tl.int32, bitcast=True))


@jit
def _swiglu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = dg_ptr.dtype.element_ty
    one_plus = 1.0 + tl.exp(-g)
    s = round_to(g / one_plus, dtype)
    sig = 1.0 / one_plus
    ds = round_to(dh * u, dtype)
    tl.store(du_ptr + offs, round_to(dh * s, dtype).to(dtype), mask=mask)
    tl.store(dg_ptr + offs, round_to(ds * sig * (1.0 + g * (1.0 - sig)), dtype).to(dtype), mask=mask)


def _check(name: str, *ts: torch.Tensor) -> None:
    first = ts[0]
    for t in ts[1:]:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{name} takes tensors of one shape, dtype and device, got "
                             f"{[(tuple(x.shape), x.dtype, str(x.device)) for x in ts]}")


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor, with_max: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h = silu(gate) * up in gate's dtype and shape, contiguous; with `with_max`, max |h|
    over its finite values as the int32 bits of a float32, shape (1,): what
    linear_quantize's `amax` takes; else None). See swiglu_forward, the twin."""
    _check("swiglu_forward", gate, up)
    g, u = gate.contiguous(), up.contiguous()
    h = torch.empty_like(g)
    amax = torch.zeros(1, dtype=torch.int32, device=g.device) if with_max else None
    n = g.numel()
    if n:
        launch(_swiglu_fwd_kernel, triton.cdiv(n, _BLOCK), (g, u, h, amax if with_max else h, n),
               (_BLOCK, with_max), _NUM_WARPS)
    return h, amax


def swiglu_backward_triton(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of h = silu(gate) * up given dh, in gate's dtype and shape. See
    swiglu_backward, the twin."""
    _check("swiglu_backward", dh, gate, up)
    dh, g, u = dh.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        launch(_swiglu_bwd_kernel, triton.cdiv(n, _BLOCK), (dh, g, u, dg, du, n), (_BLOCK,), _NUM_WARPS)
    return dg, du


class SwiGLUKernels(NamedTuple):
    """`forward(gate, up, with_max) -> (h, amax_bits | None)`, `backward(dh, gate, up) ->
    (dgate, dup)`."""

    forward: Callable
    backward: Callable


TORCH = SwiGLUKernels(swiglu_forward, swiglu_backward)
TRITON = SwiGLUKernels(swiglu_forward_triton, swiglu_backward_triton)
