"""Activation FP8 kernels: Triton (interpreter on CPU) against the torch definition
(kernels/act_codec.py) bit for bit, and numerics."""
from __future__ import annotations

import pytest
import torch

from coat_ds.kernels import act_codec as codec
from coat_ds.kernels import get
from coat_ds.kernels.fp8 import get_format


def _triton():
    return get("act_codec", torch.device("cuda" if torch.cuda.is_available() else "cpu"), "triton")


def _data(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Log-normal magnitudes spanning ~6 decades, random signs, no zeros.
    x = torch.randn(shape, generator=g) * torch.exp(2.0 * torch.randn(shape, generator=g))
    return x.to(dtype).to(device)


def _sqnr_db(x, y):
    x, y = x.double(), y.double()
    return (10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum())).item()


def _same(a, b) -> bool:
    """Equal values, NaN equal to NaN (torch and the kernels may pick different NaN codes),
    zeros with their sign."""
    a, b = a.float().cpu(), b.float().cpu()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0).view(torch.int32),
                                                              b.nan_to_num(0.0).view(torch.int32))


def _assert_codes_match(got, want, x):
    """Equal codes where x is not NaN (where it is, callers compare the decoded values)."""
    keep = ~x.isnan().cpu()
    assert torch.equal(got.cpu()[keep], want[keep])


def _assert_kernels_match_the_definition(ops, x, fmt, dtype):
    c1, e1 = ops.quantize_tensor(x, fmt)
    c2, e2 = codec.quantize_tensor(x.cpu(), fmt)
    _assert_codes_match(c1, c2, x)
    assert e1.shape == () and int(e1) == int(e2)
    assert _same(ops.dequantize_tensor(c1, e1, fmt, dtype), codec.dequantize_tensor(c2, e2, fmt, dtype))
    c1, e1 = ops.quantize_rows(x, 16, fmt)
    c2, e2 = codec.quantize_groups(x.cpu(), 16, fmt)
    _assert_codes_match(c1, c2, x)
    assert torch.equal(e1.cpu(), e2) and e1.shape == (-(-x.numel() // 16),) and e1.dtype == torch.int8
    assert _same(ops.dequantize_rows(c1, e1, 16, fmt, dtype), codec.dequantize_groups(c2, e2, 16, fmt, dtype))


# Small shapes: the interpreter pays ~3 ms per program; these are <= 8 programs each. Last
# dims that are and are not multiples of 16; (3, 3000) spans three programs.
SHAPES = [(3, 1000), (8, 512), (5, 37), (2, 3, 64), (3, 3000)]


# numpy warns when the interpreter's software FP8 cast sees inf or NaN; those codes are replaced.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_the_definition_bit_exact(shape, dtype, fmt, device):
    ops = _triton()
    x = _data(shape, dtype, device)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    _assert_kernels_match_the_definition(ops, x, fmt, dtype)
    # The same with non-finite values in the first and the last program's block, a zero of
    # each sign and a tiny negative that rounds to -0.
    flat = x.view(-1)
    flat[:5] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, -1e-30])
    flat[-1] = float("nan")
    _assert_kernels_match_the_definition(ops, x, fmt, dtype)


# numpy warns on the software decoding's lanes that the kernel replaces.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_triton_decodes_every_code_as_the_definition(fmt, device):
    # The software decoding reads the top code and the NaN codes as finite values: the
    # kernels map them to +-inf and NaN as the definition does.
    ops = _triton()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    for e in (-3, 0, 5):
        exp = torch.tensor(e, dtype=torch.int32, device=device)
        want = codec.dequantize_tensor(codes.cpu(), exp.cpu(), fmt)
        assert _same(ops.dequantize_tensor(codes, exp, fmt), want)
        exps = torch.full((16,), e, dtype=torch.int8, device=device)
        assert _same(ops.dequantize_rows(codes, exps, 16, fmt), want)


# numpy warns when the interpreter computes 2**126 * (tiny) products on masked-off lanes.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zeros_and_extremes_stay_finite(backend):
    ops = _triton() if backend == "triton" else get("act_codec", torch.device("cpu"), "torch")
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
    assert int(e) == int(codec.scale_exponent(torch.tensor(300.0).view(torch.int32), get_format("e4m3")))
    assert ops.dequantize_tensor(c, e)[-1] == 288.0  # E4M3's step is 32 in [256, 416]


