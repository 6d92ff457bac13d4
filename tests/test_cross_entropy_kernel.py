"""The head loss's row kernel (kernels/cross_entropy.py) against its torch twin
(reference.cross_entropy_rows) under Triton's interpreter, and linear_cross_entropy through
either of them; on a GPU, the compiled kernel and the FP32-accumulating weight gradient.

Bounds. Both compute in FP32 from the same logits; the kernel sums exponentials in another
order and rescales by a running max, so the loss (log of a sum of V terms) agrees to a few
FP32 ulp of the row's log-sum-exp: |dloss| <= 2**-20 * (|lse| + 1). The gradient's FP32
value agrees to ~2**-20 relative; rounded to BF16 or FP16 it may then round the other way
at a tie: within one rounding of its dtype, 2**-p |g| (p = 7 BF16, 10 FP16, 20 FP32), plus
2**-20 * scale absolute for values near zero."""
from __future__ import annotations

import math
import os

import pytest
import torch

from coat_ds.kernels import reference
from coat_ds.loss import linear_cross_entropy
from helpers import bound

_P = {torch.float32: 20, torch.bfloat16: 7, torch.float16: 10}


def _kernel():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    return bound("cross_entropy").TRITON.rows


def _logits(rows, vocab, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 8, rows)[:, None]
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::4] = -100
    return x.to(dtype).to(device), labels.to(device)


def _check(kernel, x, labels, scale):
    want_g, got_g = x.clone(), x.clone()
    want = reference.cross_entropy_rows(want_g, labels, scale, -100)
    got = kernel(got_g, labels, scale, -100)
    ignored = labels == -100
    assert got.dtype == torch.float32 and (got[ignored] == 0).all()
    lse = torch.logsumexp(x.float(), 1)
    assert ((got - want).abs() <= 2.0 ** -20 * (lse.abs() + 1)).all(), (got - want).abs().max()
    if scale is None:
        assert torch.equal(got_g, x)  # without a gradient the logits are left alone
        return
    p, s = _P[x.dtype], scale.item()
    err = (got_g.double() - want_g.double()).abs()
    assert (err <= 2.0 ** -p * want_g.double().abs() + 2.0 ** -20 * s).all(), err.max()
    assert (got_g[ignored] == 0).all() and torch.isfinite(got_g).all()
    # Each labelled row's gradient sums to ~0 (softmax sums to 1, minus the one-hot).
    assert (got_g[~ignored].double().sum(1).abs() <= 2.0 ** -p * s * x.shape[1] ** 0.5 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [37, 4096, 5000])  # under one block, exactly one, a ragged last block
def test_kernel_matches_twin(dtype, vocab):
    kernel = _kernel()
    x, labels = _logits(9, vocab, dtype)
    for scale in (None, torch.tensor([1 / 7.0])):
        _check(kernel, x, labels, scale)


def test_every_row_ignored_gives_zeros_even_with_an_infinite_scale():
    """A zero denominator (no labelled token) makes scale inf: the rows are still exactly 0."""
    kernel = _kernel()
    x, _ = _logits(5, 300, torch.bfloat16, seed=1)
    labels = torch.full((5,), -100)
    g = x.clone()
    loss = kernel(g, labels, torch.tensor([math.inf]), -100)
    assert (loss == 0).all() and (g == 0).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf - inf, interpreted
def test_non_finite_logits_give_a_non_finite_row_loss_as_the_twin():
    kernel = _kernel()
    x, labels = _logits(6, 300, torch.float32, seed=2)
    labels[:] = 3
    x[1, 10], x[4, 0] = float("inf"), float("nan")
    got = kernel(x.clone(), labels, None, -100)
    want = reference.cross_entropy_rows(x.clone(), labels, None, -100)
    assert torch.isfinite(got).equal(torch.isfinite(want)) and not torch.isfinite(got[[1, 4]]).any()
    assert torch.isfinite(got[[0, 2, 3, 5]]).all()


def test_a_label_out_of_range_gives_a_nan_row_loss_and_reads_nothing_out_of_bounds():
    kernel = _kernel()
    x, labels = _logits(4, 50, torch.float32, seed=6)
    labels[:] = torch.tensor([3, 50, -7, -100])
    g = x.clone()
    loss = kernel(g, labels, torch.tensor([0.5]), -100)
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0 and torch.isfinite(loss[0])
    assert torch.isfinite(g).all()
    with pytest.raises((IndexError, RuntimeError)):
        reference.cross_entropy_rows(x.clone(), labels, None, -100)


def test_bad_shapes_are_named():
    kernel = _kernel()
    x, labels = _logits(4, 50, torch.float32)
    with pytest.raises(ValueError, match="one label per row"):
        kernel(x, labels[:3], None, -100)
    with pytest.raises(ValueError, match="unit column stride"):
        kernel(x.t(), labels, None, -100)


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_cross_entropy_triton_matches_torch_backend(autocast):
    """The whole chunked loss through the kernel and through the twin: loss and every gradient."""
    _kernel()
    g = torch.Generator().manual_seed(3)
    h = torch.randn(70, 32, generator=g).requires_grad_()
    w = (torch.randn(300, 32, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, 300, (70,), generator=g)
    labels[::5] = -100
    out = {}
    for backend in ("triton", "torch"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(h, w, labels, chunk_tokens=32, backend=backend)
        out[backend] = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
    p = 7 if autocast else 20
    assert abs(out["triton"][0] - out["torch"][0]) <= 2.0 ** -20 * (out["torch"][0].abs() + 1)
    for got, want in zip(out["triton"][1:], out["torch"][1:]):
        assert (got - want).norm() <= 2.0 ** -p * want.norm() * 2, ((got - want).norm(), want.norm())


def test_backend_is_validated_and_named():
    h, w, labels = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(h, w, labels, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_twin_at_a_llama_vocabulary(dtype):
    rows = bound("cross_entropy").TRITON.rows
    x, labels = _logits(300, 32000, dtype, device="cuda")
    _check(rows, x, labels, None)
    _check(rows, x, labels, torch.tensor([1 / 225.0], device="cuda"))


@pytest.mark.gpu
def test_cuda_chunked_loss_accumulates_the_weight_gradient_in_fp32():
    """BF16 autocast on a GPU: the weight's gradient summed over 16 chunks in FP32 (addmm with
    out_dtype) is within BF16 rounding of one FP32 product of the whole BF16 gradient."""
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(4096, 256, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(3000, 256, device="cuda", generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, 3000, (4096,), device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, labels, chunk_tokens=256)
    gh, gw = torch.autograd.grad(loss, (h, w))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = h @ w.t()
    ref = torch.nn.functional.cross_entropy(logits.float(), labels)
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    for got, want in ((gh, rh), (gw, rw)):
        assert (got - want).norm() <= 2.0 ** -7 * want.norm(), ((got - want).norm(), want.norm())
