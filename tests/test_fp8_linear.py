"""Fp8Linear and convert_to_fp8_linear on CPU: numerics against nn.Linear, kernels against
their torch twins, state_dict compatibility, the conversion filter, composition with
compress_activations, checkpointing and torch.compile.

SQNR bounds (dB, against the same layer in FP32): E4M3 keeps 3 mantissa bits, so one
per-tensor-scaled Gaussian operand quantizes at ~31 dB and a product of two at ~28 dB;
E5M2 (2 bits) at ~25 dB, and a product with E4M3 at ~24 dB. The bounds leave ~3 dB of
margin below what these shapes measure (docs/fp8_linear.md lists both)."""
from __future__ import annotations

import collections
import logging
import os

import pytest
import torch
from torch import nn

import coat_ds
from coat_ds import Fp8Linear, Fp8LinearConfig, convert_to_fp8_linear
from coat_ds.kernels import reference
from helpers import bound, census, sqnr_db

FWD_DB, DX_DB, DW_DB = 25.0, 21.0, 21.0
# M = 2 * 37 tokens is no multiple of 16: the transposed copies carry zero padding.
B, S, K, N = 2, 37, 96, 48


def _pair(bias=True, config=None, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        ref.bias.add_(0.5) if bias else None
    m = nn.Linear(K, N, bias=bias)
    m.load_state_dict(ref.state_dict())
    convert_to_fp8_linear(m, config=config, module_filter_fn=lambda mod, fqn: True)
    return ref, m


def _run(layer, x, g, autocast=False):
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(g.to(y.dtype))
    return y, x.grad, layer.weight.grad, layer.bias.grad if layer.bias is not None else None


def _saved_by(layer, x):
    """Every tensor autograd saves in `layer`'s forward."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.clone().requires_grad_())
    return saved


PATHS = {
    "fp8_scaled_mm": dict(fp8_gemm="on", backend="torch"),
    "fp8_triton_interpreted": dict(fp8_gemm="on", backend="triton"),
    "no_fp8_gemm": dict(fp8_gemm="off", backend="torch"),
    "grad_e4m3": dict(fp8_gemm="on", backend="torch", grad_format="e4m3"),
    "keep_weight_codes": dict(fp8_gemm="on", backend="torch", keep_weight_codes=True),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("autocast", [False, True])
def test_matches_nn_linear(path, autocast):
    if path == "fp8_triton_interpreted" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    ref, m = _pair(config=Fp8LinearConfig(**PATHS[path]))
    torch.manual_seed(1)
    x, g = torch.randn(B, S, K) * 3, torch.randn(B, S, N)
    y0, dx0, dw0, db0 = _run(ref, x, g)  # FP32 oracle
    y, dx, dw, db = _run(m, x, g, autocast)
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32) and dx.dtype == torch.float32
    assert dw.dtype == db.dtype == torch.float32
    results = {"y": sqnr_db(y0, y), "dx": sqnr_db(dx0, dx), "dw": sqnr_db(dw0, dw), "db": sqnr_db(db0, db)}
    fp8 = PATHS[path]["fp8_gemm"] == "on"
    # Without FP8 GEMMs forward and input gradient are nn.Linear's own (BF16 under autocast).
    assert results["y"] > (FWD_DB if fp8 else (35 if autocast else 100)), results
    assert results["dx"] > (DX_DB if fp8 else (35 if autocast else 100)), results
    assert results["dw"] > DW_DB, results
    assert results["db"] > (35 if autocast else 100), results
    for t in (y, dx, dw, db):
        assert torch.isfinite(t).all()


def test_saves_only_fp8_input_and_params():
    """Backward keeps the FP8 transposed input codes and their scale, nothing else of x."""
    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    x = torch.randn(B, S, K)
    saved = _saved_by(m, x)
    params = [t for t in saved if isinstance(t, nn.Parameter)]
    others = [t for t in saved if not isinstance(t, nn.Parameter)]
    assert [p is m.weight for p in params] == [True]
    m_pad = -(-B * S // 16) * 16
    assert sorted((t.dtype, tuple(t.shape)) for t in others if t.numel() > 1) == [(torch.uint8, (K, m_pad))]
    # Plus two int32 exponents: the input's and the weight's (kept so backward skips its max).
    assert sum(t.numel() * t.element_size() for t in others) == K * m_pad + 4 + 4
    # The codes decode to the input within E4M3's error.
    codes = next(t for t in others if t.numel() > 1)
    e = next(t for t in others if t.numel() == 1)
    x_hat = reference.linear_dequantize(codes[:, :B * S], e).t()
    assert sqnr_db(x.reshape(-1, K), x_hat) > 28


def test_triton_kernel_matches_twin():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    linear_quantize = bound("fp8_linear").linear_quantize_triton

    torch.manual_seed(2)
    for shape, dtype in (((37, 96), torch.bfloat16), ((64, 130), torch.float32)):
        x = (torch.randn(shape) * 5).to(dtype)
        x[0, 0] = float("-inf")  # must not set the scale
        for fmt in ("e4m3", "e5m2"):
            got = linear_quantize(x, fmt, True, True)
            want = reference.linear_quantize(x, fmt, True, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, fmt)
            assert got[2].item() == want[2].item()
            finite = reference.linear_dequantize(want[0], want[2], fmt)[1:]
            assert sqnr_db(x[1:].float(), finite) > (28 if fmt == "e4m3" else 22)
    zeros = torch.zeros(20, 32)
    codes, codes_t, e = linear_quantize(zeros, "e4m3", True, True)
    assert not codes.any() and not codes_t.any() and codes_t.shape == (32, 32)
    # A given exponent replaces the max pass; a larger one than the max asks for keeps the
    # kernel and twin equal too (values shrink into E4M3's subnormals).
    x = torch.randn(64, 130) * 5
    e0 = reference.linear_quantize(x, "e4m3")[2]
    for e in (e0, e0 + 3, e0 - 2):
        got = linear_quantize(x, "e4m3", True, True, exp=e.reshape(1))
        want = reference.linear_quantize(x, "e4m3", True, True, exp=e)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2].item() == e.item()


def _check_guessed_exponent(device):
    from coat_ds.kernels.fp8_linear import new_guess

    linear_quantize = bound("fp8_linear").linear_quantize_triton
    torch.manual_seed(15)
    for shape, dtype in (((37, 96), torch.bfloat16), ((64, 130), torch.float32)):
        x = (torch.randn(shape, device=device) * 5).to(dtype)
        x[0, 0] = float("-inf")
        for fmt in ("e4m3", "e5m2"):
            want = reference.linear_quantize(x, fmt, True, True)
            for miss in (0, 3, -2):  # the guess holds, is too large, too small
                state = new_guess(want[2] + miss)
                got = linear_quantize(x, fmt, True, True, guess=state)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, fmt, miss)
                assert got[2].item() == want[2].item() == state[0].item(), (shape, fmt, miss)
    zeros = torch.zeros(20, 32, device=device)
    want = reference.linear_quantize(zeros, "e4m3", True, True)
    got = linear_quantize(zeros, "e4m3", True, True, guess=new_guess(want[2] + 5))
    assert not got[0].any() and not got[1].any() and got[2].item() == want[2].item()


def test_weight_quantize_from_a_guessed_exponent():
    """Given the exponent a weight had last time, the kernels write codes with it and again
    only where its max says otherwise: the result is always that of the current tensor's max
    (the guess right, too large or too small; an infinity; an all-zero tensor)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    _check_guessed_exponent("cpu")


def test_weight_guess_follows_a_changing_weight():
    """Through the op, a weight quantized step after step, its scale moving (x8, /64) and
    its storage rewritten in place: the codes and exponent equal the twin's every time, and
    the guess state handed in holds the exponent found."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    from coat_ds.kernels import get, layout

    quantize = get("fp8_linear", torch.device("cpu"), "triton").quantize_kept
    guess = layout.new_weight_guess(torch.device("cpu"))
    torch.manual_seed(16)
    w = torch.randn(48, 96)
    for step, scale in enumerate((1.0, 1.0, 8.0, 8.0, 1 / 64, 1.0)):
        with torch.no_grad():
            w.copy_(torch.randn(48, 96) * scale)
        got = quantize(w, "e4m3", True, True, guess=guess)
        want = reference.linear_quantize(w, "e4m3", True, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
        assert got[2].item() == want[2].item() == guess[0].item(), step


def test_quantize_op_declares_the_guess_it_updates():
    """The state the kernels update is an argument the op's schema marks as written, so that
    torch.compile functionalizes it instead of missing it."""
    args = {a.name: a for a in torch.ops.coat_ds.fp8_linear_quantize.default._schema.arguments}
    assert args["guess"].alias_info is not None and args["guess"].alias_info.is_write
    assert all(a.alias_info is None for name, a in args.items() if name != "guess")


def _held(guess):
    # new_guess's layout: [exponent, max bits, exponent the last guess pass wrote with].
    return guess[2].item() == guess[0].item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_reuses_the_weight_exponent(monkeypatch, backend):
    """Backward quantizes the weight again with forward's exponent: one max pass per tensor
    per step (input and weight in forward, output gradient in backward), not a second one
    over the weight, and the same gradients as recomputing it. Our Triton kernels start the
    weight's cast from the exponent in the layer's guess (its last step's, 0 before the
    first) and fold its max there: no weight max pass at all."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    from coat_ds.kernels import fp8_linear

    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend=backend))
    e_w = reference.linear_quantize(m.weight.detach(), "e4m3")[2]
    calls = []
    real_ref, real_launch = fp8_linear.linear_finite_absmax, fp8_linear.launch

    def counting_ref(x, split=0):
        calls.append(tuple(x.shape))
        return real_ref(x, split)

    def counting_launch(fn, *a, **k):
        if fn is fp8_linear._finite_absmax_kernel:
            calls.append(fn)
        return real_launch(fn, *a, **k)

    monkeypatch.setattr(fp8_linear, "linear_finite_absmax", counting_ref)
    monkeypatch.setattr(fp8_linear, "launch", counting_launch)
    torch.manual_seed(4)
    x, g = torch.randn(B, S, K), torch.randn(B, S, N)
    _, dx, dw, _ = _run(m, x, g)
    assert len(calls) == (2 if backend == "triton" else 3), calls
    guess = m.fp8_weight_guess
    if backend == "triton":  # started from exponent 0, it now holds the weight's
        assert (guess[0].item(), guess[2].item()) == (e_w.item(), 0) and e_w.item() != 0
    else:
        assert not guess.any()  # the twin ignores it
    calls.clear()
    _run(m, x, g)
    assert len(calls) == (2 if backend == "triton" else 3), calls
    if backend == "triton":  # this step's guess held: the codes were written once
        assert guess[0].item() == e_w.item() and _held(guess)
    wq_t_fresh = reference.linear_quantize(m.weight.detach(), "e4m3", False, True)[1]
    assert torch.equal(reference.linear_quantize(m.weight.detach(), "e4m3", False, True, exp=e_w)[1], wq_t_fresh)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


