"""Activation FP8 kernels: Triton (interpreter on CPU) against the torch twins, and numerics."""
from __future__ import annotations

import pytest
import torch

from coat_ds.kernels import reference as ref
from coat_ds.kernels.act_ops import get_act_ops


def _triton():
    return get_act_ops(torch.device("cpu"), "triton") if not torch.cuda.is_available() else get_act_ops(
        torch.device("cuda"), "triton")


def _data(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Log-normal magnitudes spanning ~6 decades, random signs, no zeros.
    x = torch.randn(shape, generator=g) * torch.exp(2.0 * torch.randn(shape, generator=g))
    return x.to(dtype).to(device)


def _sqnr_db(x, y):
    x, y = x.double(), y.double()
    return (10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum())).item()


# Small shapes: the interpreter pays ~3 ms per program; these are <= 8 programs each.
SHAPES = [(3, 1000), (8, 512), (5, 37), (2, 3, 64)]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference_bit_exact(shape, dtype, fmt, device):
    ops = _triton()
    x = _data(shape, dtype, device)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    c1, e1 = ops.quantize_tensor(x, fmt)
    c2, e2 = ref.act_quantize_tensor(x.cpu(), fmt)
    assert torch.equal(c1.cpu(), c2) and int(e1) == int(e2)
    assert torch.equal(ops.dequantize_tensor(c1, e1, fmt, dtype).cpu(), ref.act_dequantize_tensor(c2, e2, fmt, dtype))
    c1, e1 = ops.quantize_rows(x, 16, fmt)
    c2, e2 = ref.act_quantize_rows(x.cpu(), 16, fmt)
    assert torch.equal(c1.cpu(), c2) and torch.equal(e1.cpu(), e2)
    assert e2.shape == (x.numel() // shape[-1], -(-shape[-1] // 16))
    assert torch.equal(ops.dequantize_rows(c1, e1, 16, fmt, dtype).cpu(),
                       ref.act_dequantize_rows(c2, e2, 16, fmt, dtype))


# E4M3 keeps 3 mantissa bits: round-to-nearest error is uniform over +-1/2 step (step =
# 2^-3 of the binade), ~31.5 dB on Gaussian data (measured 31.5-31.6); E5M2 (2 bits) ~25.6.
# The bounds sit 1.5 dB under that.
@pytest.mark.parametrize("fmt,db,mant", [("e4m3", 30.0, 3), ("e5m2", 24.0, 2)])
def test_quantization_error_bounds(fmt, db, mant):
    for seed in range(3):
        g = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)) * 3.0
        assert _sqnr_db(g, ref.act_dequantize_rows(*ref.act_quantize_rows(g, 16, fmt), 16, fmt)) > db
        assert _sqnr_db(g, ref.act_dequantize_tensor(*ref.act_quantize_tensor(g, fmt), fmt)) > db
        # Per element, on data spanning ~6 decades: every element within 2^10 of its group's
        # max is in FP8's normal range after scaling, so its error is at most half a step.
        x = _data((64, 256), torch.float32, "cpu", seed)
        y = ref.act_dequantize_rows(*ref.act_quantize_rows(x, 16, fmt), 16, fmt)
        gmax = x.abs().reshape(64, 16, 16).amax(-1, keepdim=True).expand(64, 16, 16).reshape(64, 256)
        normal = x.abs() >= gmax / 1024
        assert ((y - x).abs()[normal] / x.abs()[normal]).max() <= 2.0 ** -(mant + 1)


# numpy warns when the interpreter computes 2**126 * (tiny) products on masked-off lanes.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zeros_and_extremes_stay_finite(backend):
    ops = _triton() if backend == "triton" else get_act_ops(torch.device("cpu"), "torch")
    dev = "cuda" if (backend == "triton" and torch.cuda.is_available()) else "cpu"
    fmax = torch.finfo(torch.float32).max
    x = torch.zeros(4, 32, device=dev)
    x[0, :4] = torch.tensor([fmax, -fmax, 1e-40, 3.3e38])  # top of fp32, a subnormal
    x[2, 16:] = 1e-42  # a group of subnormals only; row 1 and the rest stay all-zero
    for fmt in ("e4m3", "e5m2"):
        for y in (ops.dequantize_rows(*ops.quantize_rows(x, 16, fmt), 16, fmt),
                  ops.dequantize_tensor(*ops.quantize_tensor(x, fmt), fmt)):
            assert torch.isfinite(y).all()
            assert (y[x == 0] == 0).all()
        h = torch.tensor([[65504.0, -65504.0] + [1.0] * 14], dtype=torch.float16, device=dev)
        for y in (ops.dequantize_rows(*ops.quantize_rows(h, 16, fmt), 16, fmt, torch.float16),
                  ops.dequantize_tensor(*ops.quantize_tensor(h, fmt), fmt, torch.float16)):
            assert torch.isfinite(y).all()


def test_per_tensor_two_stage_max_spans_programs(device):
    # Several programs each reduce a block; the max sits in the last one.
    ops = _triton()
    x = torch.randn(3 * 4096 + 5, device=device) * 0.01
    x[-1] = 300.0
    c, e = ops.quantize_tensor(x)
    assert int(e) == int(ref.act_scale_exponent(torch.tensor(300.0), ref.get_format("e4m3")))
    assert ops.dequantize_tensor(c, e)[-1] == 288.0  # E4M3's step is 32 in [256, 448]


