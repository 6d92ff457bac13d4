"""Triton kernels against their pure-torch twins (interpreter on CPU, compiled on CUDA)."""
import copy

import pytest
import torch

from coat_ds.kernels import AdamWHyper, AdamWSlot, E4M3, E5M2, get, reference as R
from helpers import moments_like, sqnr_db

FORMATS = ["e4m3", "e5m2"]


@pytest.fixture
def tri(device):
    """The Triton kernels of an op for tensors on `device`."""
    return lambda op: get(op, device, "triton")


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_fp8_cast_bit_exact_on_every_code_and_midpoint(tri, device, fmt):
    vals = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    vals = vals[torch.isfinite(vals)]
    pos = vals[vals >= 0].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([vals, mids, -mids, torch.tensor([fmt.max * 1.5, -fmt.max * 3, 1e-12, -1e-12]),
                   torch.randn(2000) * fmt.max / 16]).to(device)
    codes, out = tri("cast_fp8").cast(x, fmt)
    rc, rout = R.cast_fp8(x, fmt)
    assert torch.equal(codes, rc)
    assert torch.equal(out, rout)
    assert torch.isfinite(out).all()


def _mixed_data(shape, group_size, seed):
    """Random data spanning decades, plus an all-zero group, a constant-magnitude group
    and a group with zeros inside; returns the data and the three groups' index tuples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2)
    x2 = x.view(-1, shape[-1])
    full = [(r, c) for r in range(x2.shape[0]) for c in range(0, x2.shape[1] - group_size + 1, group_size)]
    zero, const, holes = [(r, slice(c, c + group_size)) for r, c in full[:3]]
    x2[zero] = 0.0
    x2[const] = 0.37
    x2[const[0], const[1].start + 2] = -0.37
    x2[holes[0], holes[1].start:holes[1].start + 10] = 0.0
    return x, (zero, const, holes)


@pytest.mark.parametrize("shape", [(1000,), (3, 130), (5, 256), (2, 7, 300)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dre", [True, False])
@pytest.mark.parametrize("group_size", [16, 128])
def test_quantize_matches_reference(tri, device, shape, fmt, dre, group_size):
    x, (zero, const, holes) = _mixed_data(shape, group_size, seed=len(shape) * 7 + group_size)
    x = x.to(device)
    qt = tri("group_codec").quantize(x, group_size, fmt, dre)
    qr = R.quantize_groups(x.cpu(), group_size, fmt, dre)
    assert qt.codes.shape == x.shape and qt.center.shape == qr.center.shape
    # log2/exp2 differ in the last float bit between implementations; a code may move by one.
    same = (qt.codes.cpu() == qr.codes).float().mean().item()
    assert same >= 0.99, same
    assert (qt.kcode.cpu() == qr.kcode).float().mean().item() >= 0.95
    torch.testing.assert_close(qt.center.cpu(), qr.center, rtol=1e-5, atol=0)
    dt = tri("group_codec").dequantize(qt, group_size, fmt).cpu()
    dr = R.dequantize_groups(qr, group_size, fmt)
    xc = x.cpu()
    x2 = xc.view(-1, shape[-1])
    for d in (dt.view(-1, shape[-1]), dr.view(-1, shape[-1])):
        assert torch.isfinite(d).all()
        assert (d[zero] == 0).all(), "all-zero group must stay zero"
        assert torch.equal(d[const], x2[const]), "constant group must be exact"
        assert (d[x2 == 0] == 0).all(), "zeros inside a group must stay zero"
    # The two implementations land equally close to the input.
    assert abs(sqnr_db(xc, dt) - sqnr_db(xc, dr)) < 0.5


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_error_bounds(tri, device, fmt):
    """DRE bounds every element's relative error and never flushes a moment to zero; plain
    absmax scaling keeps the large values sharper (higher SQNR) but flushes small ones."""
    m, v = moments_like((64, 512), seed=7)
    for x in (m, v):
        d = tri("group_codec").dequantize(tri("group_codec").quantize(x.to(device), 128, fmt, True), 128, fmt).cpu()
        rel = ((d - x).abs() / x.abs())[x != 0]
        assert ((d == 0) & (x != 0)).sum() == 0
        assert rel.mean().item() < 0.05 and rel.max().item() < 0.35, (rel.mean(), rel.max())
        assert sqnr_db(x, d) >= 20.0
        plain = tri("group_codec").dequantize(tri("group_codec").quantize(x.to(device), 128, fmt, False), 128, fmt).cpu()
        assert sqnr_db(x, plain) >= 28.0
    plain_v = tri("group_codec").dequantize(tri("group_codec").quantize(v.to(device), 128, fmt, False), 128, fmt).cpu()
    assert ((plain_v == 0) & (v != 0)).sum() > 0


@pytest.mark.parametrize("shape", [(0, 130), (0,), (3, 0)])
def test_empty_tensors_round_trip(tri, device, shape):
    """FSDP hands some ranks an empty shard of a parameter."""
    x = torch.zeros(shape, device=device)
    for codec in (tri("group_codec"), get("group_codec", x.device, "torch")):
        q = codec.quantize(x, 128, "e4m3", True)
        assert q.codes.shape == x.shape and q.center.numel() == 0
        assert codec.dequantize(q, 128, "e4m3").shape == x.shape


def test_extreme_magnitudes_stay_finite(tri, device):
    x = torch.tensor([1e-38, 3e38, -1e-45, 1.0, 0.0, -2e30] * 30, device=device)
    for fmt in FORMATS:
        for dre in (True, False):
            d = tri("group_codec").dequantize(tri("group_codec").quantize(x, 16, fmt, dre), 16, fmt)
            assert torch.isfinite(d).all()
            assert (d[x == 0] == 0).all()
            assert (torch.sign(d) == torch.sign(x))[d != 0].all()


def _slots(shapes, pdt, gdt, quant, device, seed=0):
    torch.manual_seed(seed)
    out = []
    for i, sh in enumerate(shapes):
        p = torch.randn(sh).to(device, pdt)
        g = (torch.randn(sh) * 1e-2).to(device, gdt)
        g.view(-1)[:5] = 0.0
        m, v = moments_like(sh, seed + i, device)
        if quant:
            m = R.quantize_groups(m.cpu(), 128, "e4m3").to(device)
            v = R.quantize_groups(v.cpu(), 128, "e4m3").to(device)
        out.append(AdamWSlot(p, g, m, v))
    return out


SHAPES = [(300,), (3, 130), (5, 256), (1000,), (128,)]


@pytest.mark.parametrize("quant", [True, False])
@pytest.mark.parametrize("pdt,gdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.bfloat16, torch.bfloat16)])
def test_adamw_step_matches_reference(tri, device, quant, pdt, gdt):
    a = _slots(SHAPES, pdt, gdt, quant, device)
    b = copy.deepcopy(a)
    skipped_a = torch.zeros((), dtype=torch.int64, device=device)
    skipped_b = torch.zeros((), dtype=torch.int64, device=device)
    cache = {}
    ulp = 2.0 ** -8 if pdt == torch.bfloat16 else 2.0 ** -23
    h1 = AdamWHyper.at_step(1, 1e-3, 0.9, 0.999, 1e-8, 0.1)
    exact = []
    for y in b:  # the new FP32 moments, in float64 from the same dequantized inputs
        g = y.grad.double().cpu()
        m0, v0 = ((R.dequantize_groups(t.to("cpu")) if quant else t.cpu()).double()
                  for t in (y.exp_avg, y.exp_avg_sq))
        exact.append((0.9 * m0 + 0.1 * g, 0.999 * v0 + 0.001 * g * g))
    tri("adamw").step(a, h1, skipped=skipped_a, plan_cache=cache)
    R.adamw_step(b, h1, skipped=skipped_b)
    for x, y, ex in zip(a, b, exact):
        # From identical states one step agrees to rounding: the GPU's approximate
        # log2/exp2/rcp move an update (at most ~lr) by ~1e-6 of itself.
        diff = (x.param.float() - y.param.float()).abs()
        assert (diff <= 2 * ulp * y.param.float().abs() + 1e-8).all(), diff.max()
        if quant:
            # Each stored moment is a faithful FP8 quantization of the exact new moment (the
            # two may pick a different scale or exponent for a group at a boundary, so they
            # are compared with the truth rather than code by code).
            for mx, my, e in ((x.exp_avg, y.exp_avg, ex[0]), (x.exp_avg_sq, y.exp_avg_sq, ex[1])):
                for mom in (mx, my):
                    d = R.dequantize_groups(mom.to("cpu")).double()
                    rel = ((d - e).abs() / e.abs())[e != 0]
                    assert rel.mean().item() < 0.05 and rel.max().item() < 0.35, (rel.mean(), rel.max())
        else:
            torch.testing.assert_close(x.exp_avg, y.exp_avg, rtol=1e-5, atol=1e-9)
    for step in (2, 3):
        h = AdamWHyper.at_step(step, 1e-3, 0.9, 0.999, 1e-8, 0.1)
        tri("adamw").step(a, h, skipped=skipped_a, plan_cache=cache)
        R.adamw_step(b, h, skipped=skipped_b)
    assert skipped_a.item() == skipped_b.item() == 0
    for x, y in zip(a, b):
        # Where a stored code differs, later updates (each at most ~lr = 1e-3) differ by a
        # fraction of lr for that element.
        diff = (x.param.float() - y.param.float()).abs() - 2 * ulp * y.param.float().abs()
        assert diff.max().item() < 1e-3 and diff.clamp_min(0).mean().item() < 2e-5


def test_adamw_step_follows_gradients_that_move(tri, device):
    # New batches and zero_grad(set_to_none=True) give the gradients other addresses from
    # step to step: the plan keeps its program map and rebinds its address table.
    a = _slots(SHAPES, torch.float32, torch.float32, True, device)
    b = copy.deepcopy(a)
    cache = {}
    for step in (1, 2, 3):
        h = AdamWHyper.at_step(step, 1e-3, 0.9, 0.999, 1e-8, 0.1)
        grads = [torch.randn(s.param.shape, device=device) for s in a]
        a = [AdamWSlot(s.param, g.clone(), s.exp_avg, s.exp_avg_sq) for s, g in zip(a, grads)]
        b = [AdamWSlot(s.param, g.clone(), s.exp_avg, s.exp_avg_sq) for s, g in zip(b, grads)]
        tri("adamw").step(a, h, plan_cache=cache)
        R.adamw_step(b, h)
        (plan,) = cache.values()
        if step == 1:
            blocks = plan.blocks
        assert plan.blocks is blocks and plan.key[0][1] == a[0].grad.data_ptr()
    for x, y in zip(a, b):
        diff = (x.param - y.param).abs()
        assert diff.max().item() < 1e-3 and diff.mean().item() < 2e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e30])
def test_nonfinite_group_is_skipped_not_poisoned(device, backend, bad):
    ops = get("adamw", device, backend)
    slots = _slots([(3, 256)], torch.float32, torch.float32, True, device)
    before = copy.deepcopy(slots)
    slots[0].grad[1, 130] = bad  # row 1, second group (g*g overflows for 1e30)
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    ops.step(slots, AdamWHyper.at_step(1, 1e-3, 0.9, 0.999, 1e-8, 0.0), skipped=skipped)
    assert skipped.item() == 1
    s, b = slots[0], before[0]
    assert torch.equal(s.param[1, 128:], b.param[1, 128:])
    assert not torch.equal(s.param[1, :128], b.param[1, :128])
    for new, old in ((s.exp_avg, b.exp_avg), (s.exp_avg_sq, b.exp_avg_sq)):
        assert torch.equal(new.codes[1, 128:], old.codes[1, 128:])
        assert new.center[1, 1] == old.center[1, 1] and new.kcode[1, 1] == old.kcode[1, 1]
        assert torch.isfinite(new.center).all()
    assert torch.isfinite(s.param).all()
