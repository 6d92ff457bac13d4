"""Recomputed layers that keep their input as FP8 codes (`ApplyConfig(recompute_input_fp8=True)`):
forward exact, gradients within a stated bound of exact recomputation, the input's bytes gone
between forward and backward, the same under torch.compile, and in-place changes refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from coat_ds.config import ActivationConfig
from coat_ds.memory.meters import StorageMeter
from coat_ds.plan import ApplyConfig, Plan, apply_plan, compile_layer, decoder_layers, training_loss
from helpers import sqnr_db

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_INPUT = ApplyConfig(recompute_input_fp8=True)


@pytest.fixture(scope="module")
def hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                                   num_hidden_layers=3, vocab_size=512, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _ids(seed=1, batch=2, seq=33):
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = training_loss(model, ids)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def _recompute_all(model, config=FP8_INPUT):
    fqns = [f for f, _ in decoder_layers(model)]
    return apply_plan(model, Plan.uniform(fqns, "recompute", 2, 32), config=config)


def test_forward_exact_gradients_within_bound_then_removed(hf_llama):
    ids = _ids()
    ref_loss, ref = _loss_and_grads(hf_llama, ids)
    applied = _recompute_all(hf_llama, ApplyConfig())
    exact_loss, exact = _loss_and_grads(hf_llama, ids)
    applied.remove()
    assert torch.equal(exact_loss, ref_loss)

    applied = _recompute_all(hf_llama)
    loss, grads = _loss_and_grads(hf_llama, ids)
    applied.remove()
    # Forward reads the exact input; only backward's recomputation reads the FP8 one.
    assert torch.equal(loss, ref_loss)
    assert torch.isfinite(grads).all() and not torch.equal(grads, exact)
    # Measured 34.6 dB (e4m3, groups of 16) on this model and batch.
    assert sqnr_db(exact, grads) > 28, sqnr_db(exact, grads)
    # The embedding's gradient comes back through every layer's input gradient.
    emb = hf_llama.model.embed_tokens.weight.numel()
    assert sqnr_db(exact[:emb], grads[:emb]) > 28

    again_loss, again = _loss_and_grads(hf_llama, ids)
    assert torch.equal(again_loss, ref_loss) and torch.equal(again, ref)


def test_format_follows_the_activation_config(hf_llama):
    ids = _ids(2)
    applied = _recompute_all(hf_llama, ApplyConfig())
    _, exact = _loss_and_grads(hf_llama, ids)
    applied.remove()
    got = {}
    for fmt in ("e4m3", "e5m2"):
        applied = _recompute_all(hf_llama, ApplyConfig(activation=ActivationConfig(other_format=fmt),
                                                       recompute_input_fp8=True))
        got[fmt] = sqnr_db(exact, _loss_and_grads(hf_llama, ids)[1])
        applied.remove()
    # One mantissa bit fewer costs ~6 dB (measured 34.7 and 28.5).
    assert got["e4m3"] > got["e5m2"] + 3, got


def test_input_bytes_gone_between_forward_and_backward(hf_llama):
    """What stays alive after forward: every recomputed layer's FP32 input (4 B/element) with
    exact recomputation, (1 + 1/16) B/element as codes."""
    ids = _ids(3, batch=4, seq=65)
    alive = {}
    for name, config in (("exact", ApplyConfig()), ("fp8", FP8_INPUT)):
        applied = _recompute_all(hf_llama, config)
        hf_llama.zero_grad(set_to_none=True)
        meter = StorageMeter()
        meter.start()
        loss = training_loss(hf_llama, ids)
        meter.stop()
        alive[name] = meter.now
        loss.backward()
        applied.remove()
    layers = len(decoder_layers(hf_llama))
    inputs = layers * 4 * 64 * hf_llama.config.hidden_size  # elements of all layers' inputs
    saved = alive["exact"] - alive["fp8"]
    assert saved >= (4 - 1 - 1 / 16) * inputs * 0.99, (alive, inputs)


def _eager_then_compiled_copy(model, ids, compile_each):
    """Loss and gradients of `model` with every layer recomputed from FP8 inputs, eagerly; then
    a copy set up the same way with `compile_each(layer)` on each layer, and its handle."""
    applied = _recompute_all(model)
    loss, grads = _loss_and_grads(model, ids)
    applied.remove()
    copied = copy.deepcopy(model)
    applied = _recompute_all(copied)
    for _, layer in decoder_layers(copied):
        compile_each(layer)
    return loss, grads, copied, applied


def test_compiled_layers_match_eager(hf_llama):
    ids = _ids(4)
    eager_loss, eager, model, applied = _eager_then_compiled_copy(
        hf_llama, ids, lambda layer: compile_layer(layer, backend="aot_eager"))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = _loss_and_grads(model, ids)
            again_loss, again = _loss_and_grads(model, ids)
        assert not [w for w in caught if "compile_layer" in str(w.message)]
    finally:
        applied.remove()
        torch._dynamo.reset()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert sqnr_db(eager, grads) > 60, sqnr_db(eager, grads)
    assert torch.equal(again, grads) and torch.equal(again_loss, loss)


def test_plain_recompute_still_compiles_whole_layer(hf_llama):
    model = copy.deepcopy(hf_llama)
    applied = _recompute_all(model, ApplyConfig())
    layer = decoder_layers(model)[0][1]
    compile_layer(layer, backend="eager")
    try:
        assert layer._compiled_call_impl is not None
        loss, _ = _loss_and_grads(model, _ids(5))
        assert torch.isfinite(loss)
    finally:
        applied.remove()
        torch._dynamo.reset()


def test_layer_compile_around_it_warns_once_and_stays_correct(hf_llama):
    ids = _ids(6)
    _, eager, model, applied = _eager_then_compiled_copy(hf_llama, ids, lambda layer: layer.compile(backend="eager"))
    try:
        with pytest.warns(UserWarning, match="compile it with coat_ds.plan.compile_layer") as caught:
            _, grads = _loss_and_grads(model, ids)
            _loss_and_grads(model, ids)
    finally:
        applied.remove()
        for _, layer in decoder_layers(model):
            layer._compiled_call_impl = None
        torch._dynamo.reset()
    assert sum("compile_layer" in str(w.message) for w in caught) == len(decoder_layers(model))  # once per layer
    assert torch.equal(grads, eager)


def test_input_changed_in_place_after_forward_is_refused():
    layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})
    applied = apply_plan(model, Plan.uniform(["layers.0"], "recompute", 1, 1), config=FP8_INPUT)
    x = torch.randn(4, 32, requires_grad=True)
    h = x * 1.0  # a non-leaf input, as a layer's input is
    out = layer(h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match=r"input of a recomputed layer .* was modified in place"):
        out.sum().backward()
    applied.remove()


def test_input_passed_as_hidden_states_keyword():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, hidden_states, scale=1.0):
            return torch.tanh(self.lin(hidden_states)) * scale

    torch.manual_seed(0)
    layer = Layer()
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})
    x = torch.randn(8, 16, requires_grad=True)
    (layer(hidden_states=x, scale=2.0).sum()).backward()
    ref = x.grad.clone()
    x.grad = None
    applied = apply_plan(model, Plan.uniform(["layers.0"], "recompute", 1, 1), config=FP8_INPUT)
    layer(hidden_states=x, scale=2.0).sum().backward()
    applied.remove()
    assert not torch.equal(x.grad, ref) and sqnr_db(ref, x.grad) > 25, sqnr_db(ref, x.grad)


def test_config_type_checked():
    with pytest.raises(TypeError, match="recompute_input_fp8 must be a bool, got 'yes'"):
        ApplyConfig(recompute_input_fp8="yes")


@pytest.mark.gpu
def test_gpu_input_bytes_and_bound_on_hf_llama():
    """On CUDA (Triton codec, BF16 autocast): the allocator holds less after forward by the
    inputs' FP32 bytes less their codes', and the gradients stay within the CPU bound."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=4, num_hidden_layers=4, vocab_size=32000,
                                   max_position_embeddings=512, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    ids = torch.randint(0, 32000, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    held, grads = {}, {}
    for name, config in (("exact", ApplyConfig()), ("fp8", FP8_INPUT)):
        applied = _recompute_all(model, config)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = training_loss(model, ids)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        applied.remove()
    inputs = 4 * 4 * 256 * 256  # layers x tokens x hidden
    assert held["exact"] - held["fp8"] >= (4 - 1 - 1 / 16) * inputs * 0.95, (held, inputs)
    assert torch.isfinite(grads["fp8"]).all()
    assert sqnr_db(grads["exact"], grads["fp8"]) > 25, sqnr_db(grads["exact"], grads["fp8"])


def test_planner_measures_the_smaller_input(hf_llama):
    """Measured with the ApplyConfig the run will use, a recomputed layer holds its input's
    codes rather than the FP32 input: about 2.9 bytes per element less."""
    from coat_ds.plan import MeasureConfig, measure_choices

    def measured(config):
        m = measure_choices(hf_llama, lambda p: torch.optim.AdamW(p, lr=1e-3), apply_config=config,
                            config=MeasureConfig(seq_len=32, batches=(2,), timed_steps=1, choices=("keep", "recompute")))
        return m.run("recompute", 2).layer_bytes

    exact, fp8 = measured(ApplyConfig()), measured(FP8_INPUT)
    per_layer = 2 * 32 * hf_llama.config.hidden_size  # input elements of one layer at micro-batch 2
    for e, f in zip(exact, fp8):
        assert e - f >= (4 - 1 - 1 / 16) * per_layer * 0.95, (exact, fp8, per_layer)
