"""CoatAdamW(master_weights="bf16+16" / "bf16+8"): a BF16 parameter plus a remainder in the
state. "bf16+16" keeps the FP32 master bit for bit: every step equals master_weights="fp32"'s
on the same gradients, through the torch twin, the host (C++) step and the Triton kernel
(interpreted on CPU); "bf16+8" keeps a 24-bit master, within its stated error bound. The BF16
parameter is always the master rounded to BF16, to nearest with ties away from zero."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import coat_ds
from coat_ds.kernels import AdamWHyper, AdamWSlot, host, host_native
from coat_ds.kernels import master as M
from coat_ds.kernels import reference as R
from helpers import bound

FLT_MAX = torch.finfo(torch.float32).max
OPT = dict(lr=1e-2, weight_decay=0.1, min_quant_numel=1000, group_size=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _values(seed: int = 0) -> torch.Tensor:
    """Random magnitudes over the whole float32 range, and the adversarial ones: BF16 rounding
    midpoints and one float32 step either side (low 16 bits 0x7FFF, 0x8000, 0x8001), the
    24-bit format's midpoints (low 8 bits 0x7F, 0x80, 0x81), zeros, subnormals, the smallest
    and largest floats, infinities, both signs."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 31, (20000,), generator=g, dtype=torch.int64)
    bits = bits[(bits >> 23 & 0xFF) != 0xFF]  # finite
    hi = bits & ~0xFFFF
    mids = torch.cat([hi | 0x7FFF, hi | 0x8000, hi | 0x8001, (bits & ~0xFF) | 0x7F, (bits & ~0xFF) | 0x80,
                      (bits & ~0xFF) | 0x81])
    special = torch.tensor([0, 1, 2, 0x7FFF, 0x8000, 0x807FFFFF & 0x7FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7F8000,
                            0x7F7FFF80, 0x7F7FFF7F, 0x7F800000], dtype=torch.int64)
    magn = torch.cat([bits, mids, special])
    signed = torch.cat([magn, magn | 0x80000000])
    return ((signed ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)


def _ties_away_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to BF16 to nearest, ties away from zero, as BF16 bits (int16)."""
    b = _bits(x).to(torch.int64) & 0xFFFFFFFF
    return ((((b + 0x8000) >> 16) ^ 0x8000) - 0x8000).to(torch.int16)


def test_16_bit_remainder_is_exact_and_its_bf16_is_the_master_rounded():
    x = _values()
    hi, rem = M.split(x, 16)
    assert hi.dtype == torch.bfloat16 and rem.dtype == torch.int16
    assert torch.equal(_bits(M.join(hi, rem)), _bits(x))
    assert torch.equal(_bits(hi), _ties_away_bf16(x))
    # Torch's cast (ties to even) agrees everywhere but at exact ties, where ours rounds away.
    tie = (_bits(x) & 0xFFFF) == 0x8000
    assert torch.equal(_bits(hi)[~tie], _bits(x.to(torch.bfloat16))[~tie])
    assert bool((hi[tie].float().abs() >= x[tie].abs()).all())


def test_8_bit_remainder_error_bound():
    """The documented bound: relative error <= 2**-16 for normal values (2**-15 within half a
    24-bit step of the largest float, where rounding would carry into inf and truncates
    instead), absolute <= 2**-142 for subnormals, zeros and signs exact, finite stays finite."""
    x = _values(1)
    hi, rem = M.split(x, 8)
    y = M.join(hi, rem)
    assert rem.dtype == torch.int8
    finite = torch.isfinite(x)
    assert torch.equal(_bits(y[~finite]), _bits(x[~finite]))
    assert bool(torch.isfinite(y[finite]).all())
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    assert torch.equal(_bits(y[x == 0]), _bits(x[x == 0]))
    err = (y.double() - x.double()).abs()
    normal = finite & (x.abs() >= torch.finfo(torch.float32).tiny)
    top = x.abs() > float.fromhex("0x1.fffeffp+127")  # above the largest 24-bit float's midpoint
    rel = err[normal] / x[normal].double().abs()
    assert rel[~top[normal]].max().item() <= 2.0**-16
    assert rel[top[normal]].max().item() <= 2.0**-15
    assert err[finite & ~normal].max().item() <= 2.0**-142
    assert rel.max().item() > 2.0**-16 * 0.99  # the midpoints reach the bound: the test can fail
    # Values with at most 15 mantissa bits are exact; the BF16 value is the 24-bit master rounded.
    short = (_bits(x) & 0xFF) == 0
    assert torch.equal(_bits(y[short & finite]), _bits(x[short & finite]))
    assert torch.equal(_bits(hi), _ties_away_bf16(y))


# -- the step kernels, slot by slot ------------------------------------------------------------


def _slot(bits: int, quant: bool, device: torch.device, seed: int = 3) -> AdamWSlot:
    g = torch.Generator().manual_seed(seed)
    shape = (4, 160)  # a short last group in every row
    p = torch.randn(shape, generator=g) * 0.02
    m, v = torch.zeros(shape), torch.zeros(shape)
    if quant:
        m, v = R.quantize_groups(m, 64), R.quantize_groups(v, 64)
    skips = torch.zeros(4, 3, dtype=torch.int32)
    if not bits:
        slot = AdamWSlot(p, torch.zeros(shape), m, v, skips)
    else:
        hi, rem = M.split(p, bits)
        slot = AdamWSlot(hi, torch.zeros(shape, dtype=torch.bfloat16), m, v, skips, rem)
    return AdamWSlot(*(None if t is None else t.to(device) for t in slot))


def _steps(step_fn, slot: AdamWSlot, steps: int = 3, after=None) -> list[torch.Tensor]:
    """FP32 masters after each of `steps` steps on fixed BF16 gradients (one NaN: a skipped group)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(1, steps + 1):
        grad = (torch.randn(slot.param.shape, generator=g) * 1e-3).to(torch.bfloat16).to(slot.param.device)
        if step == 2:
            grad[1, 7] = float("nan")
        slot = slot._replace(grad=grad if slot.remainder is not None else grad.float())
        step_fn([slot], AdamWHyper.at_step(step, 1e-2, 0.9, 0.999, 1e-8, 0.1), group_size=64)
        out.append(slot.param.clone() if slot.remainder is None else M.join(slot.param, slot.remainder))
        if after is not None:
            after(slot, out[-1])
    return out


CPU = torch.device("cpu")
# The Triton kernel compiled on a GPU, interpreted on CPU (TRITON_INTERPRET=1, conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _paths():
    paths = [("twin", R.adamw_step, CPU),
             ("host-chunked", lambda *a, **k: host.host_step(*a, **k, chunk_elems=256, fused=False), CPU)]
    if host_native.library() is not None:
        paths.append(("host", host.host_step, CPU))
    paths.append(("triton", lambda *a, **k: bound("adamw").TRITON.step(*a, **k), TRITON_DEVICE))
    return paths


@pytest.mark.parametrize("quant", [True, False], ids=["fp8-moments", "fp32-moments"])
@pytest.mark.parametrize("path", _paths(), ids=lambda p: p[0])
def test_step_bf16_plus_16_is_the_fp32_step_bit_for_bit(path, quant):
    _, step_fn, device = path
    ref = _steps(step_fn, _slot(0, quant, device))

    def bf16_is_rounded_master(slot, master):
        assert torch.equal(_bits(slot.param), _ties_away_bf16(master))

    got = _steps(step_fn, _slot(16, quant, device), after=bf16_is_rounded_master)
    for a, b in zip(ref, got):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p[0])
