"""Cross-entropy of a linear head's logits, computed chunk by chunk so that the full logits
never exist.

An LM head turns N tokens into an N x vocab logits tensor; Hugging Face's loss then upcasts
it to FP32, and backward makes an FP32 gradient of the same shape: 2 + 4 + 4 bytes per token
per vocabulary entry, several GB at 16k tokens and a 32k vocabulary, all alive around the
start of backward. Here forward walks the tokens in chunks; for each chunk it makes the
logits (in the matmul's dtype: BF16 under autocast, as the head's own linear gives them),
upcasts them to FP32 as Hugging Face's ForCausalLMLoss does, adds the chunk's loss and,
in the same pass, turns them in place into the chunk's gradient w.r.t. the logits
(softmax - one_hot, divided by the loss's denominator). From that gradient the chunk's
share of grad_hidden (kept in hidden's dtype) and grad_weight (summed in FP32) are made at
once, and the chunk is dropped. Backward only scales the kept gradients by grad_output.
What is held from forward to backward is grad_hidden (N x hidden) and grad_weight
(vocab x hidden), instead of the logits and their FP32 copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy", "default_chunk_tokens", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_CHUNK_FP32_BYTES = 256 * 2**20  # one chunk's FP32 logits


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that a chunk's FP32 logits take about 256 MiB (a multiple of 64
    tokens where that is at least 64, which GEMMs like)."""
    tokens = max(1, _CHUNK_FP32_BYTES // (4 * vocab_size))
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


class _Chunk:
    """One chunk's FP32 logits turned into its loss sum and, in place, its logits' gradient."""

    @staticmethod
    def loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                      with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = logits.float()  # a new FP32 tensor, or `logits` itself when they already are FP32
        valid = labels != ignore_index
        target = torch.where(valid, labels, 0).unsqueeze(1)
        picked = x.gather(1, target).squeeze(1)
        # max, exp and sum in place: no second chunk-sized temporary, as logsumexp would make.
        top = x.amax(1, keepdim=True)
        x.sub_(top).exp_()
        total = x.sum(1, keepdim=True)
        lse = (top + total.log()).squeeze(1)
        loss = torch.where(valid, lse - picked, 0.0).sum()
        if not with_grad:
            return loss, None
        x.mul_(scale / total)  # softmax over the denominator, in one pass
        x.scatter_add_(1, target, (valid * -scale).unsqueeze(1))
        # Zeroed last: unlabelled rows get exactly 0, whatever their logits or a zero denominator made.
        x.masked_fill_(~valid.unsqueeze(1), 0.0)
        return loss, x


class LinearCrossEntropy(torch.autograd.Function):
    """sum over chunks of CE(hidden @ weight.T + bias, labels) / denominator; see the module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denominator, ignore_index, chunk_tokens, dtype):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # one cast for every chunk (autocast would make it per chunk)
            b = None if bias is None else bias.to(dtype)
            scale = denominator.reciprocal()
            grad_hidden = torch.empty_like(hidden) if need_h else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                h = hidden[rows].to(dtype)
                loss, grad = _Chunk.loss_and_grad(F.linear(h, w, b), labels[rows], scale, ignore_index,
                                                  with_grad=need_h or need_w or need_b)
                total += loss
                if grad is None:
                    continue
                grad = grad.to(dtype)  # as the logits' FP32 upcast hands its gradient back
                if need_h:
                    grad_hidden[rows] = grad @ w
                if need_w:
                    if grad.dtype == torch.float32:
                        grad_weight.addmm_(grad.t(), h)
                    else:
                        grad_weight += grad.t() @ h
                if need_b:
                    grad_bias += grad.sum(0, dtype=torch.float32)
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
        return (*scaled, None, None, None, None, None)


def _loss_only(hidden, weight, bias, labels, denominator, ignore_index, chunk_tokens, dtype) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total += _Chunk.loss_and_grad(F.linear(hidden[rows].to(dtype), w, b), labels[rows], None, ignore_index,
                                      with_grad=False)[0]
    return total / denominator


# Run eagerly under torch.compile (a graph break here): compiled, the chunk loop would be
# unrolled into one graph whose memory plan need not keep only one chunk alive at a time,
# which is the point of this function. The model's layers around it still compile.
@torch.compiler.disable
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, *, num_items_in_batch=None,
                         ignore_index: int = IGNORE_INDEX, chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean token cross-entropy of `hidden @ weight.T + bias` against `labels`, as Hugging Face's
    `fixed_cross_entropy` gives it on FP32-upcast logits, without ever holding more than
    `chunk_tokens` rows of logits (default: `default_chunk_tokens(vocab)`, ~256 MiB of FP32).

    hidden: (..., hidden_size); labels: hidden's leading shape, `ignore_index` for unlabelled
    tokens. With `num_items_in_batch` the loss is the sum divided by it, else the mean over
    labelled tokens (NaN when there are none, as in torch and Hugging Face). Under autocast
    the logits are made in autocast's dtype. Gradients are computed in forward; backward
    scales them. Runs eagerly under torch.compile (a graph break)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"linear_cross_entropy: labels of shape {tuple(labels.shape)} do not match the "
                         f"{tuple(hidden.shape[:-1])} tokens of hidden {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight of shape {tuple(weight.shape)} does not take hidden "
                         f"states of size {hidden.shape[-1]}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    hidden2d, labels1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    denominator = _denominator(labels1d, num_items_in_batch, ignore_index)
    args = (hidden2d, weight, bias, labels1d, denominator, ignore_index, chunk_tokens,
            _compute_dtype(hidden, weight))
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return LinearCrossEntropy.apply(*args) if needs_grad else _loss_only(*args)
