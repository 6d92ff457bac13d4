"""fuse_rms_norms on CPU: the Triton kernels (interpreter) against their torch twins, the twins
against the modules they replace, the max handed to the FP8 linear layers (their codes are
those they would compute themselves), Hugging Face models end to end, torch.compile.

Bounds. The twin computes what Hugging Face's LlamaRMSNorm computes, op for op: equal bit for
bit. The kernels reduce a row's sum of squares in another order, so rstd may differ in its
last bits and y by one rounding of its dtype: |dy| <= 2**-p |y| (p = 7 BF16, 10 FP16; FP32:
p = 20, rstd's error and two roundings with margin). Backward: dx is rounded to x's dtype
after the same FP32 math, dweight sums rows in another order: both within 2**-p of the
largest magnitude."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import coat_ds
from coat_ds import Fp8LinearConfig, convert_to_fp8_linear, fuse_rms_norms
from coat_ds.kernels import reference
from coat_ds.linear import shared_input
from helpers import bound

HIDDEN = (37, 128, 1000)  # odd, a power of two, wider than one 512-lane block
# (x dtype, weight dtype): the model's dtype; BF16 autocast over FP32 weights; mixed.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16), (torch.float32, torch.bfloat16)]
_P = {torch.float32: 20, torch.bfloat16: 7, torch.float16: 10}


def _interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    return bound("rms_norm").TRITON


def _inputs(rows, hidden, x_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    w = 1 + 0.5 * torch.randn(hidden, generator=g)
    return x.to(x_dtype), w.to(w_dtype)


def _close(got, want, p):
    """Within one rounding at 2**-p of each element (y), or of the largest one (gradients)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.float(), want.float()
    assert torch.isnan(got).equal(torch.isnan(want))
    ok = ~torch.isnan(want)
    err = (got - want)[ok].abs()
    return err, want[ok].abs()


def _finite_max_bits(y):
    return reference.linear_finite_absmax(y).reshape(1).view(torch.int32)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("cast_first", [True, False])
def test_forward_kernel_matches_twin(hidden, dtypes, cast_first):
    k = _interpreted()
    x, w = _inputs(9, hidden, *dtypes)
    x[3] = 0  # a zero row: rstd = 1 / sqrt(eps), y = 0, no NaN
    y, rstd, amax = k.forward(x, w, 1e-6, cast_first)
    y0, rstd0, amax0 = reference.rms_norm_forward(x, w, 1e-6, cast_first)
    err, mag = _close(y, y0, _P[y0.dtype])
    assert (err <= mag * 2.0 ** -_P[y0.dtype]).all(), err.max()
    assert ((rstd - rstd0).abs() <= rstd0 * 2.0 ** -22).all()
    assert not torch.isnan(y).any() and (y[3] == 0).all()
    # The max folded is that of the values stored, bit for bit: what a max pass over y finds.
    assert torch.equal(amax, _finite_max_bits(y))
    assert abs(amax.view(torch.float32) - amax0.view(torch.float32)) <= amax0.view(torch.float32) * 2.0 ** -_P[y0.dtype]


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("cast_first", [True, False])
def test_backward_kernel_matches_twin(hidden, dtypes, cast_first):
    k = _interpreted()
    x, w = _inputs(11, hidden, *dtypes, seed=1)  # 11 rows on 4 programs: the last one has 2
    x[5] = 0
    y, rstd, _ = reference.rms_norm_forward(x, w, 1e-6, cast_first)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype)
    dx, dw = k.backward(dy, x, w, rstd, cast_first)
    dx0, dw0 = reference.rms_norm_backward(dy, x, w, rstd, cast_first)
    for got, want, p in ((dx, dx0, _P[x.dtype]), (dw, dw0, _P[w.dtype])):
        err, mag = _close(got, want, p)
        assert err.max() <= mag.max() * 2.0 ** -p, (err.max(), mag.max())
    assert not torch.isnan(dx).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0, interpreted
