"""The one kernel interface: every kernel a `torch.ops.coat_ds` custom op (schema, declared
mutations and fake implementation checked by `torch.library.opcheck`), its CPU kernel the
reference bit for bit, its CUDA body (Triton) the reference within the kernels' bounds
under the interpreter; the registry's choice of backend; the FP8 capability threshold
defined once."""
from __future__ import annotations

import os

import pytest
import torch

from coat_ds.kernels import AdamWHyper, AdamWSlot, QuantizedGroups, act_codec as A, fp8, get, reference as R
from coat_ds.kernels.adamw import flat_slots
from coat_ds.kernels.custom_ops import BODIES
from coat_ds.kernels.registry import OPS
from coat_ds.linear.layer import fp8_gemm_available

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
CPU = torch.device("cpu")
G = 32


def _x(*shape, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape) * torch.logspace(-3, 3, shape[-1])


def _slots(quant: bool, seed=1) -> list[AdamWSlot]:
    torch.manual_seed(seed)
    out = []
    for shape, skips in (((4, 80), True), ((100,), False)):
        p = torch.randn(shape)
        m, v = torch.randn(shape) * 1e-3, torch.rand(shape) * 1e-6
        if quant:
            m, v = R.quantize_groups(m, G, "e4m3"), R.quantize_groups(v, G, "e5m2")
        meta = (shape[0] if len(shape) == 2 else 1, -(-shape[-1] // G))
        out.append(AdamWSlot(p, torch.randn(shape) * 1e-2, m, v,
                             torch.zeros(meta, dtype=torch.int32) if skips else None))
    return out


_HYPER = list(AdamWHyper.at_step(3, 1e-3, 0.9, 0.999, 1e-8, 0.01))


def _adamw_args(quant: bool):
    return (*flat_slots(_slots(quant)), _HYPER, G, "e4m3", "e5m2", True, torch.zeros((), dtype=torch.int64))


def _cases():
    x = _x(6, 80)
    qg = R.quantize_groups(x, G, "e4m3")
    codes, exp = A.quantize_tensor(x, "e5m2")
    rcodes, exps = A.quantize_groups(x, 16, "e4m3")
    return {
        "quantize_groups": (x, G, "e4m3", True),
        "dequantize_groups": (*qg, G, "e4m3", torch.bfloat16),
        "cast_fp8": (x, "e5m2"),
        "adamw_step": _adamw_args(True),
        "act_quantize_tensor": (x, "e5m2"),
        "act_dequantize_tensor": (codes, exp, "e5m2", torch.float32),
        "act_quantize_rows": (x, 16, "e4m3"),
        "act_dequantize_rows": (rcodes, exps, 16, "e4m3", torch.bfloat16),
    }


def test_every_kernel_is_an_op():
    names = {*BODIES, "fp8_linear_quantize"}
    assert names == {*_cases(), "fp8_linear_quantize"}
    for name in names:
        assert hasattr(torch.ops.coat_ds, name), name


@pytest.mark.parametrize("name", sorted(_cases()))
def test_opcheck(name):
    """Schema, declared mutations, fake implementation and autograd registration agree with
    what the CPU kernel does."""
    torch.library.opcheck(getattr(torch.ops.coat_ds, name).default, _cases()[name])


def test_adamw_op_with_fp32_moments_passes_opcheck():
    torch.library.opcheck(torch.ops.coat_ds.adamw_step.default, _adamw_args(False))


def test_linear_op_passes_opcheck():
    w = _x(20, 48)
    torch.library.opcheck(torch.ops.coat_ds.fp8_linear_quantize.default, (w, 0, True, True, None, None, True))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                                                  b.view(torch.uint8) if b.dtype.is_floating_point else b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name,ref", [
    ("quantize_groups", lambda x, g, f, d: tuple(R.quantize_groups(x, g, f, d))),
    ("dequantize_groups", lambda c, ce, k, s, g, f, dt: R.dequantize_groups(QuantizedGroups(c, ce, k, s), g, f, dt)),
    ("cast_fp8", R.cast_fp8),
    ("act_quantize_tensor", A.quantize_tensor),
    ("act_dequantize_tensor", A.dequantize_tensor),
    ("act_quantize_rows", A.quantize_groups),
    ("act_dequantize_rows", A.dequantize_groups),
])
def test_cpu_kernel_is_the_reference(name, ref):
    args = _cases()[name]
    assert _equal(getattr(torch.ops.coat_ds, name)(*args), ref(*args))


