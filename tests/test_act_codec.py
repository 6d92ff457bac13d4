"""kernels/act_codec.py, the one FP8 codec of saved activations (eager hooks, compiled graphs,
the Triton kernels' twin): what it guarantees, its error bounds, and that Inductor's code
for it gives its codes."""
from __future__ import annotations

import pytest
import torch

from coat_ds.kernels.act_codec import (dequantize_groups, dequantize_tensor, num_groups, quantize_groups,
                                       quantize_tensor, scale_exponent)
from coat_ds.kernels.fp8 import get_format

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((64, 96), (64, 100), (3, 5, 7))


def _sample(shape, dtype, device, seed=0) -> torch.Tensor:
    """Fresh non-zero data over many decades, with every special case in its first groups."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)).to(dtype)
    flat = x.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -1e-30, 0.0, -0.0])
    flat[16:32] = 0  # an all-zero group
    flat[40], flat[41] = torch.finfo(dtype).max, -torch.finfo(dtype).max
    return x.to(device)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN, zeros with their sign."""
    a, b = a.float(), b.float()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32))


def _round_trips(x, f, dtype):
    """(groups' codes, exponents, values; the tensor's codes, exponent, values) of `x`."""
    codes, exps = quantize_groups(x, 16, f)
    tcodes, texp = quantize_tensor(x, f)
    return (codes, exps, dequantize_groups(codes, exps, 16, f, dtype), tcodes, texp,
            dequantize_tensor(tcodes, texp, f, dtype))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_guarantees(fmt, dtype, device):
    f = get_format(fmt)
    for shape in SHAPES:
        x = _sample(shape, dtype, device)
        codes, exps, back, tcodes, texp, tback = _round_trips(x, f, dtype)
        assert exps.shape == (num_groups(x.numel(), 16),) and exps.dtype == torch.int8
        assert texp.shape == () and texp.dtype == torch.int32
        for c, y in ((codes, back), (tcodes, tback)):
            assert c.shape == x.shape and c.dtype == torch.uint8 and y.dtype == dtype
            finite = torch.isfinite(x)
            assert _same(y[~finite], x[~finite]), "inf, -inf and NaN pass through exactly"
            assert torch.isfinite(y[finite]).all(), "a finite value never comes back non-finite"
            assert _same(y.view(-1)[3:6], torch.tensor([-0.0, 0.0, -0.0], dtype=dtype, device=device))
            assert (y.view(-1)[16:32] == 0).all()


@pytest.mark.parametrize("fmt,db,mant", [("e4m3", 30.0, 3), ("e5m2", 24.0, 2)])
def test_error_bounds(fmt, db, mant, device):
    # E4M3 keeps 3 mantissa bits: round-to-nearest error is uniform over +-1/2 step (step =
    # 2^-3 of the binade), ~31.5 dB on Gaussian data; E5M2 (2 bits) ~25.6. The bounds sit
    # 1.5 dB under that. Per element, on data spanning ~6 decades: a value within 2^12 of
    # its group's max is a normal FP8 number after scaling (the max lands at >= 0.8125 *
    # 2**E, E4M3's smallest normal is 2**-6), with at most half a step's error.
    f = get_format(fmt)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        gauss = (torch.randn(64, 250, generator=g) * 3.0).to(device)
        for y in _round_trips(gauss, f, torch.float32)[2::3]:
            err = (gauss - y).double().pow(2).sum()
            assert 10 * torch.log10(gauss.double().pow(2).sum() / err) > db
        x = (torch.randn(64, 250, generator=g) * torch.exp(2.0 * torch.randn(64, 250, generator=g))).to(device)
        y = _round_trips(x, f, torch.float32)[2]
        gmax = x.abs().reshape(-1, 16).amax(-1, keepdim=True).expand(-1, 16).reshape(x.shape)
        normal = x.abs() >= gmax / 4096
        assert normal.float().mean() > 0.9
        assert ((y - x).abs()[normal] / x.abs()[normal]).max() <= 2.0 ** -(mant + 1)


def test_groups_are_consecutive_elements_across_rows():
    # Rows of 10: the first group holds row 0 and the start of row 1, so a large value at
    # the start of row 1 sets the scale of row 0, whose small values then round to zero.
    f = get_format("e4m3")
    x = torch.full((3, 10), 1e-3)
    x[1, 0] = 1e3
    codes, exps = quantize_groups(x, 16, f)
    assert exps.shape == (2,)
    assert exps[0] == scale_exponent(torch.tensor(1e3).view(torch.int32), f)
    assert exps[1] == scale_exponent(torch.tensor(1e-3).view(torch.int32), f)
    back = dequantize_groups(codes, exps, 16, f)
    assert (back[0] == 0).all() and (back[1, 1:6] == 0).all()
    assert (back[1, 6:] > 0).all() and (back[2] > 0).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_no_finite_value_takes_the_top_code(fmt, device):
    # The top code stands for inf: a group's max must land below it, however it rounds.
    f = get_format(fmt)
    m = torch.arange(1 << 23, dtype=torch.int32, device=device)
    amax = ((127 << 23) | m).view(torch.float32)  # every float32 in [1, 2)
    e = scale_exponent(amax.view(torch.int32), f)
    y = amax * 2.0 ** -e.float()
    codes = y.to(f.dtype).view(torch.uint8)
    assert (codes < f.code_max).all() and (y >= 0.8125 * f.max / 1.75).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_code_decodes_by_the_rules(fmt):
    # The top code is +-inf, the codes above it NaN (E5M2's inf code, never written, as
    # the format's inf), every other code its value times 2**e.
    f = get_format(fmt)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    y = dequantize_tensor(codes, torch.tensor(-3, dtype=torch.int32), f)
    value = codes.view(f.dtype).float() * 2.0 ** -3
    mag = codes & 0x7F
    top = mag == f.code_max
    assert torch.equal(y[top], torch.tensor([float("inf"), float("-inf")]))
    assert _same(y[mag < f.code_max], value[mag < f.code_max])
    assert _same(y[mag > f.code_max], value[mag > f.code_max])  # NaN, or E5M2's +-inf


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inductor_gives_the_eager_values(fmt, dtype, device):
    # Inductor generates its own FP8 casts and reductions for the inlined pack and unpack.
    f = get_format(fmt)
    quant = torch.compile(lambda t: quantize_groups(t, 16, f), dynamic=False)
    dequant = torch.compile(lambda c, e: dequantize_groups(c, e, 16, f, dtype), dynamic=False)
    try:
        for shape in SHAPES:
            x = _sample(shape, dtype, device, seed=1)
            codes, exps = quantize_groups(x, 16, f)
            got_codes, got_exps = quant(x)
            assert torch.equal(got_exps, exps)
            # NaN's code is the cast's own (0x7F or 0xFF by backend); every other code agrees.
            nan = torch.isnan(x)
            assert torch.equal(got_codes[~nan], codes[~nan])
            assert _same(dequant(got_codes, got_exps), dequantize_groups(codes, exps, 16, f, dtype))
    finally:
        torch._dynamo.reset()
