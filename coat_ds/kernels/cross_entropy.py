"""Cross-entropy of a block of logit rows and, in place, their gradient: one kernel (registry
op "cross_entropy"; the GPU path of loss/linear_ce.py, which runs eagerly, so no custom op),
and its torch twin.

Hugging Face's loss upcasts the logits to FP32 and runs log-softmax, then backward makes an
FP32 gradient: about ten passes over a rows x vocab tensor, and an FP32 copy of it. Here one
program takes one row: a first pass finds its max and sum of exponentials together (the
running max rescales the running sum), a second writes (softmax - one_hot) / denominator over
the logits themselves, in their dtype. Two reads and one write of the BF16 logits, no FP32
copy. The math is FP32 as Hugging Face's upcast makes it; the gradient is rounded to the
logits' dtype as the upcast hands its gradient back. Only the sum's order and exp's rounding
differ from the twin.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .fp8_triton import round_to
from .jit import jit, launch

__all__ = ["cross_entropy_rows", "cross_entropy_rows_triton", "CrossEntropyKernels", "TORCH", "TRITON"]

triton = tl = None  # jit.bind sets them when a Triton backend is chosen


# ---- The torch twin -----------------------------------------------------------------------


def cross_entropy_rows(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None,
                       ignore_index: int) -> torch.Tensor:
    """Per-row FP32 cross-entropy of `logits` (rows x vocab) against `labels` (`ignore_index`:
    0), on the logits upcast to FP32 as Hugging Face's loss upcasts them. With `scale` (1 /
    the loss's denominator) the logits are overwritten with the gradient of sum(loss) * scale
    (softmax - one_hot, times scale; 0 in unlabelled rows), rounded to their dtype. FP32
    logits are the scratch space, with or without `scale`."""
    x = logits.float()  # a new FP32 tensor, or `logits` itself when they already are FP32
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0).unsqueeze(1)
    picked = x.gather(1, target).squeeze(1)
    # max, exp and sum in place: no second rows x vocab temporary, as logsumexp would make.
    top = x.amax(1, keepdim=True)
    x.sub_(top).exp_()
    total = x.sum(1, keepdim=True)
    loss = torch.where(valid, (top + total.log()).squeeze(1) - picked, 0.0)
    if scale is not None:
        x.mul_(scale / total)  # softmax over the denominator, in one pass
        x.scatter_add_(1, target, (valid * -scale).unsqueeze(1))
        # Zeroed last: unlabelled rows get exactly 0, whatever their logits or a zero denominator made.
        x.masked_fill_(~valid.unsqueeze(1), 0.0)
        if x is not logits:
            logits.copy_(x)
    return loss


# ---- The Triton kernel --------------------------------------------------------------------

# 4096 lanes per pass: a 32000-entry row in 8 blocks, 16 elements a thread at 8 warps.
_BLOCK = 4096
_NUM_WARPS = 8


@jit
def _cross_entropy_kernel(logits_ptr, labels_ptr, loss_ptr, scale_ptr, V, stride, ignore_index,
                          BLOCK: tl.constexpr, GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    # A label outside [0, V) reads nothing: its row's loss is NaN, which the caller's
    # non-finite handling sees (torch's cross_entropy raises a device-side assert instead).
    in_range = (label >= 0) & (label < V)
    top = float("-inf")
    total = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
        top = new_top
    lse = top + tl.log(total)
    picked = tl.load(base + tl.where(valid & in_range, label, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - picked, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if GRAD:
        # Unlabelled rows get exactly 0, whatever their logits or a zero denominator give.
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        dtype = logits_ptr.dtype.element_ty
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * scale - tl.where(cols == label, scale, 0.0)
            tl.store(base + cols, round_to(g, dtype).to(dtype), mask=cols < V)


def cross_entropy_rows_triton(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None,
                              ignore_index: int) -> torch.Tensor:
    """Per-row cross-entropy of `logits` (rows x vocab, FP32/BF16/FP16, unit column stride)
    against `labels` (int, rows; `ignore_index`: 0 loss), as FP32. With `scale` (a
    one-element FP32 tensor: 1 / the loss's denominator) the logits are overwritten with the
    gradient of sum(loss) * scale w.r.t. them. A label outside [0, vocab) that is not
    `ignore_index` gives its row a NaN loss (no read out of bounds); the twin raises there.
    See cross_entropy_rows, the twin."""
    if logits.dim() != 2 or logits.stride(1) != 1 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_rows takes rows x vocab logits with unit column stride and one label "
                         f"per row, got logits {tuple(logits.shape)} (strides {logits.stride()}) and labels "
                         f"{tuple(labels.shape)}")
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        grad = scale is not None
        launch(_cross_entropy_kernel, rows,
               (logits, labels.contiguous(), loss, scale if grad else loss, vocab, logits.stride(0), ignore_index),
               (_BLOCK, grad), _NUM_WARPS)
    return loss


class CrossEntropyKernels(NamedTuple):
    """`rows(logits, labels, scale, ignore_index) -> per-row loss`, the gradient written over
    the logits where `scale` is given; `fp32_copy`: whether it works in an FP32 copy of
    16-bit logits (the twin does)."""

    rows: Callable
    fp32_copy: bool


TORCH = CrossEntropyKernels(cross_entropy_rows, True)
TRITON = CrossEntropyKernels(cross_entropy_rows_triton, False)
