"""Cross-entropy of a linear head's logits, computed chunk by chunk so that the full logits
never exist.

An LM head turns N tokens into an N x vocab logits tensor; Hugging Face's loss then upcasts
it to FP32, and backward makes an FP32 gradient of the same shape: 2 + 4 + 4 bytes per token
per vocabulary entry, several GB at 16k tokens and a 32k vocabulary, all alive around the
start of backward. Here forward walks the tokens in chunks; for each chunk it makes the
logits (in the matmul's dtype: BF16 under autocast, as the head's own linear gives them; or
from FP8 GEMMs, an option: head_gemms.py),
computes the chunk's loss in FP32 as Hugging Face's ForCausalLMLoss does on its upcast,
and in the same pass turns the logits in place into their gradient (softmax - one_hot,
divided by the loss's denominator): one Triton kernel on a GPU, with no FP32 copy
(kernels/cross_entropy.py), or its torch twin. From that gradient the chunk's
share of grad_hidden (kept in hidden's dtype) and grad_weight (summed in FP32) are made at
once, and the chunk is dropped. Backward only scales the kept gradients by grad_output.
What is held from forward to backward is grad_hidden (N x hidden) and grad_weight
(vocab x hidden), instead of the logits and their FP32 copy.
"""
from __future__ import annotations

import torch

from ..config import _BACKENDS, Fp8LinearConfig
from ..kernels.fp8 import GEMM_ALIGN
from ..kernels.registry import get
from ..linear.layer import fp8_gemm_available
from .head_gemms import Fp8HeadGemms, HeadGemms