def test_launch_cache_key_separates_what_triton_specializes_on():
    # A compiled kernel is reused only for arguments Triton would have compiled it for:
    # pointer dtype and 16-byte alignment, integer divisibility by 16, value 1, width.
    from coat_ds.kernels.jit import _spec

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
    ops = _triton() if backend == "triton" else get("act_codec", torch.device("cpu"), "torch")
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
            assert exps.shape == ((-(-x.numel() // 16),) if quant is ops.quantize_rows else ())
            y = dequant(codes, exps, *args, dtype)
            assert torch.equal(y[special].isnan(), x[special].isnan())
            assert torch.equal(y[special].nan_to_num(0.0), x[special].nan_to_num(0.0))  # +-inf exactly
            assert torch.equal(y[~special], dequant(want_codes, want_exps, *args, dtype)[~special])
            assert _sqnr_db(x[~special], y[~special]) > 30.0 - 6.0 * (fmt == "e5m2")
            # The torch definition agrees bit for bit (NaN: decoded above).
            twin = codec.quantize_groups if quant is ops.quantize_rows else codec.quantize_tensor
            rc, re = twin(x.cpu(), *args)
            nan = x.isnan().cpu()
            assert torch.equal(rc[~nan], codes.cpu()[~nan]) and torch.equal(re, exps.cpu())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_finite_and_non_finite_blocks_of_one_launch_match_the_twin(device):
    # Per group, each program takes the plain path when its block is all finite and the full
    # one when it holds an inf or a NaN (three programs here, one finite, one of each); per
    # tensor, all programs take the plain path when the whole tensor is finite. The finite
    # block has a tiny negative that rounds to zero: -0, its sign kept.
    ops = _triton()
    e4m3 = get_format("e4m3")
    for quant, dequant, twin, args, block in (
            (ops.quantize_rows, ops.dequantize_rows, codec.quantize_groups, (16,), 256 * 16),
            (ops.quantize_tensor, ops.dequantize_tensor, codec.quantize_tensor, (), 4096)):
        x = _data((3 * block,), torch.float32, "cpu", seed=3)
        x[5], x[6] = -1e-30, 1e4  # block 0: finite; -1e-30 rounds to zero in its group
        for special in (False, True):
            if special:
                x[block + 7] = float("-inf")  # block 1
                x[2 * block + 9] = float("nan")  # block 2
            xd = x.reshape(-1, 16).to(device)
            codes, exps = quant(xd, *args)
            want_codes, want_exps = twin(xd.cpu(), *args)
            nan = xd.isnan().cpu()
            assert torch.equal(codes.cpu()[~nan], want_codes[~nan]) and torch.equal(exps.cpu(), want_exps)
            flat = codes.reshape(-1).cpu()
            assert flat[5] == 0x80 and flat[6] != 0
            if special:
                assert flat[block + 7] == 0x80 | e4m3.code_max  # -inf: the top code, negative
                y = dequant(codes, exps, *args).reshape(-1).cpu()
                assert y[block + 7] == float("-inf") and y[2 * block + 9].isnan()


def test_launchers_resolve_the_isa_once_per_device(monkeypatch):
    # Host cost: every saved tensor calls a launcher in pack and in unpack, and resolving
    # the ISA from x.device each time cost more than the rest of the check. It is looked up
    # once per device, and again after fp8.set_fp8_conversions clears fp8's own cache.
    from coat_ds.kernels import fp8

    calls = []
    kernel_isa = fp8.kernel_isa
    monkeypatch.setattr(fp8, "kernel_isa", lambda d: calls.append(d) or kernel_isa(d))
    monkeypatch.setattr(fp8, "_TENSOR_ISA", {})
    x = torch.randn(4, 32)
    for _ in range(3):
        assert codec._check(x) == kernel_isa(x.device)
    assert len(calls) == 1
    fp8.set_fp8_conversions(None)  # clears fp8's cache (what a mode change does)
    codec._check(x)
    assert len(calls) == 2
