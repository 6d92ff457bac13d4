"""Fused SwiGLU (`fuse_swiglu`, kernels/swiglu.py): the Triton kernels (interpreter on CPU)
against their torch twins, the twins against Hugging Face's eager ops, down_proj's codes
from the offered max against its own, and HF Llama, Mistral and Qwen2 models with and
without the fusion.

Bounds: the kernels and the twins compute the same formulas in FP32 with the same rounding
steps, but exp is numpy's under the interpreter and torch's (Sleef) in the twin, which
differ in the last bit of FP32 now and then: FP32 results agree within 4 units in the last
place (measured: 2.4); silu's derivative, which cancels near its zero (x ~ -1.28,
1 + x(1 - sigmoid)), within 8 FP32 ulp of its terms' scale before rounding to the dtype. A
16-bit h or dup is two roundings apart at most (an FP32 ulp tips silu's rounding at a tie,
and the product's), and any 16-bit result differs in under 1% of elements (measured: none
in BF16, a few in 10^4 in FP16)."""
from __future__ import annotations

import logging
import os
from unittest import mock

import pytest
import torch
from torch import nn

import coat_ds
from coat_ds import Fp8Linear, Fp8LinearConfig, convert_to_fp8_linear, fuse_swiglu
from coat_ds.kernels import fp8_linear, get, reference
from coat_ds.kernels.fp8 import GEMM_ALIGN
from coat_ds.linear import shared_input
from coat_ds.linear.swiglu import swiglu
from helpers import bound, sqnr_db

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
EPS32 = torch.finfo(torch.float32).eps
# (37, 301): odd width, a partial last program; (5000,): two programs; (2, 3, 130): 3-D.
SHAPES = [(37, 301), (5000,), (2, 3, 130)]


def _kernels():
    return bound("swiglu").TRITON


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # gate spans silu's both regimes (x ~ 0 and |x| >> 1), up and dh are plain Gaussians.
    return [(torch.randn(shape, generator=g) * s).to(dtype) for s in (4.0, 1.0, 1.0)]


def _within_ulp(got, want, n_ulp):
    return bool(((got.double() - want.double()).abs() <= n_ulp * EPS32 * want.double().abs()).all())


