"""The eager size limits: Fp8LinearConfig.eager_min_macs (an Fp8Linear call too small for FP8
to pay runs as nn.Linear) and ActivationConfig.eager_min_region_numel (a region called on an
input too small keeps its eagerly saved tensors exact). On CPU both default to 0, so these
tests set them; the CUDA defaults are checked on a GPU."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coat_ds
from coat_ds import ActivationConfig, Fp8LinearConfig, compress_activations, convert_to_fp8_linear
from coat_ds.activation import api
from coat_ds.linear import layer
from helpers import sqnr_db

IN, OUT, TOKENS = 64, 96, 2 * 24  # one call's multiply-adds: TOKENS * IN * OUT
MACS = TOKENS * IN * OUT


@pytest.mark.parametrize("cls,field", [(Fp8LinearConfig, "eager_min_macs"),
                                       (ActivationConfig, "eager_min_region_numel")])
def test_configs_take_none_or_a_size_and_name_a_bad_value(cls, field):
    for good in (None, 0, 5, 2 ** 40):
        assert getattr(cls(**{field: good}), field) == good
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(ValueError, match=field):
            cls(**{field: bad})


def test_defaults_apply_on_cuda_only_and_a_given_limit_everywhere():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert layer.eager_min_macs(Fp8LinearConfig(), cuda) == layer.CUDA_EAGER_MIN_MACS
    assert layer.eager_min_macs(Fp8LinearConfig(), cpu) == 0
    assert layer.eager_min_macs(Fp8LinearConfig(eager_min_macs=7), cpu) == 7
    assert layer.eager_min_macs(Fp8LinearConfig(eager_min_macs=0), cuda) == 0


def _pair(limit, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(IN, OUT)
    m = nn.Linear(IN, OUT)
    m.load_state_dict(ref.state_dict())
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", eager_min_macs=limit),
                          module_filter_fn=lambda mod, fqn: True)
    return ref, m


def _run(m, x, dy, autocast):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = m(x)
    y.backward(dy.to(y.dtype))
    out = y.detach(), x.grad, m.weight.grad.clone(), m.bias.grad.clone()
    m.zero_grad()
    return out


@pytest.mark.parametrize("autocast", [False, True])
def test_a_call_under_the_limit_is_nn_linear_bit_for_bit_and_logged_once_per_shape(autocast, caplog):
    layer._told.clear()
    ref, m = _pair(MACS + 1)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 24, IN, generator=g), torch.randn(2, 24, OUT, generator=g)
    with caplog.at_level(logging.INFO, logger="coat_ds.linear"):
        want, got = _run(ref, x, dy, autocast), _run(m, x, dy, autocast)
        _run(m, x, dy, autocast)
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    said = [r for r in caplog.records if "eager_min_macs" in r.getMessage()]
    assert len(said) == 1 and f"{IN} x {OUT} at {TOKENS} tokens" in said[0].getMessage()
    assert said[0].levelno == logging.WARNING  # the first: shown without logging configured
    with caplog.at_level(logging.INFO, logger="coat_ds.linear"):
        _run(m, x[:1], dy[:1], autocast)  # another token count: told again, as INFO
    again = [r for r in caplog.records if "at 24 tokens" in r.getMessage()]
    assert len(again) == 1 and again[0].levelno == logging.INFO


def test_a_call_at_the_limit_runs_in_fp8():
    ref, m = _pair(MACS)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(2, 24, IN, generator=g), torch.randn(2, 24, OUT, generator=g)
    want, got = _run(ref, x, dy, False), _run(m, x, dy, False)
    for w, o in zip(want[:3], got[:3]):  # the bias gradient is a sum, exact either way
        assert not torch.equal(w, o)
        assert 20 < sqnr_db(w, o) < 60  # FP8 error, not a different computation


def test_compiled_calls_run_in_fp8_whatever_the_limit():
    torch._dynamo.reset()
    _, eager = _pair(0)
    ref, compiled = _pair(2 ** 60)
    compiled.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(2, 24, IN, generator=g), torch.randn(2, 24, OUT, generator=g)
    want, fp8, got = _run(ref, x, dy, False), _run(eager, x, dy, False), _run(compiled, x, dy, False)
    assert not torch.equal(want[0], got[0])
    assert sqnr_db(fp8[0], got[0]) > 60 and sqnr_db(fp8[2], got[2]) > 60


# ---- regions ---------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _region_run(limit, compiled=False, compress=True, steps=1):
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    handle = None
    if compress:
        handle = compress_activations(model, config=ActivationConfig(eager_min_region_numel=limit),
                                      module_filter_fn=lambda m, fqn: isinstance(m, _Block))
    if compiled:
        for b in model:
            b.compile(backend="aot_eager")
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(4))
    for _ in range(steps):
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], handle


def test_a_region_under_the_limit_keeps_its_tensors_exact_and_says_so_once(caplog):
    numel = 4 * 32 * 64
    loss0, grads0, _ = _region_run(None, compress=False)
    with caplog.at_level(logging.INFO, logger="coat_ds.activation"):
        loss, grads, handle = _region_run(numel + 1, steps=2)
    assert handle.stats().compressed_tensors == 0
    assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
    said = [r for r in caplog.records if "eager_min_region_numel" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert f"input of {numel} elements" in said[0].getMessage() and "_Block" in said[0].getMessage()
    loss, grads, handle = _region_run(numel)
    assert handle.stats().compressed_tensors > 0
    assert not all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_an_exact_region_still_refuses_a_tensor_changed_in_place():
    lin = nn.Linear(8, 8)
    compress_activations(lin, config=ActivationConfig(eager_min_region_numel=10 ** 9))
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    y = lin(h)
    h.add_(1)  # the linear layer saved h
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_compiled_regions_compress_whatever_the_limit():
    torch._dynamo.reset()
    _, exact, _ = _region_run(None, compress=False)
    _, forced, _ = _region_run(0, compiled=True)
    torch._dynamo.reset()
    _, limited, _ = _region_run(10 ** 9, compiled=True)
    for e, f, g in zip(exact, forced, limited):
        assert torch.equal(f, g)
    assert min(sqnr_db(e, g) for e, g in zip(exact, limited)) < 50  # FP8 error: compressed


def test_a_region_without_a_float_input_is_compressed():
    model = nn.Sequential(nn.Embedding(32, 64), _Block())
    handle = compress_activations(model, config=ActivationConfig(eager_min_region_numel=10 ** 9))
    model(torch.randint(0, 32, (4, 16))).sum().backward()
    assert handle.stats().compressed_tensors > 0


@pytest.mark.gpu
@pytest.mark.cuda_eager_limits
def test_cuda_defaults_keep_a_small_model_on_bf16_linears_and_exact(caplog):
    """On a GPU with the defaults a small layer runs as nn.Linear and a small region stays
    exact, each logged; forced to 0 both take the FP8 paths."""
    layer._told.clear()
    torch.manual_seed(0)
    block = _Block().cuda()
    convert_to_fp8_linear(block, module_filter_fn=lambda m, fqn: True)
    handle = compress_activations(block)
    x = torch.randn(4, 32, 64, device="cuda")
    with caplog.at_level(logging.INFO, logger="coat_ds"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            block(x).float().square().mean().backward()
    assert handle.stats().compressed_tensors == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "eager_min_macs" in said and "eager_min_region_numel" in said
    handle.remove()
    coat_ds.convert_to_fp8_linear(block, config=Fp8LinearConfig(eager_min_macs=0),
                                  module_filter_fn=lambda m, fqn: True)
    handle = compress_activations(block, config=ActivationConfig(eager_min_region_numel=0))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        block(x).float().square().mean().backward()
    assert handle.stats().compressed_tensors > 0
