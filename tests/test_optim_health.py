"""coat_ds.optim.health and train.py's health line: the largest |weight| and the moments'
distance to Adam's bound, on CoatAdamW (FP8 and FP32 moments) and torch AdamW."""
from __future__ import annotations

import math

import pytest
import torch

from coat_ds.optim import CoatAdamW
from coat_ds.optim import health as H
from coat_ds.train.health_log import Health, param_names, read_health


def _trained(opt_cls, steps=20, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 300), torch.nn.Linear(300, 7))
    opt = opt_cls(model.parameters(), lr=1e-3, betas=(0.9, 0.95), **kw)
    for _ in range(steps):
        for p in model.parameters():  # six decades within a row, fresh each step
            p.grad = torch.randn_like(p) * 10 ** torch.empty_like(p).uniform_(-6, 0)
        opt.step()
    return model, opt


@pytest.mark.parametrize("opt_cls", [CoatAdamW, torch.optim.AdamW])
def test_a_trained_state_is_within_the_bound(opt_cls):
    model, opt = _trained(opt_cls)
    params = H.stepped(opt)
    ratios, weights = H.moment_bound_ratios(opt, params), H.param_absmax(params)
    assert ratios.shape == weights.shape == (4,)
    assert 0.3 < ratios.max() <= (1.0 if opt_cls is torch.optim.AdamW else 2.0)
    expected = torch.stack([p.detach().abs().max() for p in model.parameters()])
    assert torch.equal(weights, expected)


def test_a_corrupted_moment_and_a_nan_weight_are_named():
    model, opt = _trained(CoatAdamW)
    weight = model[0].weight
    assert "exp_avg_center" in opt.state[weight]  # large enough for FP8 moments
    opt.state[weight]["exp_avg_center"][3, 1] *= 1e6  # one group's m a million times AdamW's
    with torch.no_grad():
        model[1].bias[2] = float("nan")
    params = H.stepped(opt)
    names = param_names(params, model)
    got = read_health(opt, params, names)
    assert got.ratio_of == "0.weight" and got.ratio > 1e4
    assert got.weight_of == "1.bias" and got.weight == math.inf
    assert "1.bias holds NaN or inf" in got.problem()
    assert "moment_bound_ratio_of" in got.metrics() and got.line().startswith("health: max |w| inf (1.bias)")
    corrupt = Health(1.0, "a", 50.0, "b")
    assert "optimizer moments of b are 50x Adam's bound" in corrupt.problem()
    assert Health(1.0, "a", 1.5, "b").problem() is None


def test_chunked_decoding_reads_every_group(monkeypatch):
    # Rows in several pieces, and one row longer than a piece (a flat partition).
    torch.manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(300, 517)), torch.nn.Parameter(torch.randn(5000))]
    opt = CoatAdamW(ps, lr=1e-3, betas=(0.9, 0.95))
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p) * 10 ** torch.empty_like(p).uniform_(-5, 0)
        opt.step()
    opt.state[ps[1]]["exp_avg_center"][0, -1] *= 1e3  # the last group of the long row
    whole = H.moment_bound_ratios(opt, H.stepped(opt))
    monkeypatch.setattr(H, "_CHUNK", 1000)
    assert torch.equal(H.moment_bound_ratios(opt, H.stepped(opt)), whole) and whole[1] > 100