@pytest.mark.parametrize("quant", [True, False])
def test_cpu_adamw_op_is_the_reference_step(quant):
    a, b = _slots(quant), _slots(quant)
    sa, sb = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    a[0].grad[1, 5] = float("nan")  # one skipped group, counted in both
    b[0].grad[1, 5] = float("nan")
    torch.ops.coat_ds.adamw_step(*flat_slots(a), _HYPER, G, "e4m3", "e5m2", True, sa)
    R.adamw_step(b, AdamWHyper(*_HYPER), group_size=G, fmt_m="e4m3", fmt_v="e5m2", skipped=sb)
    written = [lambda f: f[0], lambda f: f[2], lambda f: f[3], lambda f: f[4]]
    for part in written:
        assert _equal(part(flat_slots(a)), part(flat_slots(b)))
    assert sa.item() == sb.item() == 1 and a[0].skips.sum().item() == 1


def test_fake_tensors_give_the_output_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = _cases()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for name, args in cases.items():
            fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            out = getattr(torch.ops.coat_ds, name)(*fargs)
            want = _body(name, "torch", *args)
            if out is None:
                assert want is None, name
                continue
            out = (out,) if isinstance(out, torch.Tensor) else out
            want = (want,) if isinstance(want, torch.Tensor) else want
            assert [(o.shape, o.dtype) for o in out] == [(w.shape, w.dtype) for w in want], name


def _body(name, backend, *args):
    """What op `name` runs on `backend`'s kernels (the CPU kernel: "torch"; CUDA: "triton")."""
    registry_op, body = BODIES[name]
    return body(get(registry_op, CPU, backend), *args)


def _both(name):
    args = _cases()[name]
    return _body(name, "triton", *args), _body(name, "torch", *args)


@interpreted
@pytest.mark.parametrize("name", sorted(set(_cases()) - {"adamw_step", "quantize_groups", "dequantize_groups"}))
def test_cuda_body_is_the_reference_under_the_interpreter(name):
    """What the op runs on CUDA (the Triton table), here on CPU tensors: the FP8 cast and the
    activation kernels equal the reference bit for bit, as tests/test_kernels.py and
    tests/test_act_kernels.py require of them."""
    assert _equal(*_both(name))


@interpreted
def test_cuda_group_bodies_match_the_reference_under_the_interpreter():
    """tests/test_kernels.py's bounds: log2/exp2 differ in the last bit between the two, so a
    code may move by one."""
    (codes, center, kcode, sexp), (rcodes, rcenter, rkcode, rsexp) = _both("quantize_groups")
    assert (codes == rcodes).float().mean().item() >= 0.99
    assert (kcode == rkcode).float().mean().item() >= 0.95
    torch.testing.assert_close(center, rcenter, rtol=1e-5, atol=0)
    got, want = _both("dequantize_groups")
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)


@interpreted
def test_cuda_adamw_body_matches_the_reference_under_the_interpreter():
    a, b = _adamw_args(True), _adamw_args(True)
    _body("adamw_step", "triton", *a)
    _body("adamw_step", "torch", *b)
    # tests/test_kernels.py's bound for the fused step: parameters to float32 rounding,
    # moment codes within one code.
    for x, y in zip(a[0], b[0]):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    for x, y in zip(a[2] + a[3], b[2] + b[3]):
        diff = (x.to(torch.float32) - y.to(torch.float32)).abs()
        assert diff.max() <= (1 if x.dtype == torch.uint8 else 1e-6 * y.abs().max().item()), x.dtype


def test_the_registry_picks_the_twins_or_the_launchers(monkeypatch):
    """"auto" is the twins on CPU; "triton" the launchers, the same fields; an unknown op is
    refused with the names it could be."""
    from coat_ds.kernels import reference as R
    from coat_ds.kernels import act_codec

    assert get("group_codec", CPU) is get("group_codec", CPU, "torch")
    assert get("group_codec", CPU).quantize is R.quantize_groups
    assert get("act_codec", CPU).quantize_rows is act_codec.quantize_groups
    with pytest.raises(ValueError, match="expected one of"):
        get("no_such_op", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if fp8.triton_version() is None or fp8.triton_version() < fp8.TRITON_MIN:
        pytest.skip("no usable Triton")
    for op in OPS:
        twins, launchers = get(op, CPU, "torch"), get(op, CPU, "triton")
        assert type(twins) is type(launchers) and twins != launchers, op


@pytest.mark.parametrize("threshold,cap,fp8_hw", [((8, 9), (8, 9), True), ((8, 9), (8, 6), False),
                                                  ((9, 0), (8, 9), False), ((9, 0), (9, 0), True)])
def test_one_capability_threshold(monkeypatch, threshold, cap, fp8_hw):
    """The kernels' FP8 conversions and the layer's FP8 GEMMs follow the one threshold."""
    monkeypatch.setattr(fp8, "FP8_CAPABILITY", threshold)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
    monkeypatch.setattr(fp8, "_ISA", {})
    monkeypatch.setattr(fp8, "_forced", [None])
    monkeypatch.delenv(fp8.FP8_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert fp8_gemm_available(cuda) is fp8_hw
    assert (fp8.kernel_isa(cuda) == fp8.ISA_NVIDIA_FP8) is fp8_hw