@pytest.mark.parametrize("execute", [True, False])
def test_eager_call_dispatches_only_what_it_needs(execute):
    """Host work per call (small layers wait on the host). Eagerly a layer calls the
    Triton launchers itself, not through the custom op (whose dispatch costs host time and
    an empty tensor per absent output), and turns each exponent into a GEMM scale once: x's
    and the weight's in forward, kept for backward, and the output gradient's, read by both
    backward GEMMs. The census counts the same whether the kernels run or not."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    _, m = _pair(bias=False, config=Fp8LinearConfig(fp8_gemm="on", backend="triton"))
    torch.manual_seed(4)
    x, g = torch.randn(B, S, K), torch.randn(B, S, N)
    _run(m, x, g)
    with census().Census(execute=execute) as c:
        _run(m, x, g)
    assert c.ops["fp8_linear_quantize"] == 0, c.ops
    assert c.ops["__lshift__"] == 3 and c.ops["_scaled_mm"] == 3, c.ops  # one scale per quantized tensor
    # x and g: max pass and cast; weight: cast from its guess and fix-up, in backward from
    # forward's exponent.
    assert c.launches == {"_finite_absmax_kernel": 2, "_quantize_t_kernel": 5}, c.launches
    assert sum(c.ops.values()) <= 55, c.ops  # 75 before the launchers were called directly


def test_weight_guess_is_the_layers_not_the_address():
    """Two layers whose weights sit at one address (one storage, rescaled in place between
    their calls, as a freed weight's memory is reused by another): each keeps its own guess,
    so the first layer's guess still holds on its next call, and every output equals the
    twin's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    _, a = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="triton"))
    _, b = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="triton"))
    _, twin = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))  # same parameters
    w = a.weight.detach()
    b.weight, twin.weight = nn.Parameter(w), nn.Parameter(w)
    assert b.weight.data_ptr() == a.weight.data_ptr()
    e_a = reference.linear_quantize(w, "e4m3")[2].item()
    x = torch.randn(B, S, K)
    with torch.no_grad():
        for step, (layer, scale) in enumerate(((a, 1.0), (b, 64.0), (a, 1 / 64))):
            w.mul_(scale)
            assert torch.equal(layer(x), twin(x)), step
    assert a.fp8_weight_guess[0].item() == e_a and _held(a.fp8_weight_guess)
    assert b.fp8_weight_guess[0].item() == e_a + 6