def test_step_bf16_plus_8_is_the_fp32_step_of_its_master_rounded(path):
    """One step of "bf16+8" = the FP32 step from its 24-bit master, then `split(., 8)`."""
    _, step_fn, device = path
    slot = _slot(8, True, device)
    g = torch.Generator().manual_seed(7)
    for step in range(1, 4):
        grad = (torch.randn(slot.param.shape, generator=g) * 1e-3).to(torch.bfloat16).to(device)
        hyper = AdamWHyper.at_step(step, 1e-2, 0.9, 0.999, 1e-8, 0.1)
        ref = copy.deepcopy(slot)._replace(grad=grad.float(), remainder=None)
        ref = ref._replace(param=M.join(slot.param, slot.remainder))
        step_fn([ref], hyper, group_size=64)
        step_fn([slot._replace(grad=grad)], hyper, group_size=64)
        want_hi, want_rem = M.split(ref.param, 8)
        assert torch.equal(_bits(slot.param), _bits(want_hi)) and torch.equal(slot.remainder, want_rem)


# -- the optimizer ----------------------------------------------------------------------------


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 8))


def _grads(step: int, params) -> None:
    """The same BF16-valued gradients for every run, in each parameter's dtype."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(torch.bfloat16).to(p.dtype)


def _run(model, opt, steps: range) -> None:
    for s in steps:
        _grads(s, model.parameters())
        opt.step()
        opt.zero_grad()


def _assert_masters(opt, params, ref_params) -> None:
    for p, q in zip(params, ref_params):
        assert torch.equal(_bits(opt.fp32_master(p)), _bits(q.detach().float()))
        if p.dtype == torch.bfloat16:
            assert torch.equal(_bits(p.detach()), _ties_away_bf16(opt.fp32_master(p)))


def test_an_fp32_model_becomes_bf16_in_place_and_trains_as_fp32():
    ref, model = _model(), _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = coat_ds.CoatAdamW(model.parameters(), master_weights="bf16+16", **OPT)
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * len(params)  # same objects
    assert all(p.dtype == torch.bfloat16 for p in params)
    _assert_masters(opt, params, before)  # seeded from the FP32 values: nothing lost
    ref_opt = coat_ds.CoatAdamW(ref.parameters(), **OPT)
    _run(ref, ref_opt, range(3))
    _run(model, opt, range(3))
    _assert_masters(opt, params, list(ref.parameters()))
    assert ref_opt.fp32_master(next(ref.parameters())) is not None
    # The moments are the FP32 run's too.
    for p, q in zip(params, ref.parameters()):
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    rep, ref_rep = opt.state_bytes(), ref_opt.state_bytes()
    assert rep["state_bytes"] == ref_rep["state_bytes"]  # the remainder is counted under the master
    n = sum(p.numel() for p in params)
    assert rep["master_bytes"] == 4 * n and ref_rep["master_bytes"] == 4 * n
    model8 = _model()
    opt8 = coat_ds.CoatAdamW(model8.parameters(), master_weights="bf16+8", **OPT)
    assert opt8.state_bytes()["master_bytes"] == 3 * n


def test_options_are_checked_and_set_per_group():
    model = _model()
    with pytest.raises(ValueError, match=r"master_weights must be one of .*got 'bf16'"):
        coat_ds.CoatAdamW(model.parameters(), master_weights="bf16")
    weights = [model[0].weight, model[2].weight]
    opt = coat_ds.CoatAdamW([{"params": weights, "master_weights": "bf16+8"},
                             {"params": [model[0].bias, model[2].bias]}], **OPT)
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    with pytest.raises(ValueError, match="master_weights"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "master_weights": "fp16"})
    _run(model, opt, range(2))
    assert opt.state[weights[0]]["master_remainder"].dtype == torch.int8
    half = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt16 = coat_ds.CoatAdamW([half], master_weights="bf16+16")
    half.grad = torch.zeros_like(half)
    with pytest.raises(ValueError, match="master_weights='bf16\\+16'.*needs bfloat16 parameters.*float16"):
        opt16.step()
    plain = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    plain.grad = torch.zeros_like(plain)
    with pytest.raises(ValueError, match="needs float32 parameters.*master_weights='bf16\\+16'"):
        coat_ds.CoatAdamW([plain]).step()


def test_step_in_backward_with_bf16_master_equals_step():
    ref, model = _model(), _model()
    ref_opt = coat_ds.CoatAdamW(ref.parameters(), master_weights="bf16+16", **OPT)
    opt = coat_ds.CoatAdamW(model.parameters(), master_weights="bf16+16", step_in_backward=True, **OPT)
    for s in range(3):
        x = torch.randn(4, 48, generator=torch.Generator().manual_seed(s), dtype=torch.bfloat16)
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
    _assert_masters(opt, list(model.parameters()), [ref_opt.fp32_master(p) for p in ref.parameters()])


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("saved_as,loaded_as", [("bf16+16", "bf16+16"), ("fp32", "bf16+16"), ("bf16+16", "fp32"),
                                                ("bf16+8", "bf16+16"), ("bf16+16", "bf16+8")])
def test_checkpoints_convert_between_forms(saved_as, loaded_as):
    """Save after 2 steps (model state dict and optimizer state dict, through torch.save),
    resume in a fresh FP32 model whose optimizer is built after its weights are loaded, as a
    run resumes; then 2 more steps. Exact against the run that never stopped, except where a
    24-bit master is involved, which is exact against its own rounding."""
    model = _model()
    opt = coat_ds.CoatAdamW(model.parameters(), master_weights=saved_as, **OPT)
    _run(model, opt, range(2))
    model_sd, opt_sd = _saved(model.state_dict()), _saved(opt.state_dict())
    assert ("master_remainder" in opt_sd["state"][0]) == (saved_as != "fp32")
    masters = [opt.fp32_master(p).clone() for p in model.parameters()]

    resumed = _model(seed=1)
    resumed.load_state_dict(model_sd)  # an FP32 model: BF16 weights come in exactly
    opt2 = coat_ds.CoatAdamW(resumed.parameters(), master_weights=loaded_as, **OPT)
    opt2.load_state_dict(opt_sd)
    want = masters if loaded_as != "bf16+8" else [M.join(*M.split(m, 8)) for m in masters]
    _assert_masters(opt2, list(resumed.parameters()), want)
    if "bf16+8" in (saved_as, loaded_as):
        return
    _run(model, opt, range(2, 4))
    _run(resumed, opt2, range(2, 4))
    _assert_masters(opt2, list(resumed.parameters()), [opt.fp32_master(p) for p in model.parameters()])


def test_fp32_weights_loaded_after_the_optimizer_go_through_set_fp32_master():
    model = _model()
    opt = coat_ds.CoatAdamW(model.parameters(), **OPT)
    _run(model, opt, range(2))
    fp32_sd, opt_sd = {k: v.clone() for k, v in model.state_dict().items()}, _saved(opt.state_dict())
    resumed = _model(seed=1)
    opt2 = coat_ds.CoatAdamW(resumed.parameters(), master_weights="bf16+16", **OPT)
    resumed.load_state_dict(fp32_sd)  # rounded into the BF16 parameters
    opt2.load_state_dict(opt_sd)
    for name, p in resumed.named_parameters():
        opt2.set_fp32_master(p, fp32_sd[name])
    _assert_masters(opt2, list(resumed.parameters()), list(model.parameters()))
    _run(model, opt, range(2, 4))
    _run(resumed, opt2, range(2, 4))
    _assert_masters(opt2, list(resumed.parameters()), list(model.parameters()))


def test_fp32_state_dict_keeps_the_remainder_and_a_remainder_needs_bf16_weights():
    model = _model()
    opt = coat_ds.CoatAdamW(model.parameters(), master_weights="bf16+16", **OPT)
    _run(model, opt, range(2))
    fp32 = _saved(opt.fp32_state_dict())
    assert fp32["state"][0]["exp_avg"].dtype == torch.float32
    assert fp32["state"][0]["master_remainder"].dtype == torch.int16
    masters = [opt.fp32_master(p).clone() for p in model.parameters()]
    model2 = _model(seed=1)
    model2.load_state_dict(model.state_dict())
    opt2 = coat_ds.CoatAdamW(model2.parameters(), master_weights="bf16+16", **OPT)
    opt2.load_fp32_state_dict(fp32)
    _assert_masters(opt2, list(model2.parameters()), masters)
    # An FP32 model that was not given the saved BF16 weights cannot take the remainders.
    opt3 = coat_ds.CoatAdamW(_model(seed=2).parameters(), **OPT)
    with pytest.raises(ValueError, match="does not hold a BF16 value; load the model's weights"):
        opt3.load_state_dict(opt.state_dict())
