"""Which kernel path runs where (hardware FP8 conversions, portable Triton, torch reference),
and that the portable FP8 coding gives the same codes as the hardware's.

CPU: the selection logic, the one log line, and the portable coder (what the interpreter
and GPUs before compute capability 8.9 run) bit-exact against torch's casts. GPU (`-m gpu`,
capability 8.9+): every kernel run both ways, codes compared bit for bit:

    python -m pytest -q tests/test_kernel_paths.py -m gpu
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

from coat_ds.kernels import AdamWHyper, AdamWSlot, E4M3, E5M2, fp8, get, reference as R, set_fp8_conversions
from coat_ds.kernels.fp8 import ISA_GENERIC, ISA_NVIDIA, ISA_NVIDIA_FP8, kernel_isa, select_isa


# CPU tensors through Triton need its interpreter; on a GPU machine these run as the gpu tests.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("cap,hip,forced,isa", [
    ((7, 0), False, False, ISA_NVIDIA),       # V100
    ((8, 0), False, False, ISA_NVIDIA),       # A100
    ((8, 6), False, False, ISA_NVIDIA),       # A10 / RTX 30xx
    ((8, 9), False, False, ISA_NVIDIA_FP8),   # L4 / RTX 40xx
    ((9, 0), False, False, ISA_NVIDIA_FP8),   # H100
    ((10, 0), False, False, ISA_NVIDIA_FP8),  # B200
    ((9, 0), False, True, ISA_NVIDIA),        # H100 forced portable
    ((9, 4), True, False, ISA_GENERIC),       # ROCm reports a capability too: no PTX
    (None, False, False, ISA_GENERIC),        # CPU tensors under the interpreter
])
def test_select_isa(cap, hip, forced, isa):
    assert select_isa(cap, hip, forced) == isa


@pytest.mark.parametrize("version", [None, (3, 2)])
def test_cuda_without_usable_triton_gets_the_reference(monkeypatch, caplog, version):
    monkeypatch.setattr(fp8, "triton_version", lambda: version)
    monkeypatch.setattr(fp8, "_LOGGED", set())
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="coat_ds.kernels"):
        for op in ("group_codec", "act_codec", "group_codec"):
            assert get(op, cuda) is get(op, cuda, "torch")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("coat_ds kernels on cuda")]
    assert lines == ["coat_ds kernels on cuda: torch reference (Triton missing or older than 3.6)"]
    with pytest.raises(RuntimeError, match="backend='triton'"):
        get("group_codec", cuda, "triton")


@interpreted
def test_one_log_line_at_first_use(monkeypatch, caplog):
    monkeypatch.setattr(fp8, "_LOGGED", set())
    monkeypatch.setattr(fp8, "_ISA", {})
    cast = get("cast_fp8", torch.device("cpu"), "triton").cast
    with caplog.at_level(logging.INFO, logger="coat_ds.kernels"):
        cast(torch.randn(100), "e4m3")
        cast(torch.randn(100), "e5m2")
    lines = [r.getMessage() for r in caplog.records if r.name == "coat_ds.kernels"]
    assert lines == ["coat_ds kernels on cpu: Triton, portable FP8 (generic Triton, no PTX)"]


def test_forcing_the_portable_path(monkeypatch):
    monkeypatch.setattr(fp8, "_ISA", {})
    with pytest.raises(ValueError, match="'software'"):
        set_fp8_conversions("software")
    monkeypatch.setenv(fp8.FP8_ENV, "sometimes")
    with pytest.raises(ValueError, match="COAT_DS_FP8_CONVERSIONS.*'sometimes'"):
        kernel_isa(torch.device("cpu"))
    monkeypatch.setenv(fp8.FP8_ENV, "portable")
    assert kernel_isa(torch.device("cpu")) == ISA_GENERIC


def _cast_inputs(fmt) -> torch.Tensor:
    """Every finite code's value, every rounding midpoint between neighbours (ties must go
    to the even code), one float32 ulp either side of each midpoint, beyond the maximum,
    below the smallest subnormal, signed zeros, and random values."""
    vals = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    vals = vals[torch.isfinite(vals)]
    pos = vals[vals >= 0].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    edge = torch.tensor([fmt.max * 1.02, fmt.max * 1.5, 3e38, pos[1].item() / 2, pos[1].item() / 3, 1e-30,
                         0.0, -0.0])
    g = torch.Generator().manual_seed(3)
    rnd = torch.randn(1000, generator=g) * torch.exp2(torch.randint(-20, 12, (1000,), generator=g).float())
    x = torch.cat([vals, mids, near, edge, rnd])
    return torch.cat([x, -x])


@interpreted
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_portable_coder_bit_exact_against_torch_casts(fmt):
    """The integer-op FP8 coder (interpreter here, pre-8.9 GPUs, forced portable) against
    torch's saturating casts, on every code, midpoint and neighbour of a midpoint."""
    x = _cast_inputs(fmt)
    codes, out = get("cast_fp8", x.device, "triton").cast(x, fmt)
    ref_codes, ref_out = R.cast_fp8(x, fmt)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(out.view(torch.int32), ref_out.view(torch.int32))  # -0.0 too