def test_weight_guess_is_a_buffer_that_moves_with_the_layer():
    """The guess is a non-persistent buffer: state_dict keys stay nn.Linear's, Module.to moves
    it and a dtype cast leaves it int32; a layer whose weight went elsewhere by other means
    gets a guess there."""
    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    assert list(m.state_dict()) == ["weight", "bias"]
    assert [n for n, _ in m.named_buffers()] == ["fp8_weight_guess"]
    m.to(torch.bfloat16)
    assert m.fp8_weight_guess.dtype == torch.int32 and m.weight.dtype == torch.bfloat16
    m.to("meta")
    assert m.fp8_weight_guess.device.type == "meta"
    m.to_empty(device="cpu")
    m.weight = nn.Parameter(m.weight.detach().to("meta"))  # as engines swap parameters
    assert m._weight_guess(m.weight).device.type == "meta" and m.fp8_weight_guess.device.type == "meta"
    fresh = Fp8Linear(K, N, device="meta")
    assert fresh.fp8_weight_guess.device.type == "meta" and list(fresh.state_dict()) == ["weight", "bias"]


def test_any_guess_gives_the_twins_codes():
    """Whatever the guess holds (a layer made on meta and materialized with to_empty holds
    garbage), the layer's output is the twin's and the guess ends at the weight's exponent."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="triton"))
    _, twin = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    e_w = reference.linear_quantize(m.weight.detach(), "e4m3")[2].item()
    x = torch.randn(B, S, K)
    for junk in ((-2**31, 7, 2**31 - 1), (2**31 - 1, -1, -2**31), (127, 0, -127), (e_w + 1, 0, e_w), (e_w, 0, 0)):
        m.fp8_weight_guess.copy_(torch.tensor(junk))
        with torch.no_grad():
            assert torch.equal(m(x), twin(x)), junk
        assert m.fp8_weight_guess[0].item() == e_w, junk


def test_split_max_is_the_max():
    """The output gradient's max reduced in runs of 16 is the same max: finite values only,
    an infinity or NaN anywhere ignored, zeros giving zero, and sizes that do not divide."""
    torch.manual_seed(11)
    for shape in ((37, 48), (64, 96), (3, 5)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, dtype=dtype) * 7
            x.view(-1)[3] = float("inf")
            x.view(-1)[-2] = float("nan")
            want = reference.linear_finite_absmax(x)
            assert want > 0 and torch.isfinite(want)
            assert torch.equal(reference.linear_finite_absmax(x, 16), want), (shape, dtype)
            z = torch.zeros(shape, dtype=dtype)
            assert reference.linear_finite_absmax(z, 16) == 0
            assert torch.equal(reference.linear_quantize(x, "e5m2", True, True, split=16)[0],
                               reference.linear_quantize(x, "e5m2", True, True)[0])


def test_keep_weight_codes_holds_fp8_not_the_weight():
    """keep_weight_codes: backward reads forward's transposed FP8 weight, so the gradients are
    those of casting it again, and what the layer saves is that 1-byte copy, not the weight."""
    _, base = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    _, kept = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch", keep_weight_codes=True))
    torch.manual_seed(12)
    x, g = torch.randn(B, S, K), torch.randn(B, S, N)
    for a, b in zip(_run(base, x, g, autocast=True), _run(kept, x, g, autocast=True)):
        assert torch.equal(a, b)
    saved = _saved_by(kept, x)
    assert not any(t is kept.weight for t in saved)
    codes = [t for t in saved if t.dtype == torch.uint8 and t.shape[0] == K]
    # The input's transposed copy (K, M padded) and the weight's (K, N): one byte each.
    assert sorted(tuple(t.shape) for t in codes) == [(K, N), (K, 80)], [t.shape for t in codes]
    assert any(t is base.weight for t in _saved_by(base, x))


@pytest.mark.slow
def test_keep_weight_codes_compiled_backward_reads_no_weight():
    """Compiled, AOTAutograd would recompute a twin's cast of a parameter in backward rather
    than save it; the kept copy comes from a custom op, so backward takes no weight at all."""
    import re

    from torch._inductor.utils import run_and_get_code

    def backward_inputs(keep):
        torch._dynamo.reset()
        torch.manual_seed(13)
        m = _AttnMlp()
        convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", keep_weight_codes=keep))
        x = torch.randn(4, 32, 64, requires_grad=True)

        def step(x):
            with torch.autocast("cpu", torch.bfloat16):
                y = torch.compile(m)(x)
            y.float().sum().backward()
            return x.grad

        dx, code = run_and_get_code(step, x)
        return dx, re.findall(r"primals_\d+", next(l for l in code[1].splitlines() if "= args" in l))

    dx_keep, keep_inputs = backward_inputs(True)
    dx_base, base_inputs = backward_inputs(False)
    assert keep_inputs == [] and len(base_inputs) == 6, (keep_inputs, base_inputs)
    assert sqnr_db(dx_base, dx_keep) > 40


def test_compiled_kernels_update_the_guess_in_place():
    """Compiled by Inductor, the op updating the layer's guess is handed the buffer itself
    (functionalized, then re-inplaced): no copy of the guess and no copy back per step."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="triton", keep_weight_codes=True))
    x = torch.randn(B, S, K, requires_grad=True)
    _, code = run_and_get_code(lambda x: torch.compile(m, fullgraph=True)(x).sum().backward(), x)
    guess = re.search(r"assert_size_stride\((\w+), \(3, \), \(1, \)", code[0]).group(1)
    assert re.search(rf"fp8_linear_quantize\.default\(\w+, [^\n]*, {guess}[,)]", code[0]), code[0]
    assert not [line for line in code[0].splitlines() if guess in line and "copy" in line]
    assert m.fp8_weight_guess[0].item() == reference.linear_quantize(m.weight.detach(), "e4m3")[2].item()


