"""`coat_ds.prepare`: each recipe on Hugging Face Llama, Mistral, Qwen2, Gemma and GPT-2 built
from configs, coat_ds's own Llama and a plain module: the report names every edit, and the
prepared model's loss and gradients stay within the FP8 bounds of the unprepared model's."""
from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch
from torch import nn

import coat_ds
from coat_ds.linear import Fp8Linear
from coat_ds.loss.fuse import LossHead
from coat_ds.plan.recompute import is_recomputed
from helpers import sqnr_db

transformers = pytest.importorskip("transformers")

VOCAB = 256
STEPS = ("head_loss", "fp8_linear", "fuse_norms", "fuse_swiglu", "compress_activations", "recompute",
         "compile_regions")
# What each model takes of the max_memory recipe (every edit); the others take a prefix of it.
TAKES = {
    "llama": set(STEPS), "mistral": set(STEPS), "qwen2": set(STEPS),
    "gemma": set(STEPS) - {"fuse_norms", "fuse_swiglu"},  # 1 + weight norms; a GELU MLP
    "gpt2": {"head_loss", "compress_activations", "recompute", "compile_regions"},  # Conv1D; a GELU MLP
    "own": set(STEPS) - {"fuse_swiglu"},  # w_gate/w_up/w_down, not Hugging Face's names
    "plain": {"fp8_linear", "compress_activations"},
}
RECIPE_STEPS = {"speed": {*STEPS[:4], "compile_regions"}, "memory": {*STEPS[:5], "compile_regions"},
                "max_memory": set(STEPS)}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "own":
        from coat_ds.models.llama import Llama, model_config

        return Llama(model_config("tiny", vocab_size=VOCAB))
    if kind == "plain":
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    common = dict(vocab_size=VOCAB, use_cache=False)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0, **common))
    names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "gemma": "Gemma"}[kind]
    extra = {"head_dim": 16} if kind == "gemma" else {}
    cfg = getattr(transformers, f"{names}Config")(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=64, **extra, **common)
    return getattr(transformers, f"{names}ForCausalLM")(cfg)


def _loss(model: nn.Module, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if kind == "plain":
            return model(torch.randn(96, 64, generator=g)).float().pow(2).mean()
        ids = torch.randint(0, VOCAB, (2, 48), generator=g)
        if kind == "own":
            return model(ids[:, :-1], ids[:, 1:])
        return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("recipe", ["speed", "memory", "max_memory"])
@pytest.mark.parametrize("kind", list(TAKES))
def test_each_recipe_reports_what_it_applied_and_stays_within_fp8_bounds(kind, recipe):
    """BF16 autocast on CPU against the same model unprepared: the loss within 1e-3 relative
    (the plain MLP's mean square: 1e-2);
    every gradient at >= 15 dB SQNR and their mean >= 19 dB (measured: 18.4-19.7 dB worst
    over these models and recipes, 20.9-23.7 dB mean; docs/fp8_linear.md's GEMM bounds)."""
    plain = _model(kind)
    model = copy.deepcopy(plain)
    report = coat_ds.prepare(model, recipe)
    expected = TAKES[kind] & RECIPE_STEPS[recipe]
    assert [s.name for s in report.steps] == list(STEPS)
    assert set(report.applied()) == expected, str(report)
    for step in report.steps:
        assert step.detail and step.name in str(report)
        if step.name not in RECIPE_STEPS[recipe]:
            assert step.detail == "off in this recipe"
    assert report.optimizer_options == ({"step_in_backward": True} if recipe == "max_memory" else {})
    assert (report.activations is not None) == ("compress_activations" in expected)
    if "fp8_linear" in expected:
        assert any(isinstance(m, Fp8Linear) for m in model.modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    assert isinstance(head, LossHead) == ("head_loss" in expected) and not isinstance(head, Fp8Linear)
    assert any(is_recomputed(m) for m in model.modules()) == ("recompute" in expected)
    assert list(model.state_dict()) == list(plain.state_dict())
    ref, got = _loss(plain, kind), _loss(model, kind)
    # An LM's loss near log(vocab) hides the FP8 forward's error; the MLP's mean square does not.
    bound = 1e-2 if kind == "plain" else 1e-3
    assert abs(got.item() - ref.item()) <= bound * abs(ref.item()), (got.item(), ref.item())
    ref.backward()
    got.backward()
    params = dict(model.named_parameters())
    dbs = {name: sqnr_db(p.grad, params[name].grad) for name, p in plain.named_parameters()}
    assert min(dbs.values()) >= 15, {k: round(v, 1) for k, v in dbs.items() if v < 15}
    finite = [v for v in dbs.values() if v != float("inf")]  # GPT-2's speed recipe leaves its layers exact
    assert not finite or sum(finite) / len(finite) >= 19, dbs


def test_skipped_steps_say_why():
    gpt2 = coat_ds.prepare(_model("gpt2"), "speed")
    assert "Conv1D, not nn.Linear" in gpt2["fp8_linear"].detail
    assert "LayerNorm" in gpt2["fuse_norms"].detail
    assert "no gated MLP" in gpt2["fuse_swiglu"].detail
    gemma = coat_ds.prepare(_model("gemma"), "speed")
    assert "GemmaRMSNorm left as they are" in gemma["fuse_norms"].detail
    assert "not SiLU" in gemma["fuse_swiglu"].detail
    plain = coat_ds.prepare(_model("plain"), "speed")
    assert "Sequential is not supported; supported: LlamaForCausalLM" in plain["head_loss"].detail
    with pytest.raises(KeyError, match="no step 'nope'"):
        plain["nope"]


def test_overrides_and_filter():
    model = _model("llama")
    report = coat_ds.prepare(model, "memory", head_loss=False, fp8_linear=coat_ds.Fp8LinearConfig(fp8_gemm="off"),
                             module_filter_fn=lambda m, fqn: not fqn.startswith("model.layers.1"))
    assert report["head_loss"].detail == "off in this recipe"
    assert "in the input's precision (fp8_gemm='off'" in report["fp8_linear"].detail
    converted = [fqn for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert converted and all(fqn.startswith("model.layers.0.") for fqn in converted)
    assert report.activations.regions == ["model.layers.0"]
    assert "1 decoder layers" in report["compress_activations"].detail


def test_refusals_name_the_bad_value():
    with pytest.raises(ValueError, match=r"recipe must be one of \('speed', 'memory', 'max_memory'\), got 'fast'"):
        coat_ds.prepare(_model("plain"), "fast")
    with pytest.raises(TypeError, match=r"unknown recipe setting\(s\) \['fp8_linears'\]; valid: fp8_linear"):
        coat_ds.prepare(_model("plain"), "speed", fp8_linears=False)
    with pytest.raises(TypeError, match="compress_activations must be a bool, None or a ActivationConfig"):
        coat_ds.prepare(_model("plain"), "speed", compress_activations="yes")
    model = _model("plain")
    coat_ds.prepare(model, "memory")
    with pytest.raises(RuntimeError, match="prepared before \\(recipe 'memory'\\)"):
        coat_ds.prepare(model, "speed")


def test_the_report_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="coat_ds"):
        report = coat_ds.prepare(_model("llama"), "speed")
    logged = [r.getMessage() for r in caplog.records if r.name == "coat_ds"]
    assert logged == [str(report)]
    assert str(report).startswith("coat_ds.prepare(recipe='speed') on Hugging Face LlamaForCausalLM:")


def test_recomputed_layers_defer_to_a_checkpoint_around_them():
    """Hugging Face's gradient checkpointing around a layer prepare recomputed: one recompute,
    the same gradients as without that checkpoint."""
    ref, model = _model("llama"), _model("llama")
    for m in (ref, model):
        coat_ds.prepare(m, "max_memory", fp8_linear=False)
    model.gradient_checkpointing_enable()
    model.train()
    for m in (ref, model):
        _loss(m, "llama").backward()
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(p.grad, got[name].grad), name


def _hf_llama_4_layers():
    torch._dynamo.reset()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False))


