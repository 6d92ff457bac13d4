"""The fused C++ host AdamW step (kernels/host_adamw.cpp) against the torch reference.

The kernel runs the reference's float32 operations in the same order with the same log2,
exp2 (SLEEF) and sqrt (MKL where torch uses it), so FP32 moments and parameters match
bitwise and FP8 codes on all but a few elements: torch computes some exp2 of loop tails
with libm's scalar exp2, one ulp apart, which can move a code across a rounding boundary.
Stated tolerance (docs/deepspeed.md): >= 99.9 % identical codes (99 % of the per-group
exponents, 97 % of the centres within 2**-20 relative: a code that moved can change a
group's smallest element), dequantized
moments >= 40 dB SQNR against the reference's, parameters within 1 % of the step's update.
These identity fractions hold where torch runs AVX2/AVX-512 kernels (x86); elsewhere the
numeric bounds do. The library is built once per process (and cached on disk by torch).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import coat_ds
from coat_ds.kernels import AdamWHyper, AdamWSlot, group_layout, host, host_native
from coat_ds.kernels import reference as R

needs_kernel = pytest.mark.skipif(host_native.library() is None, reason="the host kernel did not build here")
# Where torch runs its SIMD kernels (x86 AVX2/AVX-512) the kernel uses the same vector
# functions; elsewhere (plain C++ build) only the numeric bounds are promised.
SAME_MATH = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _slot(shape, seed, quant, pdt, gdt, fm, fv):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: torch.randn(shape, generator=g)  # noqa: E731
    p = (rnd() * 0.02).to(pdt)
    m, v = rnd() * 1e-3, rnd().square() * 1e-6
    m.view(-1)[: 128 * 3] = 0  # with the zero gradient _run gives them: groups that stay zero
    v.view(-1)[: 128 * 3] = 0
    if quant:
        m, v = R.quantize_groups(m, fmt=fm), R.quantize_groups(v, fmt=fv)
    return AdamWSlot(p, torch.zeros(shape, dtype=gdt), m, v)


def _sqnr_db(ref, x):
    return (10 * torch.log10(ref.square().sum() / (ref - x).square().sum().clamp_min(1e-45))).item()


def _same(a, b):
    return (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).float().mean().item()


def _run(slot, steps, fn, fm, fv, dre, skipped, seed=2):
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        grad = (torch.randn(slot.param.shape, generator=g) * 1e-3).to(slot.grad.dtype)
        grad.view(-1)[: 128 * 3] = 0  # whole zero groups of gradient
        if step == 2:
            grad.view(-1)[1000] = float("nan")
            grad.view(-1)[-1] = float("inf")
        slot.grad.copy_(grad)
        fn([slot], AdamWHyper.at_step(step, 1e-3, 0.9, 0.999, 1e-8, 0.01), fmt_m=fm, fmt_v=fv, dre=dre,
           skipped=skipped)


# A flat partition with a short last group; rows whose length is no multiple of G; BF16
# gradient (and BF16 parameter); E5M2; without DRE; FP32 moments.
CASES = [((100_037,), True, torch.float32, torch.float32, "e4m3", "e4m3", True),
         ((300, 1000), True, torch.float32, torch.bfloat16, "e4m3", "e5m2", True),
         ((200, 130), True, torch.bfloat16, torch.bfloat16, "e5m2", "e5m2", True),
         ((50, 1000), True, torch.float32, torch.float32, "e4m3", "e4m3", False),
         ((20_000,), False, torch.float32, torch.bfloat16, "e4m3", "e4m3", True)]


@needs_kernel
@pytest.mark.parametrize("shape,quant,pdt,gdt,fm,fv,dre", CASES)
def test_kernel_matches_reference(shape, quant, pdt, gdt, fm, fv, dre):
    a = _slot(shape, 1, quant, pdt, gdt, fm, fv)
    b = copy.deepcopy(a)
    p0 = a.param.float().clone()
    sa, sb = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    _run(a, 3, R.adamw_step, fm, fv, dre, sa)
    _run(b, 3, host.adamw_step, fm, fv, dre, sb)
    assert sa.item() == sb.item() == 2  # the NaN and the inf group, skipped and counted
    update = (a.param.float() - p0).abs().max()
    assert (a.param.float() - b.param.float()).abs().max() <= 0.01 * update
    if SAME_MATH:
        assert _same(a.param, b.param) >= (1.0 if not quant else 0.99)  # FP32 moments: bitwise
    for ma, mb, f in ((a.exp_avg, b.exp_avg, fm), (a.exp_avg_sq, b.exp_avg_sq, fv)):
        if not quant:
            assert torch.equal(ma, mb) if SAME_MATH else _sqnr_db(ma, mb) >= 100
            continue
        if SAME_MATH:
            assert _same(ma.codes, mb.codes) >= 0.999
            assert _same(ma.kcode, mb.kcode) >= 0.99 and _same(ma.sexp, mb.sexp) >= 0.99  # per group: fewer
            # A group whose smallest element moved by one code takes another centre.
            assert ((ma.center - mb.center).abs() <= 2**-20 * ma.center.abs()).float().mean() >= 0.97
        da, db = R.dequantize_groups(ma, fmt=f), R.dequantize_groups(mb, fmt=f)
        assert torch.isfinite(db).all() and _sqnr_db(da, db) >= 40
        assert torch.count_nonzero(db.view(-1)[: 128 * 3]) == 0  # zero groups stay zero
        assert torch.count_nonzero(da.view(-1)[128 * 3:]) > 0.9 * da.numel()
    assert torch.isfinite(b.param.float()).all()


@needs_kernel
def test_threads_and_job_sizes_do_not_change_the_result():
    a = _slot((70_000,), 3, True, torch.float32, torch.float32, "e4m3", "e4m3")
    b = copy.deepcopy(a)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _run(a, 2, host.adamw_step, "e4m3", "e4m3", True, None)
        torch.set_num_threads(2)
        _run(b, 2, lambda *x, **k: host.adamw_step(*x, **k, chunk_elems=1024), "e4m3", "e4m3", True, None)
    finally:
        torch.set_num_threads(n)
    for x, y in zip([a.param, *a.exp_avg, *a.exp_avg_sq], [b.param, *b.exp_avg, *b.exp_avg_sq]):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@needs_kernel
def test_coat_adamw_on_cpu_runs_the_kernel_not_the_reference(monkeypatch):
    called = []
    monkeypatch.setattr(R, "adamw_step", lambda *a, **k: called.append(1))
    p = torch.nn.Parameter(torch.randn(40_000) * 0.02)
    opt = coat_ds.CoatAdamW([p], lr=1e-3)
    p0 = p.detach().clone()
    p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    assert not called and not torch.equal(p.detach(), p0)


def test_failed_build_logs_once_and_the_reference_runs(monkeypatch, caplog):
    def fail():
        raise OSError("no compiler")

    monkeypatch.setattr(host_native, "_build", fail)
    monkeypatch.setattr(host_native, "_lib", [None, False])
    a = _slot((5000,), 4, True, torch.float32, torch.float32, "e4m3", "e4m3")
    b = copy.deepcopy(a)
    with caplog.at_level(logging.WARNING, logger="coat_ds.kernels"):
        _run(a, 2, R.adamw_step, "e4m3", "e4m3", True, None)
        _run(b, 2, host.adamw_step, "e4m3", "e4m3", True, None)
    assert sum("did not build" in r.getMessage() for r in caplog.records) == 1
    for x, y in zip([a.param, *a.exp_avg, *a.exp_avg_sq], [b.param, *b.exp_avg, *b.exp_avg_sq]):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@needs_kernel
def test_kernel_takes_per_group_skip_counts(monkeypatch):
    """Groups that skipped steps before are bias-corrected at their own step count, and a
    group skipped now is counted in its entry, in the kernel as in the reference."""
    a = _slot((300, 1000), 1, True, torch.float32, torch.float32, "e4m3", "e4m3")
    gen = torch.Generator().manual_seed(5)
    a = a._replace(skips=torch.randint(0, 4, group_layout(a.param.shape, 128).meta_shape, dtype=torch.int32,
                                       generator=gen))
    b = copy.deepcopy(a)
    start = a.skips.clone()
    for step in range(5, 8):
        grad = torch.randn(a.param.shape, generator=gen) * 1e-3
        if step == 6:
            grad[7, 300] = float("nan")  # row 7, group 2
        a.grad.copy_(grad)
        b.grad.copy_(grad)
        hyper = AdamWHyper.at_step(step, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        R.adamw_step([a], hyper)
        with monkeypatch.context() as m:
            m.setattr(R, "adamw_step", lambda *args, **kw: pytest.fail("the reference ran, not the kernel"))
            host.adamw_step([b], hyper)
    assert torch.equal(a.skips, b.skips) and b.skips[7, 2] == start[7, 2] + 1
    update = (a.param - _slot((300, 1000), 1, True, torch.float32, torch.float32, "e4m3", "e4m3").param).abs().max()
    assert (a.param - b.param).abs().max() <= 0.01 * update
    if SAME_MATH:
        assert _same(a.param, b.param) >= 0.99
    da, db = R.dequantize_groups(a.exp_avg_sq), R.dequantize_groups(b.exp_avg_sq)
    assert _sqnr_db(da, db) >= 40