def test_state_dict_both_ways():
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16, bias=False))
    converted = convert_to_fp8_linear(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16, bias=False)),
                                      module_filter_fn=lambda m, fqn: True)
    assert isinstance(converted[0], Fp8Linear) and isinstance(converted[0], nn.Linear)
    assert converted.state_dict().keys() == plain.state_dict().keys()
    converted.load_state_dict(plain.state_dict())
    back = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16, bias=False))
    back.load_state_dict(converted.state_dict())
    for a, b in zip(plain.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    # Conversion keeps the very Parameter objects (optimizers and engines hold them).
    before = [id(p) for p in plain.parameters()]
    convert_to_fp8_linear(plain, module_filter_fn=lambda m, fqn: True)
    assert [id(p) for p in plain.parameters()] == before


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 30)  # 30 is no multiple of 16
        self.down = nn.Linear(30, 32)
        self.lm_head = nn.Linear(32, 128)

    def forward(self, x):
        return self.lm_head(self.down(self.odd(torch.relu(self.up(x)))))


def test_conversion_filter_and_log(caplog):
    with caplog.at_level(logging.INFO, logger="coat_ds.linear"):
        model = convert_to_fp8_linear(_Tiny())
    kinds = {n: type(m).__name__ for n, m in model.named_children()}
    assert kinds == {"up": "Fp8Linear", "odd": "Linear", "down": "Linear", "lm_head": "Linear"}
    msg = caplog.records[-1].getMessage()
    assert "1 nn.Linear converted, 2 skipped (dims" in msg and "1 skipped by the filter" in msg, msg
    assert "GEMMs in FP8 on cpu" in msg
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coat_ds.linear"):
        convert_to_fp8_linear(_Tiny(), config=Fp8LinearConfig(fp8_gemm="off"), module_filter_fn=lambda m, f: True)
    assert "fp8_gemm='off'" in caplog.records[-1].getMessage() and caplog.records[-1].levelno == logging.WARNING
    with pytest.raises(ValueError, match="grad_format and weight_format"):
        Fp8LinearConfig(weight_format="e5m2", input_format="e4m3", grad_format="e5m2")
    with pytest.raises(ValueError, match="fp8_gemm"):
        Fp8LinearConfig(fp8_gemm="yes")
    with pytest.raises(TypeError, match="Fp8LinearConfig"):
        convert_to_fp8_linear(_Tiny(), config={"fp8_gemm": "on"})


