"""kernels/graph_codec.py, the compiled path's per-group FP8 codec: what it guarantees,
that Inductor's code for it gives the eager codes, and that its values are the eager
codec's (kernels/reference.py) wherever both encode a value as a normal FP8 number."""
from __future__ import annotations

import pytest
import torch

from coat_ds.kernels import reference
from coat_ds.kernels.fp8 import get_format
from coat_ds.kernels.graph_codec import graph_dequantize, graph_quantize, graph_scale_exponent

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


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_guarantees(fmt, dtype, device):
    f = get_format(fmt)
    for shape in SHAPES:
        x = _sample(shape, dtype, device)
        codes, exps = graph_quantize(x, 16, f)
        back = graph_dequantize(codes, exps, 16, f, dtype)
        assert codes.shape == x.shape and codes.dtype == torch.uint8 and back.dtype == dtype
        finite = torch.isfinite(x)
        assert _same(back[~finite], x[~finite]), "inf, -inf and NaN pass through exactly"
        assert torch.isfinite(back[finite]).all(), "a finite value never comes back non-finite"
        assert _same(back.view(-1)[3:6], torch.tensor([-0.0, 0.0, -0.0], dtype=dtype, device=device))
        assert (back.view(-1)[16:32] == 0).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_values_are_the_eager_codecs_where_both_are_normal(fmt, device):
    # The two codecs' scales differ by at most a factor 2; a value encoded as a normal FP8
    # number by both keeps the same significand either way, so decodes identically.
    f = get_format(fmt)
    x = torch.randn(256, 64, device=device) * torch.exp(torch.randn(256, 64, device=device) * 2)
    back = graph_dequantize(*graph_quantize(x, 16, f), 16, f, torch.float32)
    want = reference.act_dequantize_rows(*reference.act_quantize_rows(x, 16, f), 16, f, torch.float32)
    # Smallest normal FP8 value at the larger of the two scales (this codec's: it puts a
    # group's max in [0.8125, 1.625) * 2**E, the eager one in (0.875, 1.75] * 2**E).
    amax = x.abs().reshape(256, 4, 16).amax(-1, keepdim=True)
    e = graph_scale_exponent(amax.view(torch.int32), f)
    normal = (x.abs().reshape(256, 4, 16) >= 2.0 ** (f.min_normal_exp + e)).reshape(256, 64)
    assert normal.float().mean() > 0.9
    assert torch.equal(back[normal], want[normal])
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(f.mantissa_bits + 1) * 1.0001


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_no_finite_value_takes_the_top_code(fmt, device):
    # The top code stands for inf: a group's max must land below it, however it rounds.
    f = get_format(fmt)
    m = torch.arange(1 << 23, dtype=torch.int32, device=device)
    amax = ((127 << 23) | m).view(torch.float32)  # every float32 in [1, 2)
    e = graph_scale_exponent(amax.view(torch.int32), f)
    y = amax * 2.0 ** -e.float()
    codes = y.to(f.dtype).view(torch.uint8)
    assert (codes < f.code_max).all() and (y >= 0.8125 * f.max / 1.75).all()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inductor_gives_the_eager_values(fmt, dtype, device):
    # Inductor generates its own FP8 casts and reductions for the inlined pack and unpack.
    f = get_format(fmt)
    quant = torch.compile(lambda t: graph_quantize(t, 16, f), dynamic=False)
    dequant = torch.compile(lambda c, e: graph_dequantize(c, e, 16, f, dtype), dynamic=False)
    try:
        for shape in SHAPES:
            x = _sample(shape, dtype, device, seed=1)
            codes, exps = graph_quantize(x, 16, f)
            got_codes, got_exps = quant(x)
            assert torch.equal(got_exps, exps)
            # NaN's code is the cast's own (0x7F or 0xFF by backend); every other code agrees.
            nan = torch.isnan(x)
            assert torch.equal(got_codes[~nan], codes[~nan])
            assert _same(dequant(got_codes, got_exps), graph_dequantize(codes, exps, 16, f, dtype))
    finally:
        torch._dynamo.reset()