def test_launch_cache_key_separates_what_triton_specializes_on():
    # A compiled kernel is reused only for arguments Triton would have compiled it for:
    # pointer dtype and 16-byte alignment, integer divisibility by 16, value 1, width.
    from coat_ds.kernels.act_launch import _spec

    buf = torch.empty(64)
    assert _spec((buf,)) == _spec((torch.empty(32),))
    assert _spec((buf,)) != _spec((buf[1:],))  # 4 bytes off: not 16-byte aligned
    assert _spec((buf,)) != _spec((buf.to(torch.bfloat16),))
    assert _spec((32,)) == _spec((4096,)) != _spec((33,))
    assert _spec((1,)) != _spec((33,))
    assert _spec((2**31 + 16,)) != _spec((16,))
    assert _spec((1.5,)) == _spec((3.0e38,))


# numpy warns when the interpreter's software FP8 cast sees inf or NaN; those codes are replaced.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_values_pass_through_and_do_not_set_scales(backend, fmt, device):
    # A masked logit (-inf) used to become its group's (or tensor's) max: the scale went to
    # 2**126 and every finite value of the group decoded to 0.
    ops = _triton() if backend == "triton" else get_act_ops(torch.device("cpu"), "torch")
    dev = device if backend == "triton" else "cpu"
    for dtype in (torch.float32, torch.bfloat16):
        x = _data((6, 40), dtype, dev, seed=7)
        special = torch.zeros(6, 40, dtype=torch.bool, device=dev)
        special[0, 3], special[1, ::5], special[2, 17], special[3] = True, True, True, True  # row 3: all
        x = x.masked_fill(special, float("-inf"))
        x[0, 3], x[2, 17] = float("inf"), float("nan")
        finite = x.masked_fill(special, 0.0)
        for quant, dequant, args in ((ops.quantize_rows, ops.dequantize_rows, (16, fmt)),
                                     (ops.quantize_tensor, ops.dequantize_tensor, (fmt,))):
            codes, exps = quant(x, *args)
            want_codes, want_exps = quant(finite, *args)
            # Finite values are stored exactly as if the non-finite ones were zeros.
            assert torch.equal(codes[~special], want_codes[~special]) and torch.equal(exps, want_exps)
            y = dequant(codes, exps, *args, dtype)
            assert torch.equal(y[special].isnan(), x[special].isnan())
            assert torch.equal(y[special].nan_to_num(0.0), x[special].nan_to_num(0.0))  # +-inf exactly
            assert torch.equal(y[~special], dequant(want_codes, want_exps, *args, dtype)[~special])
            assert _sqnr_db(x[~special], y[~special]) > 30.0 - 6.0 * (fmt == "e5m2")
            # The torch twin agrees bit for bit.
            ref_ops = (ref.act_quantize_rows, ref.act_dequantize_rows) if quant is ops.quantize_rows else (
                ref.act_quantize_tensor, ref.act_dequantize_tensor)
            rc, re = ref_ops[0](x.cpu(), *args)
            assert torch.equal(rc, codes.cpu()) and torch.equal(re, exps.cpu())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_finite_and_non_finite_blocks_of_one_launch_match_the_twin(device):
    # Per group, each program takes the plain path when its block is all finite and the full
    # one when it holds an inf or a NaN (three programs here, one finite, one of each); per
    # tensor, all programs take the plain path when the whole tensor is finite. The finite
    # block has a tiny negative that rounds to zero: stored as +0 (-0's code means NaN).
    ops = _triton()
    for quant, twin, args, block in ((ops.quantize_rows, ref.act_quantize_rows, (16,), 256 * 16),
                                     (ops.quantize_tensor, ref.act_quantize_tensor, (), 4096)):
        x = _data((3 * block,), torch.float32, "cpu", seed=3)
        x[5], x[6] = -1e-30, 1e4  # block 0: finite; -1e-30 rounds to zero in its group
        for special in (False, True):
            if special:
                x[block + 7] = float("-inf")  # block 1
                x[2 * block + 9] = float("nan")  # block 2
            xd = x.reshape(-1, 16).to(device)
            codes, exps = quant(xd, *args)
            want_codes, want_exps = twin(xd.cpu(), *args)
            assert torch.equal(codes.cpu(), want_codes) and torch.equal(exps.cpu(), want_exps)
            flat = codes.reshape(-1).cpu()
            assert flat[5] == 0 and flat[6] != 0
            if special:
                assert flat[block + 7] == ref.ACT_NEG_INF and flat[2 * block + 9] == ref.ACT_NAN


def test_launchers_resolve_the_isa_once_per_device(monkeypatch):
    # Host cost: every saved tensor calls a launcher in pack and in unpack, and resolving
    # the ISA from x.device each time cost more than the rest of the check. It is looked up
    # once per device, and again after fp8.set_fp8_conversions clears fp8's own cache.
    from coat_ds.kernels import act_quant, fp8

    calls = []
    kernel_isa = fp8.kernel_isa
    monkeypatch.setattr(fp8, "kernel_isa", lambda d: calls.append(d) or kernel_isa(d))
    monkeypatch.setattr(fp8, "_TENSOR_ISA", {})
    x = torch.randn(4, 32)
    for _ in range(3):
        assert act_quant._check(x) == kernel_isa(x.device)
    assert len(calls) == 1
    fp8.set_fp8_conversions(None)  # clears fp8's cache (what a mode change does)
    act_quant._check(x)
    assert len(calls) == 2
