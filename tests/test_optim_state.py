"""The quantized moment as one object (`coat_ds.optim.moment.Fp8Moment`) and the per-parameter
state layout it reads and writes: flat checkpoint keys, dtypes and shapes, FP32 round trip."""
import pytest
import torch

from coat_ds import CoatAdamW
from coat_ds.config import OptimStateConfig
from coat_ds.optim import state as st
from coat_ds.optim.moment import MOMENTS, Fp8Moment
from helpers import moments_like, sqnr_db

# The checkpoint format: these keys, dtypes and per-group shapes (rows, ceil(cols / 128)).
FLAT = {"exp_avg_codes": torch.uint8, "exp_avg_center": torch.float32, "exp_avg_kcode": torch.uint8,
        "exp_avg_sexp": torch.int8, "exp_avg_sq_codes": torch.uint8, "exp_avg_sq_center": torch.float32,
        "exp_avg_sq_kcode": torch.uint8, "exp_avg_sq_sexp": torch.int8, "group_skips": torch.int32,
        "step": torch.float32}


@pytest.mark.parametrize("view", ["2d", "tail_groups", "flat"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp32_round_trip_within_the_quantizer_bound(view, fmt):
    cfg = OptimStateConfig(first_moment_format=fmt, second_moment_format=fmt, backend="torch")
    cut = {"2d": lambda t: t, "tail_groups": lambda t: t[:, :300].contiguous(), "flat": lambda t: t.reshape(-1)}[view]
    for name, x in zip(MOMENTS, map(cut, moments_like((64, 512), seed=7))):
        q = Fp8Moment.from_fp32(x, name, cfg)
        assert (q.fmt, q.group_size) == (fmt, 128) and q.groups.codes.shape == x.shape
        rows = x.shape[0] if x.dim() == 2 else 1
        assert q.groups.center.shape == (rows, -(-x.shape[-1] // 128))
        back = q.to_fp32()
        assert back.dtype == torch.float32 and back.shape == x.shape
        # DRE keeps every element's error relative, nothing flushes to zero (the quantizer's
        # bounds in tests/test_kernels.py, on the same data).
        rel = (back - x).abs() / x.abs()
        assert rel.max().item() < 0.35 and rel.mean().item() < 0.05, (name, rel.max(), rel.mean())
        assert sqnr_db(x, back) >= 20.0, name


def test_flat_keys_dtypes_and_shapes_unchanged():
    local = torch.empty(3, 300)
    state = st.init_state(local, True, OptimStateConfig())
    assert {k: t.dtype for k, t in state.items()} == FLAT
    for k, t in state.items():
        want = () if k == "step" else (3, 300) if k.endswith("codes") else (3, 3)
        assert tuple(t.shape) == want, k
    for name in MOMENTS:
        assert torch.equal(st.moment(state, name, OptimStateConfig()).to_fp32(), torch.zeros(3, 300))
    small = st.init_state(torch.empty(5), False, OptimStateConfig())
    assert sorted(small) == ["exp_avg", "exp_avg_sq", "group_skips", "step"] and not st.is_quantized(small)


def test_from_state_and_into_state_share_the_state_tensors():
    """No copies: the object and the kernels read the state's own tensors, and writing an
    object back puts its tensors under the same flat keys."""
    p = torch.nn.Parameter(torch.randn(4, 256))
    opt = CoatAdamW([p], min_quant_numel=1)
    p.grad = torch.randn_like(p)
    opt.step()
    state, cfg = opt.state[p], OptimStateConfig(min_quant_numel=1)
    for name, groups in zip(MOMENTS, st.kernel_moments(state, cfg)):
        moment = Fp8Moment.from_state(state, name, cfg)
        assert all(a is b for a, b in zip(moment.groups, groups))
        assert all(a is state[k] for a, k in zip(moment.groups, Fp8Moment.keys(name)))
        copy = {}
        moment.into_state(copy, name)
        assert list(copy) == list(Fp8Moment.keys(name)) and all(copy[k] is state[k] for k in copy)
    # The state's FP32 view is each object's decode.
    fp32 = opt.fp32_state_dict()["state"][0]
    for name in MOMENTS:
        assert torch.equal(fp32[name], Fp8Moment.from_state(state, name, cfg).to_fp32())
