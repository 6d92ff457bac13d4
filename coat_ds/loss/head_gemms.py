"""The three GEMMs of one chunk of the head's loss (linear_ce.py): the logits, and from their
gradient the chunk's grad_hidden rows and its share of grad_weight.

`HeadGemms` runs them in the compute dtype, as the head's own nn.Linear would. `Fp8HeadGemms`
runs them as an Fp8Linear layer does (linear/function.py), an option that is off by default:
the weight quantized once per forward (E4M3, per tensor, both layouts), each chunk's hidden
rows once (both layouts), and each chunk's logit gradient once (E5M2 by default: softmax minus
one-hot holds probabilities many decades below its max, which E5M2 keeps down to 2**-32 of the
max and E4M3 only to 2**-18). That gradient is quantized before its division by the loss's
denominator, which goes into the GEMMs' scale instead: divided first, every row's target
entry (1 - p) / N rounds alike, so early in training, with p near 0, each row's gradient
would be off by the same up to 12.5% (E5M2's 2 mantissa bits) in its pull toward the target
(measured on the test data: 21.6 dB divided first, 31.4 dB undivided)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import Fp8LinearConfig
from ..kernels.fp8 import get_format
from ..kernels.fp8_linear import linear_scale_exponent
from ..kernels.fp8_torch import pow2
from ..kernels.registry import get
from ..linear.function import fp8_mm

__all__ = ["HeadGemms", "Fp8HeadGemms"]


def _accumulate(grad_weight: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight (FP32) += grad.T @ h. On CUDA a 16-bit product accumulates into FP32 in the
    GEMM itself (`out_dtype`); elsewhere it is made in its own dtype, then added."""
    if grad.dtype == torch.float32:
        grad_weight.addmm_(grad.t(), h)
    elif grad.is_cuda:
        torch.addmm(grad_weight, grad.t(), h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += grad.t() @ h


class HeadGemms:
    """The chunk GEMMs in `dtype` (the weight cast once for every chunk). `scale`: 1 / the
    loss's denominator (one element), which the cross-entropy kernel folds into the logits'
    gradient (`ce_scale`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scale: torch.Tensor):
        self.w = weight.to(dtype)
        self.b = None if bias is None else bias.to(dtype)
        self.ce_scale = scale

    def logits(self, h: torch.Tensor, need_w: bool) -> torch.Tensor:
        return F.linear(h, self.w, self.b)

    def grads(self, grad: torch.Tensor, h: torch.Tensor, grad_hidden: torch.Tensor | None,
              grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None) -> None:
        """grad_hidden (these rows) = grad @ w; grad_weight += grad.T @ h; grad_bias += the
        column sums of grad (FP32 sums)."""
        if grad_hidden is not None and grad.dtype == grad_hidden.dtype:
            torch.mm(grad, self.w, out=grad_hidden)
        elif grad_hidden is not None:
            grad_hidden.copy_(grad @ self.w)
        if grad_weight is not None:
            _accumulate(grad_weight, grad, h)
        if grad_bias is not None:
            grad_bias += grad.sum(0, dtype=torch.float32)


class Fp8HeadGemms:
    """The chunk GEMMs in FP8 with `config`'s formats, backend and forward accumulation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scale: torch.Tensor,
                 config: Fp8LinearConfig, need_h: bool):
        self.f_in, self.f_w, self.f_g = (get_format(f) for f in (config.input_format, config.weight_format,
                                                                 config.grad_format))
        self.quantize = get("fp8_linear", weight.device, config.backend, "Fp8LinearConfig.backend").quantize
        self.wq, self.wq_t, ew = self.quantize(weight, self.f_w, True, need_h)
        self.sw = pow2(ew)
        self.dtype, self.fast_accum = dtype, config.fast_accum
        # cuBLASLt takes a bias only with a 16-bit output; otherwise it is added after.
        self.fused_bias = bias is not None and dtype in (torch.bfloat16, torch.float16)
        self.b = None if bias is None else bias.to(dtype)
        self._h = None  # this chunk's transposed codes and scale, for grad_weight
        if scale is not None:
            self.scale, self.ce_scale = scale.float(), torch.ones_like(scale)
            # |softmax - one_hot| <= 1: that bound sets the gradient's exponent once, with no
            # max pass per chunk; E5M2's range leaves nothing to gain from the exact max.
            self.eg = linear_scale_exponent(torch.ones((), device=weight.device), self.f_g)
            self.sg = pow2(self.eg) * self.scale
        self._dw_written = False  # grad_weight holds only zeros until the first chunk's GEMM writes it

    def logits(self, h: torch.Tensor, need_w: bool) -> torch.Tensor:
        hq, hq_t, eh = self.quantize(h, self.f_in, True, need_w)
        sh = pow2(eh)
        self._h = (hq_t, sh)
        y = fp8_mm(hq, self.f_in, sh, self.wq, self.f_w, self.sw, self.dtype,
                   self.b if self.fused_bias else None, self.fast_accum)
        return y if self.b is None or self.fused_bias else y + self.b

    def grads(self, grad: torch.Tensor, h: torch.Tensor, grad_hidden: torch.Tensor | None,
              grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None) -> None:
        gq, gq_t, _ = self.quantize(grad, self.f_g, grad_hidden is not None, grad_weight is not None, self.eg)
        sg = self.sg
        if grad_hidden is not None and grad_hidden.dtype == self.dtype:
            fp8_mm(gq, self.f_g, sg, self.wq_t, self.f_w, self.sw, self.dtype, out=grad_hidden)
        elif grad_hidden is not None:
            grad_hidden.copy_(fp8_mm(gq, self.f_g, sg, self.wq_t, self.f_w, self.sw, self.dtype))
        if grad_weight is not None:
            hq_t, sh = self._h
            if self._dw_written:
                grad_weight += fp8_mm(gq_t, self.f_g, sg, hq_t, self.f_in, sh, torch.float32)
            else:  # written in place: one read and write of the FP32 sum less
                fp8_mm(gq_t, self.f_g, sg, hq_t, self.f_in, sh, torch.float32, out=grad_weight)
                self._dw_written = True
        if grad_bias is not None:
            grad_bias += grad.sum(0, dtype=torch.float32) * self.scale
        self._h = None