def test_non_finite_rows_do_not_set_the_max():
    """Rows holding inf or NaN give what Hugging Face's norm gives (inf: rstd 0, so NaN at
    the inf and 0 elsewhere; NaN: all NaN); the max is that of the finite values, as the
    FP8 linear layers' own max pass finds it."""
    k = _interpreted()
    x, w = _inputs(6, 96, torch.bfloat16, torch.bfloat16)
    x[1, 7], x[4, 0] = float("inf"), float("nan")
    y, _, amax = k.forward(x, w, 1e-6, True)
    y0, _, amax0 = reference.rms_norm_forward(x, w, 1e-6, True)
    assert torch.isnan(y).equal(torch.isnan(y0)) and torch.isnan(y[4]).all() and torch.isnan(y[1, 7])
    assert torch.equal(y[1].nan_to_num(), torch.zeros_like(y[1]))
    finite = torch.cat([y[:1], y[2:4], y[5:]])
    assert torch.equal(amax, _finite_max_bits(y)) and torch.isfinite(amax.view(torch.float32)).all()
    assert amax.view(torch.float32) == finite.float().abs().max() > 0
    assert torch.equal(amax0, _finite_max_bits(y0))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_codes_from_the_folded_max_equal_the_linear_layers_own(fmt):
    """Quantized with the norm's max, y's codes (both layouts) and exponent are bit for bit
    those of the FP8 linear layers' own max pass: Triton kernels and twins."""
    k = _interpreted()
    linear_quantize = bound("fp8_linear").linear_quantize_triton

    x, w = _inputs(37, 96, torch.bfloat16, torch.bfloat16, seed=3)  # 37 rows: padded transposed copy
    for fwd, quantize in ((k.forward, linear_quantize), (reference.rms_norm_forward, reference.linear_quantize)):
        y, _, amax = fwd(x, w, 1e-6, True)
        own = quantize(y, fmt, True, True)
        handed = quantize(y, fmt, True, True, amax=amax)
        for a, b in zip(own, handed):
            assert torch.equal(a, b)


def _hf_norm(cls_name="LlamaRMSNorm", module="llama", hidden=96):
    import importlib

    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls_name)
    m = cls(hidden, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_(1, 0.5)
    return m


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("kind", ["hf", "torch"])
def test_fused_module_equals_the_module_it_replaces(dtypes, kind):
    """Forward bit for bit (twin path); gradients within one rounding of autograd's through
    the original module (which rounds its intermediate gradients to 16 bits)."""
    x_dtype, w_dtype = dtypes
    if kind == "torch" and x_dtype != w_dtype:
        pytest.skip("torch.nn.RMSNorm warns on mixed dtypes and takes another path")
    torch.manual_seed(4)
    orig = _hf_norm() if kind == "hf" else nn.RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        orig.weight.normal_(1, 0.5)
    orig.to(w_dtype)
    fused = nn.Sequential(type(orig)(96, eps=1e-6))
    fused[0].load_state_dict(orig.state_dict())
    fused.to(w_dtype)
    assert fuse_rms_norms(fused, config=Fp8LinearConfig(backend="torch")) == 1
    assert fused[0]._fused_cast_first is (kind == "hf")
    x, _ = _inputs(8, 96, x_dtype, w_dtype, seed=5)
    outs = []
    for m in (orig, fused[0]):
        xr = x.clone().requires_grad_()
        y = m(xr)
        y.backward(torch.ones_like(y).mul_(torch.linspace(-1, 1, 96, dtype=y.dtype)))
        outs.append((y, xr.grad, m.weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert torch.equal(y0, y1)
    for a, b in ((dx0, dx1), (dw0, dw1)):
        p = _P[a.dtype]
        err, mag = _close(b, a, p)
        assert err.max() <= 2 * mag.max() * 2.0 ** -p, (err.max(), mag.max())


class _NormThenSiblings(nn.Module):
    """An RMSNorm whose output q/k/v read, as a decoder layer's input_layernorm."""

    def __init__(self, d=64, n=48):
        super().__init__()
        self.norm = _hf_norm(hidden=d)
        self.q, self.k, self.v = (nn.Linear(d, n) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) * 2 + self.v(h) * 3


def _saved_codes(m, x, monkeypatch):
    """(codes autograd saved in m's forward, quantize calls: whether each was handed a max)."""
    from coat_ds.linear import layer

    calls, saved = [], []
    real = layer.get

    def counting(op, *args):
        kernels = real(op, *args)

        def quantize(*a, **kw):
            calls.append(kw.get("amax") is not None)
            return kernels.quantize(*a, **kw)
        return kernels._replace(quantize=quantize)

    monkeypatch.setattr(layer, "get", counting)
    for mod in m.modules():
        mod.__dict__.pop("_fp8_spec", None)  # each layer's kernels, taken again (counted) at its next call

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x.clone().requires_grad_())
    monkeypatch.setattr(layer, "get", real)
    return [t for t in saved if t.dtype == torch.uint8], calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_linear_layers_take_the_norms_max_and_share_one_copy(monkeypatch, backend):
    """q/k/v after a fused norm: one quantize call in all, handed the norm's max (no max
    pass), whose codes k and v reuse (one tensor saved three times), and which equal the
    codes q computes itself after an unfused norm."""
    if backend == "triton":
        _interpreted()
    torch.manual_seed(6)
    m = _NormThenSiblings()
    cfg = Fp8LinearConfig(fp8_gemm="on", backend=backend)
    convert_to_fp8_linear(m, config=cfg, module_filter_fn=lambda mod, fqn: True)
    x = torch.randn(2, 21, 64).to(torch.bfloat16)
    m.to(torch.bfloat16)
    plain_codes, plain_calls = _saved_codes(m, x, monkeypatch)
    assert plain_calls[0] is False  # the linear layers' own max pass
    assert fuse_rms_norms(m, config=cfg) == 1
    fused_codes, fused_calls = _saved_codes(m, x, monkeypatch)
    # One input quantization (q's; k and v hit the shared copy) plus one per weight.
    assert fused_calls.count(True) == 1 and len(fused_calls) == len(plain_calls)
    assert len(fused_codes) == 3 and len({t.untyped_storage().data_ptr() for t in fused_codes}) == 1
    assert torch.equal(fused_codes[0], plain_codes[0])


def test_the_offer_is_dropped_on_change_and_in_backward():
    torch.manual_seed(7)
    m = nn.Sequential(_hf_norm(hidden=64))
    fuse_rms_norms(m, config=Fp8LinearConfig(backend="torch"))
    x = torch.randn(3, 64, requires_grad=True)
    y = m(x)
    assert shared_input.on(y).amax is not None and shared_input.on(y.detach().clone()).amax is None
    with torch.no_grad():
        y.mul_(2)
    assert shared_input.on(y).amax is None
    y2 = m(x)
    lin = convert_to_fp8_linear(nn.Linear(64, 16), config=Fp8LinearConfig(fp8_gemm="on", backend="torch"),
                                module_filter_fn=lambda mod, fqn: True)
    lin(y2).sum().backward()
    assert shared_input.on(y2).amax is None


def _tiny_model(arch):
    import transformers

    common = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=256, attn_implementation="sdpa", use_cache=False)
    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**common))


