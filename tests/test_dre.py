"""Dynamic Range Expansion on real AdamW moments: it must cut the error of m / sqrt(v)."""
import pytest
import torch

from coat_ds.kernels import AdamWHyper, AdamWSlot, QuantizedGroups, get, get_format, host, host_native
from coat_ds.kernels import reference as R


@pytest.fixture(scope="module")
def real_moments():
    """First and second moments of torch.optim.AdamW after 30 steps of a small model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 256, (256, 16)), torch.randint(0, 256, (256,))
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    big = [p for p in model.parameters() if p.numel() >= 4096]
    m = torch.cat([opt.state[p]["exp_avg"].flatten() for p in big])
    v = torch.cat([opt.state[p]["exp_avg_sq"].flatten() for p in big])
    assert (m != 0).float().mean() > 0.99
    return m, v


TWIN = get("group_codec", torch.device("cpu"), "torch")


def _update_mse(m, v, codec, fmt_m, dre_m, fmt_v, dre_v, eps=1e-8):
    mq = codec.dequantize(codec.quantize(m, 128, fmt_m, dre_m), 128, fmt_m)
    vq = codec.dequantize(codec.quantize(v, 128, fmt_v, dre_v), 128, fmt_v)
    ref = m / (v.sqrt() + eps)
    return ((mq / (vq.sqrt() + eps) - ref) ** 2).mean().item()


def test_dre_cuts_update_error_at_least_1_6x(real_moments):
    """The paper reports ~1.6x lower MSE of m/sqrt(v) with DRE (E4M3/E4M3); we measure
    2.7x on these moments (tests/test_dre.py, reference path)."""
    m, v = real_moments
    plain = _update_mse(m, v, TWIN, "e4m3", False, "e4m3", False)
    dre = _update_mse(m, v, TWIN, "e4m3", True, "e4m3", True)
    assert plain / dre >= 1.6, (plain, dre)


def test_format_ranking_matches_paper(real_moments):
    """E4M3+DRE for both moments beats every plain combination, and E5M2 first moments
    are the worst (the paper's Table 1 ordering)."""
    m, v = real_moments
    err = {(fm, dm, fv, dv): _update_mse(m, v, TWIN, fm, dm, fv, dv)
           for fm in ("e4m3", "e5m2") for dm in (False, True) for fv in ("e4m3", "e5m2") for dv in (False, True)}
    best = err[("e4m3", True, "e4m3", True)]
    assert all(best < e for k, e in err.items() if not (k[1] or k[3]))
    assert err[("e5m2", False, "e5m2", False)] == max(e for k, e in err.items() if not (k[1] or k[3]))
    assert err[("e4m3", False, "e4m3", False)] < err[("e4m3", False, "e5m2", False)]


def test_dre_never_flushes_second_moments(real_moments):
    _, v = real_moments
    d = R.dequantize_groups(R.quantize_groups(v, 128, "e4m3", True), 128, "e4m3")
    assert ((d == 0) & (v != 0)).sum() == 0


def test_triton_dre_error_matches_reference(real_moments, device):
    """The Triton kernels (interpreted on CPU, on a 64k-element slice) give the same error."""
    m, v = (t[:65536].to(device) for t in real_moments)
    e_tri = _update_mse(m, v, get("group_codec", device, "triton"), "e4m3", True, "e4m3", True)
    e_ref = _update_mse(m.cpu(), v.cpu(), TWIN, "e4m3", True, "e4m3", True)
    assert abs(e_tri - e_ref) <= 0.05 * e_ref


def _wide_groups(decades: float, n: int = 64, seed: int = 0) -> torch.Tensor:
    """Groups of 128 log-uniform magnitudes spanning exactly `decades` decades, random signs
    (flat ZeRO partitions put moments of unrelated parameters into one group)."""
    g = torch.Generator().manual_seed(seed)
    top = 37.0 if decades > 37 else 0.0
    e = torch.rand(n, 128, generator=g, dtype=torch.float64) * decades + (top - decades)
    e[:, 0], e[:, 1] = top, top - decades
    sign = torch.where(torch.rand(n, 128, generator=g) < 0.5, -1.0, 1.0)
    return (10.0 ** e).float() * sign


@pytest.mark.parametrize("decades", [16, 40, 75])
def test_wide_groups_keep_their_top_decades_within_30_percent(decades, device):
    """k >= 1/4: in a group spanning 16 decades or more, however wide, every element within
    16 decades of its max keeps its relative error under 30 % (E4M3; k = 1/16 gave 150 % on
    every element of a group spanning 40+ decades); smaller elements are never 0, never inf,
    and keep their sign. Narrower groups: test_error_bound_over_every_span."""
    x = _wide_groups(decades)
    for codec in (get("group_codec", device, "torch"), get("group_codec", device, "triton")):
        d = codec.dequantize(codec.quantize(x.to(device), 128, "e4m3", True), 128, "e4m3").cpu()
        rel = (d - x).abs() / x.abs()
        top = x.abs() >= x.abs().amax(-1, keepdim=True) * 1e-16
        assert rel[top].max().item() < 0.30, (codec, rel[top].max())
        assert torch.isfinite(d).all() and (d != 0).all() and (torch.sign(d) == torch.sign(x)).all()


# ---- The error bound of docs/optimizer.md, over every group span up to 16 decades ----------
#
# x' / x = (y' / y) ** (1/k), y' being FP8's rounding of the mapped value y (after the scale).
# Where y is normal, y' / y lies within 1 -+ 1/17 (E4M3; E5M2: 1/9); DRE's target range lets
# a group's smallest y into FP8's subnormals, down to twice the smallest one, and there
# y' / y lies within [0.8, 1.2] (2.5 units round to 2, a bit more to 3).
_HALF_STEP = {"e4m3": 1 / 17, "e5m2": 1 / 9}
_SUB_HALF_STEP = 0.2
_SPANS = [i / 10 for i in range(5, 161)]  # 0.5 to 16 decades, steps of 0.1


def _span_sweep(per_span: int = 4, seed: int = 0) -> torch.Tensor:
    """`per_span` groups of 128 for every span: the max, the min, 16 magnitudes within 0.6
    decades above the min (where y reaches the subnormals), the rest log-uniform, random
    signs, each group at its own magnitude."""
    g = torch.Generator().manual_seed(seed)
    span = torch.tensor(_SPANS, dtype=torch.float64).repeat_interleave(per_span)[:, None]
    e = -torch.rand(span.shape[0], 128, generator=g, dtype=torch.float64) * span
    e[:, 0], e[:, 1] = 0.0, -span[:, 0]
    e[:, 2:18] = -span + torch.rand(span.shape[0], 16, generator=g, dtype=torch.float64) * span.clamp(max=0.6)
    e = e + torch.empty(span.shape[0], 1, dtype=torch.float64).uniform_(-8, 4, generator=g)
    sign = torch.where(torch.rand(e.shape, generator=g) < 0.5, -1.0, 1.0)
    return (10.0**e).float() * sign


def _host_quantize(x: torch.Tensor, fmt: str) -> QuantizedGroups:
    """The host kernel's quantizer, seen through its AdamW step: beta1 = 0 makes the new
    first moment the gradient itself."""
    zeros = R.quantize_groups(torch.zeros_like(x), fmt=fmt)
    slot = AdamWSlot(torch.zeros_like(x), x.clone(), zeros, R.quantize_groups(torch.zeros_like(x), fmt=fmt))
    hyper = AdamWHyper(lr=1.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, step_size=1.0,
                       bias_correction2_sqrt=1.0, step=1.0)
    host.host_step([slot], hyper, fmt_m=fmt, fmt_v=fmt, dre=True)
    return slot.exp_avg


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("impl", ["torch", "triton", "host"])
def test_error_bound_over_every_span(fmt, impl, device):
    """docs/optimizer.md's bound, element by element, on every span from 0.5 to 16 decades:
    |x' / x - 1| <= max((1 + h) ** (1/k) - 1, 1 - (1 - h) ** (1/k)) with the group's own k
    and h as above by where y fell; y never below twice the smallest subnormal; at most 80 %
    (E4M3) and 39 % (E5M2) in all. The sweep does reach subnormal y (E4M3 over 60 %: the
    26 % docs/optimizer.md once promised for every element within 16 decades was false)."""
    f = get_format(fmt)
    x = _span_sweep()
    if impl == "host":
        if host_native.library() is None:
            pytest.skip("the host kernel did not build here")
        q = _host_quantize(x, fmt)
    else:
        codec = get("group_codec", device, "torch" if impl == "torch" else "triton")
        q = QuantizedGroups(*(t.cpu() for t in codec.quantize(x.to(device), 128, fmt, True)))
    d = R.dequantize_groups(q, 128, fmt)
    rel = ((d.double() - x.double()).abs() / x.double().abs())
    k = q.kcode.double() / 16
    # Where y fell: the group's own centre, k and scale applied to x, in float64.
    y = (x.double().abs() / q.center.double()) ** k * torch.exp2(-q.sexp.double())
    min_normal = 2.0**f.min_normal_exp
    assert (y >= 2 * f.min_subnormal * (1 - 1e-5)).all()
    h = torch.where(y >= min_normal * (1 - 1e-5), _HALF_STEP[fmt], _SUB_HALF_STEP)
    bound = torch.maximum((1 + h) ** (1 / k) - 1, 1 - (1 - h) ** (1 / k))
    assert (rel <= bound * (1 + 1e-4) + 1e-6).all(), (rel - bound).max()
    assert rel.max() <= (0.80 if fmt == "e4m3" else 0.39), rel.max()
    if fmt == "e4m3":
        assert rel.max() > 0.6, rel.max()