__all__ = ["linear_cross_entropy", "default_chunk_tokens", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_CHUNK_BYTES = 256 * 2**20  # one chunk's logits, as the loss holds them


def default_chunk_tokens(vocab_size: int, bytes_per_logit: int = 4) -> int:
    """Tokens per chunk so that a chunk's logits take about 256 MiB at `bytes_per_logit` (a
    multiple of 64 tokens where that is at least 64, which GEMMs like). The Triton path keeps
    16-bit logits (2 bytes); the torch twin and FP32 logits take 4. Fewer, larger chunks
    also mean fewer passes of the FP32 weight-gradient sum, one per chunk."""
    tokens = max(1, _CHUNK_BYTES // (bytes_per_logit * vocab_size))
    return tokens - tokens % 64 if tokens >= 64 else tokens


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) would give here: autocast's where it is on."""
    device = hidden.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.result_type(hidden, weight)


def _denominator(labels: torch.Tensor, num_items_in_batch, ignore_index: int) -> torch.Tensor:
    """What Hugging Face divides the loss sum by: num_items_in_batch where given (reduction
    "sum"), else the count of labelled tokens (reduction "mean"; 0 of them gives NaN, as there)."""
    if num_items_in_batch is None:
        return (labels != ignore_index).sum().float()
    return torch.as_tensor(num_items_in_batch, device=labels.device).float()


def check_fp8_head_shape(caller: str, shape: tuple[int, int]) -> None:
    """FP8 GEMMs take dims in multiples of GEMM_ALIGN, and the head's vocabulary is one of
    them in each of its three GEMMs; padding every chunk's logits would cost more than it saves."""
    if shape[0] % GEMM_ALIGN or shape[1] % GEMM_ALIGN:
        raise ValueError(f"{caller}: fp8 needs the head's vocabulary and hidden size in multiples of {GEMM_ALIGN} "
                         f"(FP8 GEMMs), got a weight of shape {shape}; pad the vocabulary (Hugging Face: "
                         f"model.resize_token_embeddings(n, pad_to_multiple_of={GEMM_ALIGN})) or leave fp8=None")


def _gemms(weight, bias, dtype, scale, fp8, need_h) -> HeadGemms | Fp8HeadGemms:
    """The chunks' GEMMs, with the weight cast or quantized once for all of them (autocast
    would cast it per chunk)."""
    if fp8 is None:
        return HeadGemms(weight, bias, dtype, scale)
    return Fp8HeadGemms(weight, bias, dtype, scale, fp8, need_h)


class LinearCrossEntropy(torch.autograd.Function):
    """sum over chunks of CE(hidden @ weight.T + bias, labels) / denominator; see the module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denominator, ignore_index, chunk_tokens, dtype, rows_ce, fp8):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            scale = denominator.reciprocal().reshape(1)
            gemms = _gemms(weight, bias, dtype, scale, fp8, need_h)
            grad_hidden = torch.empty_like(hidden) if need_h else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                h = hidden[rows].to(dtype)
                grad = gemms.logits(h, need_w)
                # grad: from here the logits' gradient
                total += rows_ce(grad, labels[rows], gemms.ce_scale, ignore_index).sum()
                gemms.grads(grad, h, grad_hidden[rows] if need_h else None, grad_weight, grad_bias)
        # Kept on ctx, not save_for_backward: they are gradients, not activations, so the
        # saved-tensor hooks of compress_activations must not quantize them.
        ctx.grads = (grad_hidden,
                     None if grad_weight is None else grad_weight.to(weight.dtype),
                     None if grad_bias is None else grad_bias.to(bias.dtype))
        return total / denominator

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice through the same forward; its "
                               "gradients were made in forward and handed out by the first backward")
        grads, ctx.grads = ctx.grads, None
        # In place: these tensors are ours alone, and a copy would double the weight's gradient.
        scaled = [None if g is None else g.mul_(grad_output.to(g.dtype)) for g in grads]
        return (*scaled, None, None, None, None, None, None, None)


def _loss_only(hidden, weight, bias, labels, denominator, ignore_index, chunk_tokens, dtype, rows_ce,
               fp8) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    gemms = _gemms(weight, bias, dtype, None, fp8, False)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        logits = gemms.logits(hidden[rows].to(dtype), False)
        total += rows_ce(logits, labels[rows], None, ignore_index).sum()
    return total / denominator


# Run eagerly under torch.compile (a graph break here): compiled, the chunk loop would be
# unrolled into one graph whose memory plan need not keep only one chunk alive at a time,
# which is the point of this function. The model's layers around it still compile.
@torch.compiler.disable
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, *, num_items_in_batch=None,
                         ignore_index: int = IGNORE_INDEX, chunk_tokens: int | None = None,
                         backend: str = "auto", fp8: Fp8LinearConfig | None = None) -> torch.Tensor:
    """Mean token cross-entropy of `hidden @ weight.T + bias` against `labels`, as Hugging Face's
    `fixed_cross_entropy` gives it on FP32-upcast logits, without ever holding more than
    `chunk_tokens` rows of logits (default: `default_chunk_tokens`, ~256 MiB of logits as the
    path holds them: 16-bit on the Triton path, FP32 on the twin's).

    hidden: (..., hidden_size); labels: hidden's leading shape, `ignore_index` for unlabelled
    tokens. With `num_items_in_batch` the loss is the sum divided by it, else the mean over
    labelled tokens (NaN when there are none, as in torch and Hugging Face). Under autocast
    the logits are made in autocast's dtype. Gradients are computed in forward; backward
    scales them. Runs eagerly under torch.compile (a graph break). `backend`: each chunk's
    loss and gradient by the Triton kernel ("triton"), its torch twin ("torch"), or "auto":
    Triton on CUDA, the twin elsewhere. `fp8`: the head's three GEMMs in FP8 with this
    config's formats, backend and forward accumulation, as an Fp8Linear's (head_gemms.py;
    needs FP8 GEMMs: CUDA 8.9+ or CPU); None (default): in the compute dtype."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"linear_cross_entropy: labels of shape {tuple(labels.shape)} do not match the "
                         f"{tuple(hidden.shape[:-1])} tokens of hidden {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight of shape {tuple(weight.shape)} does not take hidden "
                         f"states of size {hidden.shape[-1]}")
    if backend not in _BACKENDS:
        raise ValueError(f"linear_cross_entropy: backend must be one of {_BACKENDS}, got {backend!r}")
    if fp8 is not None and not isinstance(fp8, Fp8LinearConfig):
        raise TypeError(f"linear_cross_entropy: fp8 must be an Fp8LinearConfig or None, got {type(fp8).__name__}")
    if fp8 is not None and not fp8_gemm_available(hidden.device):
        raise RuntimeError(f"linear_cross_entropy: fp8 needs FP8 GEMMs, which {hidden.device} lacks (CUDA compute "
                           "capability 8.9+, or CPU); leave fp8=None there")
    if fp8 is not None:
        check_fp8_head_shape("linear_cross_entropy", tuple(weight.shape))
    ce = get("cross_entropy", hidden.device, backend, "linear_cross_entropy's backend")
    rows_ce = ce.rows
    dtype = _compute_dtype(hidden, weight)
    if chunk_tokens is None:
        kept = 4 if ce.fp32_copy else dtype.itemsize
        chunk_tokens = default_chunk_tokens(weight.shape[0], kept)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    hidden2d, labels1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    denominator = _denominator(labels1d, num_items_in_batch, ignore_index)
    args = (hidden2d, weight, bias, labels1d, denominator, ignore_index, chunk_tokens, dtype, rows_ce, fp8)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return LinearCrossEntropy.apply(*args) if needs_grad else _loss_only(*args)