def test_second_conversion_configures_only_what_its_filter_chooses():
    """Two calls with disjoint filters: each layer keeps the config of the call that chose it
    (kept weight codes for the MLP only, say)."""
    model = nn.Sequential(collections.OrderedDict(attn=nn.Linear(32, 32), mlp=nn.Linear(32, 64)))
    keep = Fp8LinearConfig(keep_weight_codes=True)
    convert_to_fp8_linear(model, config=keep, module_filter_fn=lambda m, fqn: fqn == "mlp")
    convert_to_fp8_linear(model, module_filter_fn=lambda m, fqn: fqn == "attn")
    assert model.mlp.fp8_config == keep and model.attn.fp8_config == Fp8LinearConfig()
    convert_to_fp8_linear(model, module_filter_fn=lambda m, fqn: True)  # chosen again: reconfigured
    assert model.mlp.fp8_config == Fp8LinearConfig()


def test_no_double_quantization_with_compress_activations():
    """The hooks store the layer's FP8 input as it is: 1 byte per element plus the scale."""
    _, m = _pair(bias=False, config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    model = nn.Sequential(m, nn.SiLU())
    handle = coat_ds.compress_activations(model, config=coat_ds.ActivationConfig(backend="torch", min_numel=256))
    x = torch.randn(B, S, K)
    handle.reset_stats()
    model(x).sum().backward()
    st = handle.stats()
    m_pad = -(-B * S // 16) * 16
    assert st.compressed_tensors == 1  # SiLU's input, per group
    assert st.kept_tensors == 3 and st.kept_bytes == K * m_pad + 4 + 4, st  # codes, 2 exponents
    assert torch.isfinite(m.weight.grad).all()


def test_checkpoint_and_grad_accumulation():
    from torch.utils.checkpoint import checkpoint

    ref, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    torch.manual_seed(4)
    xs = [torch.randn(B, S, K) for _ in range(2)]
    for x in xs:
        ref(x).pow(2).sum().backward()
        checkpoint(m, x, use_reentrant=False).pow(2).sum().backward()
    assert sqnr_db(ref.weight.grad, m.weight.grad) > DW_DB


def test_torch_compile_fullgraph():
    """No graph break per layer: with the torch twins (Inductor fuses them) and with the
    Triton custom op (traced through its fake implementation)."""
    from coat_ds.kernels import fp8

    torch._dynamo.reset()
    for backend in ("auto", "torch", "triton"):
        if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        ref, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend=backend))
        eager = nn.Linear(K, N)
        eager.load_state_dict(ref.state_dict())
        convert_to_fp8_linear(eager, config=Fp8LinearConfig(fp8_gemm="on", backend="torch"),
                              module_filter_fn=lambda mod, fqn: True)
        compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
        torch.manual_seed(5)
        x, g = torch.randn(B, S, K), torch.randn(B, S, N)
        y0, dx0, dw0, _ = _run(eager, x, g)
        fp8._LOGGED.clear()  # so the first-call log line is met while tracing: it must not break the graph
        y, dx, dw, _ = _run(compiled, x, g)
        assert sqnr_db(y0, y) > 40 and sqnr_db(dx0, dx) > 40 and sqnr_db(dw0, dw) > 40, backend
        # The op's update of the layer's guess survives functionalization (twins ignore it).
        e_w = reference.linear_quantize(m.weight.detach(), "e4m3")[2].item() if backend == "triton" else 0
        assert m.fp8_weight_guess[0].item() == e_w, backend


