"""A group skipped for a non-finite gradient does not advance its own step: its bias
correction uses the tensor's step minus the steps it skipped, on every path (reference,
Triton, host chunks) and through every state conversion."""
import copy

import pytest
import torch

from coat_ds import CoatAdamW
from coat_ds.kernels import AdamWHyper, AdamWSlot, get, group_layout, host, reference as R
from coat_ds.config import OptimStateConfig
from coat_ds.optim.moment import Fp8Moment

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01
SHAPE = (2, 256)  # four groups of 128
BAD = (1, slice(0, 128))  # row 1, first group
BAD_STEPS = {1, 2, 3}
STEPS = 7


def _grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(SHAPE, generator=gen) * 0.1 for _ in range(STEPS)]
    for i in BAD_STEPS:
        grads[i - 1][1, 5] = float("nan")
    return grads


def _torch_adamw_skipping(p0: torch.Tensor, grads) -> tuple[torch.Tensor, torch.optim.AdamW]:
    """torch AdamW where the bad group's elements simply skip the steps with NaN gradients
    (their own step count), every other element steps every time."""
    bad = torch.zeros(SHAPE, dtype=torch.bool)
    bad[BAD] = True
    good_p = torch.nn.Parameter(p0[~bad].clone())
    bad_p = torch.nn.Parameter(p0[bad].clone())
    opt_good = torch.optim.AdamW([good_p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt_bad = torch.optim.AdamW([bad_p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for g in grads:
        good_p.grad = g[~bad].clone()
        opt_good.step()
        if torch.isfinite(g[bad]).all():
            bad_p.grad = g[bad].clone()
            opt_bad.step()
    out = torch.empty(SHAPE)
    out[~bad], out[bad] = good_p.detach(), bad_p.detach()
    return out, opt_bad


def _coat(p0, grads, backend, quantized):
    p = torch.nn.Parameter(p0.clone())
    opt = CoatAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend,
                    min_quant_numel=1 if quantized else 10**9)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_skipped_group_matches_torch_adamw_with_its_own_step_fp32_moments(backend):
    p0 = torch.randn(SHAPE)
    grads = _grads()
    want, _ = _torch_adamw_skipping(p0, grads)
    p, opt = _coat(p0, grads, backend, quantized=False)
    assert opt.state[p]["group_skips"].tolist() == [[0, 0], [len(BAD_STEPS), 0]]
    # FP32 moments: the only differences are float32 roundings (and, for the skipped group,
    # its bias correction computed in float32 from exp2(n * log2(beta))).
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=2e-6)


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_skipped_group_matches_torch_adamw_with_its_own_step_fp8_moments(backend):
    p0 = torch.randn(SHAPE)
    grads = _grads(1)
    want, _ = _torch_adamw_skipping(p0, grads)
    p, _ = _coat(p0, grads, backend, quantized=True)
    # Per-element step change against torch's: FP8 moments cost a few percent of an
    # update; the tensor's step count instead of the group's put the first updates of the
    # skipped group ~40 % off (0.58 lr instead of lr at its own step 1).
    moved = (want - p0)[BAD]
    err = ((p.detach() - want)[BAD]).abs()
    assert (err / moved.abs().mean()).max().item() < 0.1, (err / moved.abs().mean()).max()
    rest = torch.ones(SHAPE, dtype=torch.bool)
    rest[BAD] = False
    assert ((p.detach() - want)[rest].abs() / (want - p0)[rest].abs().mean()).max().item() < 0.1


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_nonfinite_global_norm_skips_the_whole_step_like_no_step(backend, device):
    """skip_steps_by_global_norm: a step whose global norm is inf or NaN leaves every
    parameter and moment as if step() had not been called (each group counts the skip and
    is bias-corrected at its own step); finite or unknown (None) norms change nothing."""
    torch.manual_seed(0)
    p0 = torch.randn(SHAPE, device=device)
    grads = [torch.randn(SHAPE, device=device) * 0.1 for _ in range(4)]
    for value in (float("inf"), float("nan")):
        plain, _ = _coat(p0, grads[:1] + grads[2:], backend, quantized=True)  # never sees grads[1]
        p = torch.nn.Parameter(p0.clone())
        opt = CoatAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend, min_quant_numel=1)
        norms = iter([torch.tensor(1.0, device=device), torch.tensor(value, device=device), None,
                      torch.tensor(2.0, device=device)])
        opt.skip_steps_by_global_norm(lambda: next(norms))
        for i, g in enumerate(grads):
            p.grad = g.clone()
            opt.step()
            if i == 1:
                assert opt.nonfinite_groups() == 4, value
                assert opt.state[p]["group_skips"].tolist() == [[1, 1], [1, 1]]
        # The kernels bias-correct a group that skipped in float32, the host in float64.
        torch.testing.assert_close(p.detach(), plain.detach(), rtol=0, atol=1e-6)
    copied = copy.deepcopy(opt)
    assert copied._global_norm is None  # a copy is not tied to the engine that computes the norm
    with pytest.raises(TypeError, match="callable"):
        opt.skip_steps_by_global_norm(1.0)
    backward = CoatAdamW([torch.nn.Parameter(torch.zeros(4))], step_in_backward=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        backward.skip_steps_by_global_norm(lambda: None)


def _slot(seed, skips):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(3, 300, generator=gen)
    g = torch.randn(3, 300, generator=gen) * 1e-2
    g[0, 200] = float("inf")  # row 0, group 1: skipped this step
    m = R.quantize_groups(torch.randn(3, 300, generator=gen) * 1e-2)
    v = R.quantize_groups(torch.rand(3, 300, generator=gen) * 1e-4 + 1e-8)
    return AdamWSlot(p, g, m, v, skips)


def test_triton_step_reads_and_writes_group_skips_like_the_reference():
    skips = torch.tensor([[0, 5, 2], [1, 0, 8], [7, 3, 0]], dtype=torch.int32)
    a, b = _slot(0, skips.clone()), _slot(0, skips.clone())
    hyper = AdamWHyper.at_step(9, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    before = a.param.clone()
    count_a, count_b = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    get("adamw", torch.device("cpu"), "triton").step([a], hyper, skipped=count_a, plan_cache={})
    R.adamw_step([b], hyper, skipped=count_b)
    want = skips.clone()
    want[0, 1] += 1
    assert torch.equal(a.skips, want) and torch.equal(b.skips, want)
    assert count_a.item() == count_b.item() == 1
    torch.testing.assert_close(a.param, b.param, rtol=0, atol=1e-6)
    # Groups that skipped before take larger steps than they would at the tensor's step.
    plain = _slot(0, None)
    R.adamw_step([plain], hyper)
    d_skip = (b.param - before).abs().view(3, 300)[2, :128].mean()
    d_plain = (plain.param - before).abs().view(3, 300)[2, :128].mean()
    assert d_skip > 1.2 * d_plain


def test_host_chunks_carry_group_skips():
    skips = torch.randint(0, 5, (3, 3), dtype=torch.int32)
    a, b = _slot(2, skips.clone()), _slot(2, skips.clone())
    hyper = AdamWHyper.at_step(9, 1e-3, 0.9, 0.999, 1e-8, 0.01)
    host.host_step([a], hyper, chunk_elems=128)
    R.adamw_step([b], hyper)
    assert torch.equal(a.param, b.param) and torch.equal(a.skips, b.skips)
    assert a.skips[0, 1] == skips[0, 1] + 1


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
def test_state_dict_round_trip_and_older_state_dicts():
    p0, grads = torch.randn(SHAPE), _grads(2)
    p, opt = _coat(p0, grads[:4], "torch", quantized=True)
    sd = opt.state_dict()
    assert sd["state"][0]["group_skips"].dtype == torch.int32
    assert sd["state"][0]["group_skips"].tolist() == [[0, 0], [3, 0]]
    q = torch.nn.Parameter(torch.zeros(SHAPE))
    other = CoatAdamW([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_quant_numel=1)
    other.load_state_dict(copy.deepcopy(sd))
    assert torch.equal(other.state[q]["group_skips"], sd["state"][0]["group_skips"])
    clone = copy.deepcopy(opt)
    assert torch.equal(clone.state[clone.param_groups[0]["params"][0]]["group_skips"], opt.state[p]["group_skips"])
    # A state dict saved before groups counted skips loads with none skipped.
    old = copy.deepcopy(sd)
    del old["state"][0]["group_skips"]
    other.load_state_dict(old)
    assert other.state[q]["group_skips"].tolist() == [[0, 0], [0, 0]]
    q.grad = grads[4].clone()
    other.step()
    assert torch.isfinite(q).all()
    for bad, why in ((sd["state"][0]["group_skips"].short(), "dtype"), (torch.zeros(2, 3, dtype=torch.int32), "shape"),
                     (torch.full((2, 2), 5, dtype=torch.int32), "outside")):
        broken = copy.deepcopy(sd)
        broken["state"][0]["group_skips"] = bad
        kept = copy.deepcopy(other.state[q])
        with pytest.raises(ValueError, match=f"group_skips.*{why}"):
            other.load_state_dict(broken)
        assert torch.equal(other.state[q]["group_skips"], kept["group_skips"])


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
def test_fp32_export_folds_skips_into_the_moments():
    p0, grads = torch.randn(SHAPE), _grads(3)
    _, torch_bad = _torch_adamw_skipping(p0, grads)
    p, opt = _coat(p0, grads, "torch", quantized=False)
    exported = opt.fp32_state_dict()["state"][0]
    assert "group_skips" not in exported
    t = float(exported["step"])
    own = torch_bad.state[torch_bad.param_groups[0]["params"][0]]
    n = float(own["step"])
    assert n == t - len(BAD_STEPS)
    # torch's bias correction at the tensor's step, on the exported moments, gives the
    # group's own bias-corrected moments.
    for name, beta in (("exp_avg", BETAS[0]), ("exp_avg_sq", BETAS[1])):
        got = exported[name][BAD] / (1 - beta**t)
        want = own[name] / (1 - beta**n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # Loaded back (as from torch's AdamW), no group has skipped a step.
    q = torch.nn.Parameter(p.detach().clone())
    back = CoatAdamW([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_quant_numel=10**9)
    back.load_fp32_state_dict(opt.fp32_state_dict())
    assert not back.state[q]["group_skips"].any()


def test_state_bytes_count_the_skip_counters():
    p = torch.nn.Parameter(torch.randn(4, 1024))
    opt = CoatAdamW([p], min_quant_numel=1)
    p.grad = torch.randn_like(p)
    opt.step()
    lay = group_layout(p.shape, 128)
    assert opt.state[p]["group_skips"].shape == lay.meta_shape
    assert opt.state_bytes()["bytes_per_param"] == pytest.approx(2 + 2 * 6 / 128 + 4 / 128)


@pytest.mark.filterwarnings("ignore:CoatAdamW skipped")
def test_deepspeed_fp32_converter_folds_skips_like_fp32_state_dict():
    from coat_ds.integrations.deepspeed.checkpoint import _fp32_moments

    # A flat ZeRO-1/2 partition (one row), its second group skipped on two steps.
    flat = torch.nn.Parameter(torch.randn(300))
    opt = CoatAdamW([flat], lr=LR, betas=(0.8, 0.99), min_quant_numel=1)
    for i in range(4):
        flat.grad = torch.randn(300) * 0.1
        if i < 2:
            flat.grad[200] = float("nan")
        opt.step()
    assert opt.state[flat]["group_skips"].tolist() == [[0, 2, 0]]
    moments, steps = _fp32_moments(opt.state_dict(), [290])  # the partition's padding cut off
    want = opt.fp32_state_dict()["state"][0]
    assert steps == {4.0}
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(moments[name][0], want[name][:290])
    # Only the skipped group's exported moments differ from the stored ones.
    raw = Fp8Moment.from_state(opt.state[flat], "exp_avg_sq", OptimStateConfig(min_quant_numel=1)).to_fp32()
    assert torch.equal(moments["exp_avg_sq"][0][:128], raw[:128])
    assert not torch.allclose(moments["exp_avg_sq"][0][128:256], raw[128:256])