# ---- GPU: hardware FP8 conversions against the forced portable path ----------------------


def _both_paths(fn):
    """fn() under the hardware conversions and under the forced portable coder."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no hardware FP8 conversions before compute capability 8.9")
    try:
        set_fp8_conversions("auto")
        assert kernel_isa(dev) == ISA_NVIDIA_FP8
        hw = fn()
        set_fp8_conversions("portable")
        assert kernel_isa(dev) == ISA_NVIDIA
        sw = fn()
    finally:
        set_fp8_conversions(None)
    return hw, sw


def _assert_bits_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = x.reshape(-1), y.reshape(-1)  # 0-d exponents cannot be viewed as bytes
        assert x.dtype == y.dtype and x.shape == y.shape
        differ = (x.view(torch.uint8) != y.view(torch.uint8)).view(x.numel(), -1).any(1)
        where = differ.nonzero().flatten()[:5].tolist()
        assert not differ.any(), (f"{int(differ.sum())} of {x.numel()} {x.dtype} values differ, e.g. "
                                  f"{[(i, x[i].item(), y[i].item()) for i in where]}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_gpu_cast_hardware_equals_portable(fmt):
    x = _cast_inputs(fmt).cuda()
    cast = get("cast_fp8", x.device, "triton").cast
    hw, sw = _both_paths(lambda: cast(x, fmt))
    _assert_bits_equal(hw, sw)
    _assert_bits_equal([hw[0].cpu()], [R.cast_fp8(x.cpu(), fmt)[0]])


def _spread(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dre", [True, False])
def test_gpu_group_quantizer_hardware_equals_portable(fmt, dre):
    x = _spread((300, 1000), 5)
    x[0, :128] = 0.0
    codec = get("group_codec", x.device, "triton")

    def run():
        q = codec.quantize(x, 128, fmt, dre)
        return [*q, codec.dequantize(q, 128, fmt)]

    _assert_bits_equal(*_both_paths(run))


@pytest.mark.gpu
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16])
def test_gpu_adamw_step_hardware_equals_portable(pdt):
    shapes = [(1000, 384), (4097,), (3, 130)]
    step = get("adamw", torch.device("cuda"), "triton").step

    def run():
        slots = []
        for i, s in enumerate(shapes):
            p = (_spread(s, i) * 0.02).to(pdt)
            m = R.quantize_groups(_spread(s, 10 + i).cpu() * 1e-3).to("cuda")
            v = R.quantize_groups(_spread(s, 20 + i).cpu().square() * 1e-6).to("cuda")
            slots.append(AdamWSlot(p, torch.zeros_like(p), m, v))
        for n in range(1, 4):
            for i, s in enumerate(slots):
                s.grad.copy_(_spread(s.param.shape, 100 * n + i) * 1e-3)
            step(slots, AdamWHyper.at_step(n, 1e-3, 0.9, 0.999, 1e-8, 0.01), plan_cache={})
        return [t for s in slots for t in (s.param, *s.exp_avg, *s.exp_avg_sq)]

    _assert_bits_equal(*_both_paths(run))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_activation_kernels_hardware_equals_portable(fmt, dtype):
    x = _spread((64, 1000), 9).to(dtype)
    ops = get("act_codec", x.device, "triton")

    def run():
        ct, et = ops.quantize_tensor(x, fmt)
        cr, er = ops.quantize_rows(x, 16, fmt)
        return [ct, et, ops.dequantize_tensor(ct, et, fmt, dtype), cr, er, ops.dequantize_rows(cr, er, 16, fmt, dtype)]

    _assert_bits_equal(*_both_paths(run))


def test_kernel_choice_traces_without_a_graph_break():
    """A layer that asks for its kernels while torch.compile traces it makes Dynamo trace
    the Triton probe (its lru_cache does not apply there). The probe parsed Triton's version
    with `re`; with the regex cache evicted (transformers compiles hundreds of patterns),
    torch 2.11's Dynamo broke the graph inside `re`'s compiler, which split a compiled FP8
    layer into pieces on the H100 (+100 ms per 7B step). torch 2.13 traces `re`, so on CPU
    this guards the fullgraph trace, not that particular break."""
    import re

    from coat_ds.kernels import fp8

    def pick(x):
        return x + 1 if fp8.triton_usable(x.device) else x - 1

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        x = torch.zeros(2, device=dev)
        expected = pick(x)
        torch._dynamo.reset()
        fp8.triton_version.cache_clear()
        re.purge()
        assert torch.equal(torch.compile(pick, fullgraph=True, backend="eager")(x), expected), dev