class _AttnMlp(nn.Module):
    """q/k/v read one input, gate/up another, down a third: three FP8 inputs in all."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.gate, self.up = (nn.Linear(d, h, bias=False) for _ in range(2))
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        a = self.q(x) + self.k(x) * 2 + self.v(x) * 3
        return self.down(self.gate(a) - self.up(a))


def test_inductor_writes_one_fp8_copy_per_input_for_sibling_gemms():
    """Inductor's _scaled_mm lowering materializes a cast once per GEMM reading it unless its
    layout is fixed: compiled, q/k/v must read one FP8 buffer (and gate/up one), forward and
    backward, with gradients equal to the eager layer's."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = _AttnMlp()
    eager, m = _AttnMlp(), _AttnMlp()
    for mod in (eager, m):
        mod.load_state_dict(ref.state_dict())
        convert_to_fp8_linear(mod, config=Fp8LinearConfig(fp8_gemm="on"))
    x, g = torch.randn(4, 32, 64), torch.randn(4, 32, 64)

    def step(model, x, autocast=True):
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = model(x)
        y.backward(g.to(y.dtype))
        return [y, x.grad] + [getattr(model, n).weight.grad for n in ("q", "gate", "down")]

    compiled, code = run_and_get_code(step, torch.compile(m), x)
    exact = step(ref, x, autocast=False)
    # Compiled and eager round differently (Inductor keeps FP32 between BF16 ops), which
    # moves FP8 codes by one step: both are held to FP32, not to each other.
    for i, (e, a, b) in enumerate(zip(exact, step(eager, x), compiled)):
        assert sqnr_db(e, b) > sqnr_db(e, a) - 1.5 and sqnr_db(e, b) > 18, (i, sqnr_db(e, a), sqnr_db(e, b))
    fwd = re.findall(r"_scaled_mm\((?:aten\.view\.dtype\()?(\w+)", code[0])
    assert len(fwd) == 6 and len(set(fwd)) == 3, fwd  # six GEMMs, three distinct inputs
    # The weight gradients contract over tokens: their second operand is the transposed
    # input copy, one per distinct input.
    dw = re.findall(r"_scaled_mm\(aten\.view\.dtype\(\w+, [\w.]+\), (?:aten\.view\.dtype\()?"
                    r"(?:reinterpret_tensor\()?(\w+)[^\n]*out_dtype=torch\.float32", code[1])
    assert len(dw) == 6 and len(set(dw)) == 3, dw