def _loss_and_grads(arch, fuse, backend):
    m = _tiny_model(arch)
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", backend=backend))
    if fuse:
        assert fuse_rms_norms(m, config=Fp8LinearConfig(backend=backend)) == 2 * 2 + 1
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    return m, loss.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("arch,backend", [("llama", "torch"), ("mistral", "torch"), ("qwen2", "torch"),
                                          ("llama", "triton")])
def test_hf_models_give_the_same_loss_and_gradients(arch, backend):
    """convert_to_fp8_linear with and without fuse_rms_norms: the FP8 codes are the same, so
    the loss is equal bit for bit; gradients differ only by the norms' backward (FP32 math
    where autograd rounds the product with the weight to 16 bits): within 1e-3 of each
    parameter's gradient norm (measured: below 1e-5)."""
    if backend == "triton":
        _interpreted()
    m0, loss0, g0 = _loss_and_grads(arch, False, backend)
    m1, loss1, g1 = _loss_and_grads(arch, True, backend)
    assert torch.equal(loss0, loss1)
    assert m0.state_dict().keys() == m1.state_dict().keys()
    assert type(m1.model.norm).__name__.startswith("Fused") and isinstance(m1.model.norm, type(m0.model.norm))
    for name, g in g0.items():
        assert g1[name] is not None
        assert (g1[name] - g).norm() <= 1e-3 * g.norm() + 1e-12, name


def test_torch_compile_runs_the_modules_own_code():
    """Compiled (fullgraph: no graph break) the fused module is the module's own torch code:
    the same output as the unfused module compiled."""
    torch._dynamo.reset()
    torch.manual_seed(8)
    m = _NormThenSiblings()
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", backend="torch"),
                          module_filter_fn=lambda mod, fqn: True)
    x = torch.randn(2, 16, 64)
    want = torch.compile(m, fullgraph=True)(x)
    fuse_rms_norms(m, config=Fp8LinearConfig(backend="torch"))
    torch._dynamo.reset()
    got = torch.compile(m, fullgraph=True)(x)
    assert torch.equal(got, want)
    assert torch.equal(m(x), want)  # and eagerly, the fused path: same codes, same output


