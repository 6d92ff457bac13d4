"""Dynamic Range Expansion on real AdamW moments: it must cut the error of m / sqrt(v)."""
import pytest
import torch

from coat_ds.kernels import get_ops, reference as R


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


def _update_mse(m, v, ops, fmt_m, dre_m, fmt_v, dre_v, eps=1e-8):
    mq = ops.dequantize_groups(ops.quantize_groups(m, 128, fmt_m, dre_m), 128, fmt_m)
    vq = ops.dequantize_groups(ops.quantize_groups(v, 128, fmt_v, dre_v), 128, fmt_v)
    ref = m / (v.sqrt() + eps)
    return ((mq / (vq.sqrt() + eps) - ref) ** 2).mean().item()


def test_dre_cuts_update_error_at_least_1_6x(real_moments):
    """The paper reports ~1.6x lower MSE of m/sqrt(v) with DRE (E4M3/E4M3); we measure
    2.7x on these moments (tests/test_dre.py, reference path)."""
    m, v = real_moments
    plain = _update_mse(m, v, R, "e4m3", False, "e4m3", False)
    dre = _update_mse(m, v, R, "e4m3", True, "e4m3", True)
    assert plain / dre >= 1.6, (plain, dre)


def test_format_ranking_matches_paper(real_moments):
    """E4M3+DRE for both moments beats every plain combination, and E5M2 first moments
    are the worst (the paper's Table 1 ordering)."""
    m, v = real_moments
    err = {(fm, dm, fv, dv): _update_mse(m, v, R, fm, dm, fv, dv)
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
    tri = get_ops(device, "triton")
    e_tri = _update_mse(m, v, tri, "e4m3", True, "e4m3", True)
    e_ref = _update_mse(m.cpu(), v.cpu(), R, "e4m3", True, "e4m3", True)
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
    """k >= 1/4: every element within 16 decades of its group's max keeps its relative error
    under 30 % (E4M3), however wide the group (k = 1/16 gave 150 % on every element of a group
    spanning 40+ decades); smaller elements are never 0, never inf, and keep their sign."""
    x = _wide_groups(decades)
    for ops in (R, get_ops(device, "triton")):
        d = ops.dequantize_groups(ops.quantize_groups(x.to(device), 128, "e4m3", True), 128, "e4m3").cpu()
        rel = (d - x).abs() / x.abs()
        top = x.abs() >= x.abs().amax(-1, keepdim=True) * 1e-16
        assert rel[top].max().item() < 0.30, (ops, rel[top].max())
        assert torch.isfinite(d).all() and (d != 0).all() and (torch.sign(d) == torch.sign(x)).all()