def test_train_py_flag_and_yaml_key(tmp_path):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train

    assert train.TrainConfig().fp8_linear is False
    assert train.parse_config(["--fp8-linear"]).fp8_linear is True
    y = tmp_path / "c.yaml"
    y.write_text("fp8_linear: true\n")
    assert train.parse_config(["--config", str(y)]).fp8_linear is True
    assert train.parse_config(["--config", str(y), "--no-fp8-linear"]).fp8_linear is False
    assert train.parse_config(["--fp8-linear", "--fp8-keep-weight-codes"]).fp8_keep_weight_codes is True
    with pytest.raises(SystemExit) as bad:
        train.parse_config(["--fp8-keep-weight-codes"])
    assert "fp8_keep_weight_codes" in str(bad.value.code) and "fp8_linear" in str(bad.value.code)


def test_zero_and_nonfinite_inputs():
    """All-zero input: output is the bias, gradients finite (dW zero). A -inf element does
    not set the scale: the other tokens' outputs keep FP8 accuracy."""
    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    y, dx, dw, db = _run(m, torch.zeros(B, S, K), torch.randn(B, S, N))
    assert torch.equal(y, m.bias.detach().expand_as(y)) and not dw.any() and torch.isfinite(dx).all()
    ref, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    x = torch.randn(B, S, K)
    x[0, 0, 0] = float("-inf")
    with torch.no_grad():
        y0, y = ref(x), m(x)
    assert sqnr_db(y0[1], y[1]) > FWD_DB


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_cuda_matches_nn_linear(backend):
    """On a GPU: cuBLASLt FP8 GEMMs (capability 8.9+) or the fallback, same bounds as on CPU."""
    ref, m = _pair(config=Fp8LinearConfig(backend=backend))
    ref, m = ref.cuda(), m.cuda()
    torch.manual_seed(6)
    x, g = torch.randn(B, S, K, device="cuda") * 3, torch.randn(B, S, N, device="cuda")
    y0, dx0, dw0, _ = _run(ref, x, g)
    y, dx, dw, _ = _run(m, x, g, autocast=True)
    assert sqnr_db(y0, y) > FWD_DB and sqnr_db(dx0, dx) > DX_DB and sqnr_db(dw0, dw) > DW_DB


@pytest.mark.gpu
def test_cuda_weight_quantize_from_a_guessed_exponent():
    _check_guessed_exponent("cuda")


@pytest.mark.gpu
def test_cuda_kernel_and_twin_agree_with_and_without_a_given_exponent():
    """The Triton kernel and the twin (BF16 scaled in BF16 on the GPU too) give the same
    codes, and a given exponent gives the codes of the exponent it equals."""
    linear_quantize = bound("fp8_linear").linear_quantize_triton

    torch.manual_seed(7)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(300, 272, device="cuda") * 7).to(dtype)
        for fmt in ("e4m3", "e5m2"):
            got, want = linear_quantize(x, fmt, True, True), reference.linear_quantize(x, fmt, True, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2].item() == want[2].item()
            again = linear_quantize(x, fmt, False, True, exp=want[2].reshape(1))
            assert torch.equal(again[1], want[1]) and again[2].item() == want[2].item()


def test_input_gradient_in_the_compute_dtype_under_autocast():
    """An FP32 input under BF16 autocast gets its gradient from a BF16 GEMM output, cast up,
    as nn.Linear's does: an FP32 GEMM output would double the bytes of every such gradient."""
    _, m = _pair(config=Fp8LinearConfig(fp8_gemm="on", backend="torch"))
    torch.manual_seed(5)
    x, g = torch.randn(B, S, K), torch.randn(B, S, N)
    y, dx, _, _ = _run(m, x, g, autocast=True)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert torch.equal(dx.to(torch.bfloat16).float(), dx)
    _, dx32, _, _ = _run(m, x, g, autocast=False)  # no autocast: FP32 all the way
    assert not torch.equal(dx32.to(torch.bfloat16).float(), dx32)


def test_twin_scales_bf16_without_upcasting_and_agrees():
    """The twin scales BF16 in BF16 (exact for a power of two: BF16 has FP32's exponent
    range); its codes equal those of the same values as FP32, over a wide spread of
    magnitudes, signed zeros, inf and NaN."""
    torch.manual_seed(6)
    x = (torch.randn(64, 96) * torch.exp2(torch.randint(-40, 40, (64, 96)).float())).to(torch.bfloat16)
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    for fmt in ("e4m3", "e5m2"):
        got = reference.linear_quantize(x, fmt, True, True)
        want = reference.linear_quantize(x.float(), fmt, True, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2].item() == want[2].item()


class _Siblings(nn.Module):
    """Three layers reading one input, as q/k/v do."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(K, N) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) * 2 + self.v(x) * 3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sibling_layers_share_one_fp8_copy_of_their_input(monkeypatch, backend):
    """Eagerly, layers called on the same tensor quantize it once and backward keeps one
    copy; the gradients are those of separate copies (the codes are the same)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    _check_siblings_share(monkeypatch, backend, "cpu")