class GemmaLikeRMSNorm(nn.Module):
    """Gemma's norm scales by 1 + weight: not an RMSNorm order fuse_rms_norms computes."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = 1e-6

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.float())).type_as(x)


def test_conversion_selects_probes_filters_and_keeps_identity(caplog):
    m = nn.ModuleDict({"a": _hf_norm(hidden=32), "b": nn.RMSNorm(32), "gemma": GemmaLikeRMSNorm(32),
                       "skip": _hf_norm(hidden=32), "no_weight": nn.RMSNorm(32, elementwise_affine=False),
                       "lin": nn.Linear(32, 32)})
    before = {k: v for k, v in m.items()}
    with caplog.at_level(logging.INFO, logger="coat_ds.linear"):
        n = fuse_rms_norms(m, config=Fp8LinearConfig(backend="torch"), module_filter_fn=lambda mod, fqn: fqn != "skip")
    assert n == 2
    assert {k for k, v in m.items() if type(v).__name__.startswith("Fused")} == {"a", "b"}
    assert all(m[k] is v for k, v in before.items())
    assert "2 RMSNorm modules fused" in caplog.text and "1 skipped by the filter" in caplog.text
    assert "1 left unfused" in caplog.text
    assert fuse_rms_norms(m, config=Fp8LinearConfig(backend="triton"), module_filter_fn=lambda mod, fqn: fqn != "skip") == 2
    assert m["a"].fused_norm_backend == "triton"
    with pytest.raises(TypeError, match="Fp8LinearConfig"):
        fuse_rms_norms(m, config=coat_ds.ActivationConfig())


def test_composes_with_compress_activations():
    """With compress_activations (whose FP8 copies of saved tensors are lossy), fused norms
    save fewer bytes (x and one rstd per row, not Hugging Face's intermediates) and their
    gradients are as close to the uncompressed ones: mean relative error over parameters
    within 1.1x of the unfused model's (measured 0.075 fused, 0.076 unfused)."""
    def grads(fuse, compress):
        m = _tiny_model("llama")
        convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
        if fuse:
            fuse_rms_norms(m, config=Fp8LinearConfig(backend="torch"))
        handle = coat_ds.compress_activations(m) if compress else None
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}, handle

    exact, _ = grads(False, False)
    errors, saved = [], []
    for fuse in (False, True):
        g, handle = grads(fuse, True)
        errors.append(sum(((g[n] - e).norm() / e.norm()).item() for n, e in exact.items()) / len(exact))
        saved.append(handle.stats().uncompressed_bytes)
    assert errors[1] <= 1.1 * errors[0], errors
    assert saved[1] < saved[0], saved


def test_linear_quantize_op_with_a_handed_max_passes_opcheck():
    """The custom op's new `amax` argument: schema, fake implementation and aliasing agree."""
    x, w = _inputs(20, 48, torch.bfloat16, torch.bfloat16, seed=9)
    y, _, amax = reference.rms_norm_forward(x, w, 1e-6, True)
    torch.library.opcheck(torch.ops.coat_ds.fp8_linear_quantize.default, (y, 0, True, True, None, None, True, amax))


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_cuda_kernels_match_the_twins(dtypes):
    """On a GPU: the compiled kernels against the twins, at a Llama width and at one wider
    than a block. The twin's rstd there is CUDA's approximate rsqrt (2 ulp) where the kernel
    divides by a correctly rounded sqrt, so x * rstd may round to x's dtype on the other side
    of a tie: y within one rounding of x's dtype plus one of its own."""
    k = bound("rms_norm").TRITON
    for hidden in (4096, 1000):
        x, w = (t.cuda() for t in _inputs(300, hidden, *dtypes, seed=4))
        x[7] = 0
        y, rstd, amax = k.forward(x, w, 1e-6, True)
        y0, rstd0, _ = reference.rms_norm_forward(x, w, 1e-6, True)
        err, mag = _close(y, y0, _P[y0.dtype])
        assert (err <= mag * (2.0 ** -_P[x.dtype] + 2.0 ** -_P[y0.dtype])).all(), (err / mag).max()
        assert ((rstd - rstd0).abs() <= rstd0 * 2.0 ** -21).all() and (y[7] == 0).all()
        assert torch.equal(amax, _finite_max_bits(y))
        dy = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(y.dtype)
        dx, dw = k.backward(dy, x, w, rstd0, True)
        dx0, dw0 = reference.rms_norm_backward(dy, x, w, rstd0, True)
        for got, want, p in ((dx, dx0, _P[x.dtype]), (dw, dw0, _P[w.dtype])):
            err, mag = _close(got, want, p)
            assert err.max() <= mag.max() * 2.0 ** -p, (err.max(), mag.max())