def _compiled_against_plain(plain: nn.Module, compiled: nn.Module) -> None:
    """The loss of `compiled` (prepared, then `.compile()`d) and its gradients keep the FP8
    bounds of the eager test above against the plain model (compiled, the FP8 casts round other
    values than eagerly: not bit for bit)."""
    ref, got = _loss(plain, "llama"), _loss(compiled, "llama")
    assert abs(got.item() - ref.item()) <= 1e-3 * ref.item(), (got.item(), ref.item())
    ref.backward()
    got.backward()
    params = dict(compiled.named_parameters())
    dbs = {name: sqnr_db(p.grad, params[name].grad) for name, p in plain.named_parameters()}
    assert min(dbs.values()) >= 15 and sum(dbs.values()) / len(dbs) >= 19, dbs


@pytest.mark.slow
def test_whole_model_compile_compiles_one_region_for_every_layer():
    """prepare's compile_regions: under `model.compile()` (what Trainer's torch_compile=True
    does) each decoder layer runs one compiled graph shared by all layers of its class, the code
    between the layers runs eagerly (no trace there: the final norm sees no compile), and the
    loss and gradients keep the FP8 bounds."""
    plain = _hf_llama_4_layers()
    compiled = copy.deepcopy(plain)
    report = coat_ds.prepare(compiled, "speed")
    assert "4 decoder layers" in report["compile_regions"].detail
    assert type(compiled).__name__ == "LlamaForCausalLM" and isinstance(compiled, transformers.LlamaForCausalLM)
    assert inspect.signature(compiled.forward) == inspect.signature(plain.forward)  # Trainer keeps columns by it
    region = type(compiled.model.layers[0])._coat_region
    assert all(type(layer)._coat_region is region for layer in compiled.model.layers)
    traced = []
    compiled.model.norm.register_forward_pre_hook(lambda m, a: traced.append(torch.compiler.is_compiling()))
    compiled.compile()
    _compiled_against_plain(plain, compiled)
    assert traced == [False]
    # Compiled once for all four layers, not per layer.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = region._torchdynamo_orig_callable.__code__
    assert 1 <= len(_debug_get_cache_entry_list(code)) <= 2
    assert compiled.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.slow
def test_whole_model_compile_with_gradient_checkpointing():
    """Trainer's gradient_checkpointing=True with torch_compile=True: a checkpointed layer runs
    its own forward both times (the recomputation in backward runs outside the model's call),
    and the loss and gradients keep the FP8 bounds."""
    plain = _hf_llama_4_layers()
    compiled = copy.deepcopy(plain)
    getattr(compiled, "activation_checkpointing_enable", compiled.gradient_checkpointing_enable)()
    coat_ds.prepare(compiled, "speed")
    compiled.compile()
    compiled.train()
    _compiled_against_plain(plain, compiled)