@pytest.mark.gpu
def test_sibling_layers_share_one_fp8_copy_on_cuda(monkeypatch):
    _check_siblings_share(monkeypatch, "auto", "cuda")


def _check_siblings_share(monkeypatch, backend, device):
    from coat_ds.linear import shared_input

    torch.manual_seed(8)
    m = _Siblings().to(device)
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", backend=backend),
                          module_filter_fn=lambda mod, fqn: True)
    x, g = torch.randn(B, S, K, device=device), torch.randn(B, S, N, device=device)
    saved = [t for t in _saved_by(m, x) if t.dtype == torch.uint8]
    assert len(saved) == 3 and len({t.untyped_storage().data_ptr() for t in saved}) == 1

    def grads(share: bool):
        if not share:
            monkeypatch.setattr(shared_input.SharedInput, "codes_for", lambda shared, recipe: None)
        m.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        m(xr).backward(g)
        return [xr.grad] + [p.grad for p in m.parameters()]

    shared, separate = grads(True), grads(False)
    for a, b in zip(shared, separate):
        assert torch.equal(a, b)


def test_shared_input_misses_on_change_and_clears_in_backward():
    """An in-place change of the input, another recipe or a new tensor is a miss; backward
    drops the codes."""
    from coat_ds.linear import shared_input

    torch.manual_seed(9)
    m = _Siblings()
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", backend="torch"),
                          module_filter_fn=lambda mod, fqn: True)
    x = torch.randn(B, S, K)
    with torch.no_grad():
        m.q(x)
        assert shared_input.on(x).codes_for(("e4m3", True, "torch")) is not None
        assert shared_input.on(x).codes_for(("e5m2", True, "torch")) is None
        assert shared_input.on(x.clone()).codes_for(("e4m3", True, "torch")) is None
        x.mul_(100)  # the cached codes no longer match x
        assert shared_input.on(x).codes_for(("e4m3", True, "torch")) is None
        y_after, y_fresh = m.k(x), nn.functional.linear(x, m.k.weight, m.k.bias)
    assert sqnr_db(y_fresh, y_after) > FWD_DB
    xr = x.clone().requires_grad_()
    y = m(xr)
    assert shared_input.on(xr).codes_for(("e4m3", True, "torch")) is not None
    y.sum().backward()
    assert shared_input.on(xr).codes_for(("e4m3", True, "torch")) is None


def test_shared_codes_die_with_their_input_not_at_backward():
    """The row-major codes that siblings share are read only by their forwards: once the input
    they were made from is gone, nothing keeps them (the layers hold them weakly), so a
    forward through every layer of a model leaves none of them alive for backward."""
    import gc

    from coat_ds.linear.shared_input import SharedInput

    m = _Siblings()
    convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on", backend="torch"),
                          module_filter_fn=lambda mod, fqn: True)

    def kept() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, SharedInput) and o.codes is not None)

    before = kept()
    x = torch.randn(B, S, K, requires_grad=True)
    y = m(x * 2)  # an input that only the layers see
    assert kept() == before
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("ckpt", [None, "non-reentrant", "reentrant"])
def test_shared_input_on_hf_llama_gives_the_same_gradients(ckpt):
    """On a Hugging Face Llama with compress_activations, with and without activation
    checkpointing (whose recomputation quantizes again): sharing the siblings' input copy
    gives gradients bit-equal to one copy per layer."""
    from unittest import mock

    from transformers import LlamaConfig, LlamaForCausalLM

    from coat_ds.linear import shared_input

    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=4,
                      num_hidden_layers=2, vocab_size=1000, attn_implementation="sdpa", use_cache=False)

    def grads(share: bool):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg)
        convert_to_fp8_linear(m, config=Fp8LinearConfig(fp8_gemm="on"))
        coat_ds.compress_activations(m)
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        m.train()
        ids = torch.randint(0, cfg.vocab_size, (2, 64))
        real, hits = shared_input.SharedInput.codes_for, []

        def codes_for(shared, recipe):
            found = real(shared, recipe) if share else None
            hits.append(found is not None)
            return found

        with mock.patch.object(shared_input.SharedInput, "codes_for", codes_for), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            m(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in m.parameters()], sum(hits)

    (shared, hits), (separate, _) = grads(True), grads(False)
    # q/k/v share one copy (2 hits) and gate/up one (1 hit) per layer, per forward run.
    assert hits == 2 * 3 * (2 if ckpt else 1), hits
    assert all(g is not None for g in shared)
    assert all(torch.equal(a, b) for a, b in zip(shared, separate))