def _assert_16bit_close(got, want):
    """Two roundings apart at most (silu's, then the product's, each of which an FP32 ulp
    can tip the other way at a tie), in under 1% of elements."""
    eps, tiny = torch.finfo(want.dtype).eps, torch.finfo(want.dtype).smallest_normal
    assert bool(((got.double() - want.double()).abs() <= 2 * eps * want.double().abs() + tiny).all())
    assert (got != want).float().mean() < 0.01


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_the_twins(shape, dtype):
    k = _kernels()
    g, u, dh = _data(shape, dtype)
    h, amax = k.forward(g, u, True)
    h_t, amax_t = reference.swiglu_forward(g, u, True)
    dg, du = k.backward(dh, g, u)
    dg_t, du_t = reference.swiglu_backward(dh, g, u)
    assert h.shape == g.shape and h.dtype == dg.dtype == du.dtype == dtype
    # The folded max is that of the kernel's own stored h, bit for bit.
    assert amax.dtype == torch.int32 and amax.shape == (1,)
    assert amax.item() == reference.linear_finite_absmax(h).view(torch.int32).item()
    # silu's derivative in FP32 within 8 ulp of its terms' scale, then rounded to the dtype.
    scale = (dh.double() * u.double()).abs() * (1 + g.double().abs())
    bound = 8 * EPS32 * scale + torch.finfo(dtype).eps * dg_t.double().abs()
    assert bool(((dg.double() - dg_t.double()).abs() <= bound).all())
    if dtype == torch.float32:
        assert _within_ulp(h, h_t, 4) and _within_ulp(du, du_t, 4)
        assert _within_ulp(amax.view(torch.float32), amax_t.view(torch.float32), 4)
    else:
        for got, want in ((h, h_t), (du, du_t)):
            _assert_16bit_close(got, want)
        assert (dg != dg_t).float().mean() < 0.01
    # Without the max, the same h.
    h2, none = k.forward(g, u, False)
    assert none is None and torch.equal(h2, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_twins_are_hugging_faces_ops_bit_for_bit(dtype):
    """Forward and backward of the twins equal autograd through F.silu(g) * u."""
    g, u, dh = _data((37, 301), dtype, seed=1)
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = nn.functional.silu(gg) * uu
    h.backward(dh)
    h_t, _ = reference.swiglu_forward(g, u)
    dg_t, du_t = reference.swiglu_backward(dh, g, u)
    assert torch.equal(h, h_t) and torch.equal(gg.grad, dg_t) and torch.equal(uu.grad, du_t)


@needs_interpreter
def test_bf16_rounding_is_nearest_even_at_every_tie():
    """silu(20) is exactly 20 in FP32 and BF16; 20 * u over every BF16 u in [1, 2) (and its
    negation) hits rounding ties, where the kernel's integer rounding must match torch's
    (the interpreter's own BF16 cast truncates)."""
    u = 1 + torch.arange(128, dtype=torch.float32) / 128
    u = torch.cat([u, -u]).to(torch.bfloat16)
    g = torch.full_like(u, 20.0)
    h, _ = _kernels().forward(g, u)
    assert torch.equal(h, nn.functional.silu(g) * u)
    assert (h.float() != 20 * u.float()).any()  # some products were rounded
    dg, du = _kernels().backward(u, g, u)  # dh * u and dh * silu(g) round too
    dg_t, du_t = reference.swiglu_backward(u, g, u)
    assert torch.equal(du, du_t) and torch.equal(dg, dg_t)


@needs_interpreter
@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_zeros_give_zeros_and_no_nan(impl):
    fwd, bwd = ((_kernels().forward, _kernels().backward) if impl == "kernel"
                else (reference.swiglu_forward, reference.swiglu_backward))
    z = torch.zeros(33, 70, dtype=torch.bfloat16)
    h, amax = fwd(z, z, True)
    dg, du = bwd(torch.randn(33, 70).to(torch.bfloat16), z, z)
    assert not h.any() and amax.item() == 0 and not dg.any() and not du.any()
    h, amax = fwd(z[:0], z[:0], True)  # no elements: nothing launched
    assert h.shape == (0, 70) and amax.item() == 0


@needs_interpreter
def test_nonfinite_inputs_do_not_set_the_max():
    """inf in gate gives +-inf in h, -inf gives NaN (-inf / inf, as torch's silu), NaN stays
    NaN: the kernel and the twin agree on each, and the folded max is that of the finite rest."""
    g, u, dh = _data((40, 96), torch.bfloat16, seed=2)
    g[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    u[1, 0] = float("inf")
    h, amax = _kernels().forward(g, u, True)
    h_t, amax_t = reference.swiglu_forward(g, u, True)
    assert torch.equal(h.isnan(), h_t.isnan()) and torch.equal(h.isinf(), h_t.isinf())
    assert h.isinf().any() and h.isnan().any()
    finite = h.isfinite()
    assert torch.equal(h[finite], h_t[finite])
    assert amax.item() == amax_t.item()
    assert amax.view(torch.float32).item() == h[finite].float().abs().max().item()
    dg, du = _kernels().backward(dh, g, u)
    dg_t, du_t = reference.swiglu_backward(dh, g, u)
    for got, want in ((dg, dg_t), (du, du_t)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_from_the_folded_max_is_the_quantizers_own(backend, fmt):
    """The FP8-linear cast given the max forward folded (no max pass) gives the codes and
    exponent of its own max pass, row-major and transposed (37 rows: padded)."""
    forward = get("swiglu", torch.device("cpu"), backend).forward
    g, u, _ = _data((37, 96), torch.bfloat16, seed=5)
    h, amax = forward(g, u, True)
    quantize = get("fp8_linear", h.device, backend).quantize
    for rowwise in (True, False):
        got = quantize(h, fmt, rowwise, True, amax=amax)
        want = quantize(h, fmt, rowwise, True)
        assert (got[0] is None) == (not rowwise) and got[1].shape == (96, 48)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))


def _down(k, n, **cfg):
    torch.manual_seed(3)
    return Fp8Linear(k, n, bias=False, config=Fp8LinearConfig(**cfg))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("cfg", [dict(fp8_gemm="on"), dict(fp8_gemm="off"), dict(fp8_gemm="on", input_format="e5m2",
                                                                                 grad_format="e4m3")],
                         ids=["fp8_gemm", "no_fp8_gemm", "e5m2_input"])
def test_down_proj_takes_the_offered_max_and_makes_its_own_codes(backend, cfg):
    """The max offered with h is h's finite max (an inf in gate included: it does not set the
    max); down_proj takes it, skipping its max pass, and its codes and output are those it
    makes of h without the offer, bit for bit."""
    down = _down(160, 48, backend=backend, **cfg)
    g, u, _ = _data((2, 37, 160), torch.bfloat16, seed=4)
    g[0, 0, 0] = float("inf")
    h = swiglu(g, u, down)
    offered = shared_input.on(h).amax
    assert offered is not None
    assert offered.view(torch.float32).item() == reference.linear_finite_absmax(h).item()
    fmt = down.fp8_config.input_format
    with torch.no_grad(), mock.patch.object(fp8_linear, "linear_finite_absmax",
                                            wraps=fp8_linear.linear_finite_absmax) as max_pass:
        y_offered = down(h)
        codes_offered = shared_input.on(h).codes
    assert all(c.args[0].shape != (74, 160) for c in max_pass.call_args_list), "h's max was read again"
    h_plain = h.detach().clone()  # h's values, nothing attached
    with torch.no_grad():
        y_own = down(h_plain)
        codes_own = shared_input.on(h_plain).codes
    assert torch.equal(y_offered, y_own)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(codes_offered, codes_own))
    assert codes_own[1].shape == (160, -(-74 // GEMM_ALIGN) * GEMM_ALIGN) and fmt in ("e4m3", "e5m2")


def test_no_max_offered_without_an_fp8_down_proj():
    g, u, _ = _data((4, 64), torch.bfloat16)
    h = swiglu(g, u, nn.Linear(64, 16))
    assert torch.equal(h, nn.functional.silu(g) * u)
    assert shared_input.on(h).amax is None


def test_inputs_the_kernels_do_not_take_run_plain_ops():
    """Different dtypes (an FP32 gate and a BF16 up) or shapes: torch's own ops and promotion."""
    g, u, _ = _data((4, 64), torch.float32)
    got = swiglu(g, u.to(torch.bfloat16))
    assert got.dtype == torch.float32 and torch.equal(got, nn.functional.silu(g) * u.to(torch.bfloat16))
    assert torch.equal(swiglu(g, u[:1]), nn.functional.silu(g) * u[:1])


# ---- Whole models --------------------------------------------------------------------------


def _model(arch: str):
    import transformers

    kw = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, vocab_size=128, attn_implementation="sdpa", use_cache=False)
    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                          "mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))


def _train_step(arch, *, fuse, compress=False, backend="torch", fuse_first=False, ckpt=None):
    """Loss, parameter gradients and the number of input casts that skipped their max pass (a
    shared-input hit or an offered max taken) of one BF16-autocast step (and
    compress_activations' stats, with `compress`)."""
    m = _model(arch)
    if ckpt:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    cfg = Fp8LinearConfig(fp8_gemm="on", backend=backend)
    if fuse and fuse_first:
        assert fuse_swiglu(m, config=cfg) == 2
    convert_to_fp8_linear(m, config=cfg)
    if fuse and not fuse_first:
        assert fuse_swiglu(m, config=cfg) == 2
    handle = coat_ds.compress_activations(m) if compress else None
    m.train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    hits, real = [], shared_input.SharedInput.codes_for

    def codes_for(shared, recipe):
        found = real(shared, recipe)
        hits.append(found is not None or shared.amax is not None)  # no max pass either way
        return found

    # Backward too: it may recompute.
    with mock.patch.object(shared_input.SharedInput, "codes_for", codes_for):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
    step = (loss.detach(), [p.grad for p in m.parameters()], sum(hits))
    return step + (handle.stats(),) if compress else step


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_hf_models_give_the_same_loss_and_gradients(arch):
    """Twins (the CPU path): bit for bit Hugging Face's, and down_proj's cast takes the max
    offered (one max pass fewer per layer: q/k/v 2 hits, gate/up 1, down 1 offer)."""
    loss0, grads0, hits0 = _train_step(arch, fuse=False)
    loss1, grads1, hits1 = _train_step(arch, fuse=True)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert (hits0, hits1) == (2 * 3, 2 * 4)


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_hf_llama_with_activation_checkpointing(ckpt):
    """Recomputation fuses again and offers down_proj the max again: the same count per forward
    run, loss and gradients bit for bit the unfused model's."""
    loss0, grads0, hits0 = _train_step("llama", fuse=False, ckpt=ckpt)
    loss1, grads1, hits1 = _train_step("llama", fuse=True, ckpt=ckpt)
    assert torch.equal(loss0, loss1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert (hits0, hits1) == (2 * 3 * 2, 2 * 4 * 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_models_with_compressed_activations(arch):
    """With compress_activations, gate and up are saved per group in FP8 (the unfused MLP
    saves gate, silu(gate) and up): forward is unchanged, and the gradients are as close to
    those of the uncompressed model as the unfused ones are (measured within 0.5 dB, >= 15 dB)."""
    loss_ref, grads_ref, _ = _train_step(arch, fuse=False)
    loss0, grads0, _, stats0 = _train_step(arch, fuse=False, compress=True)
    loss1, grads1, hits, stats1 = _train_step(arch, fuse=True, compress=True)
    assert torch.equal(loss0, loss1) and torch.equal(loss_ref, loss1) and hits == 2 * 4
    # Per layer one tensor of the intermediate size fewer (silu(gate)); gate and up compressed.
    assert stats1.compressed_tensors == stats0.compressed_tensors - 2, (stats0, stats1)
    assert stats0.uncompressed_bytes - stats1.uncompressed_bytes == 2 * (2 * 32 * 160) * 2  # BF16
    unfused = min(sqnr_db(r, g) for r, g in zip(grads_ref, grads0))
    fused = min(sqnr_db(r, g) for r, g in zip(grads_ref, grads1))
    assert fused > unfused - 1.5 and fused > 13, (fused, unfused)


@needs_interpreter
def test_hf_llama_on_the_triton_kernels():
    """Every kernel Triton (interpreted), fused before conversion (down_proj is looked at per
    call): down_proj takes the max offered, and loss and gradients are the unfused
    model's within the kernels' bound (measured equal bit for bit)."""
    loss0, grads0, _ = _train_step("llama", fuse=False, backend="triton")
    loss1, grads1, hits = _train_step("llama", fuse=True, backend="triton", fuse_first=True)
    assert hits == 2 * 4
    assert (loss0 - loss1).abs() <= 1e-3 * loss0
    assert min(sqnr_db(a, b) for a, b in zip(grads0, grads1)) > 30


def test_saves_gate_and_up_only():
    """Backward of the fused activation keeps gate and up, and nothing else of its own; the
    unfused MLP also keeps silu(gate)."""
    m = _model("llama")
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on"))
    mlp = m.model.layers[0].mlp
    x = torch.randn(2, 8, 64)

    def saved_by(module):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            module(x.clone().requires_grad_())
        # Besides the three layers' weights and their FP8 inputs (uint8 codes, int32 exponents).
        return [t for t in saved if t.is_floating_point() and not isinstance(t, nn.Parameter)]

    unfused = saved_by(mlp)
    assert len(unfused) == 3 and all(t.shape == (2, 8, 160) for t in unfused)
    fuse_swiglu(m)
    fused = saved_by(mlp)
    assert len(fused) == 2 and all(t.shape == (2, 8, 160) for t in fused)


def test_torch_compile_runs_hugging_faces_ops():
    """Compiled (fullgraph), the fused module runs the original ops: the same values and
    gradients as the unfused module compiled the same way."""
    torch._dynamo.reset()
    results = []
    for fuse in (False, True):
        m = _model("llama")
        convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on"))
        if fuse:
            fuse_swiglu(m)
        mlp = torch.compile(m.model.layers[0].mlp, fullgraph=True, backend="aot_eager")
        x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(5)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x)
        y.float().sum().backward()
        results.append((y, x.grad, m.model.layers[0].mlp.gate_proj.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


class _GeluMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)
        self.act_fn = nn.GELU()


class _SiluMlp(_GeluMlp):
    def __init__(self):
        super().__init__()
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _DropoutMlp(_SiluMlp):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)


def test_fuse_swiglu_converts_in_place_and_says_what_it_left(caplog):
    torch.manual_seed(6)
    model = nn.Sequential(_SiluMlp(), _SiluMlp(), _GeluMlp(), _DropoutMlp())
    ref = [type(m) for m in model]
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    x = torch.randn(3, 32)
    y0 = model[0](x)
    with caplog.at_level(logging.INFO, logger="coat_ds.linear"):
        assert fuse_swiglu(model, module_filter_fn=lambda m, fqn: fqn != "1") == 1
    assert type(model[0]) is not ref[0] and isinstance(model[0], _SiluMlp)
    assert [type(m) for m in model][1:] == ref[1:]
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert torch.equal(model[0](x), y0)
    text = caplog.text
    assert "1 SwiGLU MLP(s) fused, 1 skipped by the filter, 2 left as they are" in text
    assert "_GeluMlp left as they are: act_fn is GELU, not SiLU" in text
    assert "_DropoutMlp left as they are: it holds more than" in text and "(dropout)" in text
    # Again: the fused module counts once more, nothing is fused twice.
    assert fuse_swiglu(model) == 2 and type(model[0]).__mro__[1] is ref[0]
    with pytest.raises(TypeError, match="config must be an Fp8LinearConfig"):
        fuse_swiglu(model, config=coat_ds.ActivationConfig())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_the_twins_and_offer_the_quantizers_own_max(dtype):
    """On a GPU: compiled kernels against the twins (the bounds above), and the codes made
    from the offered max equal those the Triton quantizer makes of h itself."""
    k = _kernels()
    g, u, dh = (t.cuda() for t in _data((300, 1000), dtype))
    h, amax = k.forward(g, u, True)
    h_t, _ = reference.swiglu_forward(g, u)
    dg, du = k.backward(dh, g, u)
    dg_t, du_t = reference.swiglu_backward(dh, g, u)
    if dtype == torch.float32:
        # Triton's exp on a GPU is 2**(x log2 e) on the approximate ex2: the product's rounding
        # grows with |x| (~|x| ulp of exp's result, which h and du inherit), and the division
        # is the approximate one (2 ulp). torch's expf is within 1 ulp.
        bound = (g.double().abs() + 8) * EPS32
        for got, want in ((h, h_t), (du, du_t)):
            rel = (got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)
            assert bool((rel <= bound).all()), (rel / EPS32).max()
    else:
        for got, want in ((h, h_t), (dg, dg_t), (du, du_t)):
            _assert_16bit_close(got.cpu(), want.cpu())
    assert amax.item() == reference.linear_finite_absmax(h).view(torch.int32).item()
    down = _down(1000, 64).cuda()
    h = swiglu(g, u, down)
    offered = shared_input.on(h).amax
    quantize = get("fp8_linear", h.device).quantize
    want = quantize(h.view(-1, 1000), "e4m3", True, True)
    got = quantize(h.view(-1, 1000), "e4m3", True, True, amax=offered)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
