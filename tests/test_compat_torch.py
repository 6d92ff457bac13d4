"""coat_ds/_compat/torch.py: each private torch access forced to fail takes its documented
fallback, warns once naming the feature and the torch version, and keeps results correct;
no private torch access is left outside coat_ds/_compat/."""
from __future__ import annotations

import importlib
import re
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import coat_ds
import coat_ds._compat as compat
from coat_ds import ActivationConfig
from coat_ds._compat import torch as ct
from coat_ds.activation import api, hooks, traced
from coat_ds.activation.policy import KEEP, Policy
from test_act_compile import _graph_saved
from test_act_llama_block import GRAD_SQNR_DB, block_grads, make_block, rope_tables, sqnr_db

CFG = ActivationConfig(backend="torch", min_numel=256)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test starts with no feature warned about yet."""
    monkeypatch.setattr(compat, "_WARNED", set())


@pytest.fixture
def reload_compat(monkeypatch):
    """Reloads _compat/torch.py (its import-time probes) under the test's monkeypatches,
    and again with them undone afterwards."""
    yield lambda: importlib.reload(ct)
    monkeypatch.undo()
    importlib.reload(ct)


def _one_warning(record, feature: str) -> str:
    """The one RuntimeWarning of `record`; it names `feature` and torch's version."""
    msgs = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert feature in msgs[0] and torch.__version__ in msgs[0], msgs[0]
    return msgs[0]


def _twice(fn, *args, **kwargs):
    """fn called twice under a warnings recorder: (results, record)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = [fn(*args, **kwargs), fn(*args, **kwargs)]
    return out, record


def test_warn_once_per_key():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            compat.warn_once("a", "first a")
            compat.warn_once("b", "first b")
    assert [str(w.message) for w in record] == ["first a", "first b"]
    assert all(w.category is RuntimeWarning for w in record)


# ---- functorch config ---------------------------------------------------------------------

def test_missing_functorch_options_are_left_out_of_compile_settings(monkeypatch):
    monkeypatch.setattr(ct, "_functorch_config", types.SimpleNamespace(saved_tensors_hooks_filtering_mode="donated"))
    cfg = ActivationConfig(backend="torch", compiled_recompute=True)
    (got, again), record = _twice(traced.compile_settings, cfg)
    _one_warning(record, "ban_recompute_materialized_backward")
    assert got == again == {"saved_tensors_hooks_filtering_mode": traced.FILTERING_MODE}


def test_compile_settings_with_every_option_present_warn_nothing():
    cfg = ActivationConfig(backend="torch", compiled_recompute=True)
    (got, _), record = _twice(traced.compile_settings, cfg)
    assert not record
    assert set(got) == {"saved_tensors_hooks_filtering_mode", "ban_recompute_materialized_backward"}


def test_activation_memory_budget_set_and_restored():
    import torch._functorch.config as functorch_config
    before = functorch_config.activation_memory_budget
    with ct.activation_memory_budget(0.25):
        assert functorch_config.activation_memory_budget == 0.25
    assert functorch_config.activation_memory_budget == before


def test_missing_activation_memory_budget_is_ignored_with_a_warning(monkeypatch):
    monkeypatch.setattr(ct, "_functorch_config", types.SimpleNamespace())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            with ct.activation_memory_budget(0.25):
                pass
        assert ct.set_activation_memory_budget(0.5) is None
    _one_warning(record, "activation_memory_budget")
    assert vars(ct._functorch_config) == {}


# ---- dynamo config ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["recompile_limit", "cache_size_limit"])
def test_recompile_limit_raised_under_either_name(monkeypatch, name):
    config = types.SimpleNamespace(**{name: 8})
    monkeypatch.setattr(ct, "_find", lambda module, attr: config)
    (_, _), record = _twice(ct.raise_recompile_limit, 64)
    assert not record and getattr(config, name) == 64


def test_missing_recompile_limit_warns_once(monkeypatch):
    monkeypatch.setattr(ct, "_find", lambda module, attr: types.SimpleNamespace())
    _, record = _twice(ct.raise_recompile_limit, 64)
    _one_warning(record, "recompile_limit")


# ---- torch._C -----------------------------------------------------------------------------

def test_missing_graph_task_id_resolves_to_the_fallback(monkeypatch, reload_compat):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    fresh = reload_compat()
    assert fresh.current_graph_task_id is fresh._no_graph_task
    (a, b), record = _twice(fresh.current_graph_task_id)
    assert a == b == -1
    _one_warning(record, "_current_graph_task_id")


class _Checkpointed(nn.Module):
    """A compressed MLP inside a checkpoint."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.mlp, x, use_reentrant=self.reentrant)


def _checkpoint_grads(reentrant: bool, compress: bool):
    model = _Checkpointed(reentrant)
    handle = compress_mlp(model) if compress else None
    torch.manual_seed(1)
    x = torch.randn(8, 16, 64, requires_grad=True)
    model(x).square().sum().backward()
    if handle is not None:
        handle.remove()
    return [x.grad] + [p.grad for p in model.parameters()]


def compress_mlp(model):
    return coat_ds.compress_activations(model, config=CFG, module_filter_fn=lambda m, fqn: fqn == "mlp")


@pytest.mark.parametrize("reentrant, feature, fallback", [
    (True, "_current_graph_task_id", "_no_graph_task"),
    (False, "_top_saved_tensors_default_hooks", None)])
def test_checkpoint_fallbacks_keep_gradients_within_bound(monkeypatch, reentrant, feature, fallback):
    want = _checkpoint_grads(reentrant, compress=False)
    if fallback is not None:
        monkeypatch.setattr(api, "current_graph_task_id", getattr(ct, fallback))
    else:
        monkeypatch.setattr(ct, "_top_hooks", None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _checkpoint_grads(reentrant, compress=True)
        got = _checkpoint_grads(reentrant, compress=True)
    _one_warning(record, feature)
    for w, g in zip(want, got):
        assert sqnr_db(w, g) > GRAD_SQNR_DB


def test_missing_fake_tensor_type_resolves_to_the_rest(monkeypatch, reload_compat):
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    monkeypatch.delattr(fake_tensor, "FakeTensor")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fresh = reload_compat()
    _one_warning(record, "FakeTensor")
    assert fresh.TRACED_TENSOR_TYPES == (FunctionalTensor,)


def test_pack_keeps_an_unrecognized_traced_tensor_exact(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(hooks, "_TRACED", ())  # the fallback with neither type found
    comp = hooks.SavedTensorCompressor(CFG)
    with FakeTensorMode() as mode:
        t = mode.from_tensor(torch.randn(64, 64)).requires_grad_(True)
        saved = comp.pack(t)
    assert isinstance(saved, hooks.Kept) and comp.unpack(saved) is t


def test_missing_generated_nodes_warn_once(monkeypatch):
    monkeypatch.delattr(torch._C, "_functions")
    (a, b), record = _twice(ct.autograd_node_classes, ("ScaledDotProductFlashAttentionForCpuBackward0",))
    assert a == b == set()
    _one_warning(record, "torch._C._functions")


def test_attention_nodes_found_here():
    assert ct.autograd_node_classes(("ScaledDotProductFlashAttentionForCpuBackward0", "NoSuchBackward0")) == {
        torch._C._functions.ScaledDotProductFlashAttentionForCpuBackward0}


def test_block_gradients_within_bound_without_attention_nodes(monkeypatch):
    """The documented cost of the fallback: attention's O compressed per group, gradients
    still within the compression bound."""
    block = make_block(torch.float32, dim=64)
    torch.manual_seed(2)
    x = torch.randn(2, 32, 64)
    cos, sin = rope_tables(32, 16, torch.float32)
    want = block_grads(block, x, cos, sin)
    monkeypatch.setattr(hooks, "ATTENTION_NODES", frozenset())
    handle = coat_ds.compress_activations(block, config=CFG)
    got = block_grads(block, x, cos, sin)
    assert handle.stats().compressed_tensors > 0
    for n in want:
        assert sqnr_db(want[n], got[n]) > GRAD_SQNR_DB, n


def test_missing_flex_attention_node_warns_once(monkeypatch):
    real = ct._find
    monkeypatch.setattr(ct, "_find", lambda m, a: None if a == "FlexAttentionAutogradOp" else real(m, a))
    (a, b), record = _twice(ct.flex_attention_backward_node)
    assert a is b is None
    _one_warning(record, "FlexAttentionAutogradOp")


def test_missing_dispatch_guard_detaches_in_sight(monkeypatch, reload_compat):
    monkeypatch.delattr(torch._C, "_DisableTorchDispatch")
    fresh = reload_compat()
    t = torch.randn(4, 4, requires_grad=True) * 2
    (a, b), record = _twice(fresh.detach_unseen, t)
    _one_warning(record, "_DisableTorchDispatch")
    assert a.data_ptr() == t.data_ptr() and not a.requires_grad and torch.equal(a, t)


# ---- AOTAutograd: hook context and static inputs --------------------------------------------

def _cast_graphs():
    """A forward graph (w, x) -> x @ w.to(bf16), saving the cast, and its backward."""
    fw = torch.fx.Graph()
    w, x = fw.placeholder("w"), fw.placeholder("x")
    cast = fw.call_function(torch.ops.prims.convert_element_type.default, (w, torch.bfloat16))
    out = fw.call_function(torch.ops.aten.mm.default, (x, cast))
    fw.output((out, cast))
    bw = torch.fx.Graph()
    saved, grad = bw.placeholder("cast"), bw.placeholder("grad")
    gw = bw.call_function(torch.ops.aten.mm.default, (grad, saved))
    bw.output([gw, gw])
    return fw, bw, cast


def test_static_inputs_not_found_keep_weight_casts_exact():
    """Outside AOTAutograd's inlining frame (as on a torch whose function moved) the static
    inputs are unknown: every input counts as one, so a weight's cast is a weight copy,
    which the policy keeps exact (it was compressed before, without a word)."""
    fw, bw, cast = _cast_graphs()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        facts = traced._GraphFacts(fw, bw).of(cast)
        traced._GraphFacts(fw, bw)
    _one_warning(record, "static_input_indices")
    assert facts["weight_copy"]
    assert Policy(CFG).decide(dtype=torch.bfloat16, numel=4096, row_len=64, dense_order=True, linear_input=False,
                              **facts) == KEEP


def _compiled_mlp_grads(compress: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    handle = coat_ds.compress_activations(model, config=CFG) if compress else None
    fn = torch.compile(model, backend="aot_eager")
    torch.manual_seed(1)
    x = torch.randn(8, 16, 64, requires_grad=True)
    out = fn(x)
    saved_dtypes = {t.dtype for t in _graph_saved(out)}
    out.square().sum().backward()
    if handle is not None:
        handle.remove()
    return [x.grad] + [p.grad for p in model.parameters()], saved_dtypes


@pytest.mark.xfail(torch.__version__ < "2.13", strict=True, raises=RuntimeError,
                   reason="torch 2.11 (the GPU machine's) falls back to eager around the forced pack, whose hook "
                          "then fails autograd's in-place check (seen on the H100, 2026-11-25): open")
@pytest.mark.parametrize("forced", ["context", "frame"])
def test_compiled_graphs_without_graph_facts_compress_nothing(monkeypatch, forced):
    """Without AOTAutograd's hook context (or its static inputs) the traced pack keeps the
    values it cannot tell apart: the compiled gradients equal uncompressed ones."""
    torch._dynamo.reset()
    want, _ = _compiled_mlp_grads(compress=False)
    torch._dynamo.reset()
    if forced == "context":
        monkeypatch.setattr(ct, "_hook_context", None)
        feature = "_get_saved_tensor_hook_context"
    else:
        monkeypatch.setattr(ct, "_INLINE_CODE", None)
        feature = "static_input_indices"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got, dtypes = _compiled_mlp_grads(compress=True)
    torch._dynamo.reset()
    _one_warning(record, feature)
    if forced == "context":
        assert dtypes <= {torch.float32}, dtypes  # no FP8 codes saved
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    else:
        # The intermediates (GELU's input) are still compressed; inputs' views stay exact.
        for w, g in zip(want, got):
            assert sqnr_db(w, g) > GRAD_SQNR_DB


# ---- Inductor stride pin, FP8 GEMM ------------------------------------------------------------

def test_force_stride_order_and_its_fallback(monkeypatch):
    import torch._inductor.inductor_prims  # noqa: F401  (registers the op, as compiling does)
    t = torch.randn(8, 16)
    torch.testing.assert_close(ct.force_stride_order(t), t, rtol=0, atol=0)
    monkeypatch.setattr(ct, "_STRIDE_OP", "no_such_op")
    (a, b), record = _twice(ct.force_stride_order, t)
    assert a is t and b is t
    _one_warning(record, "inductor_force_stride_order")


def _fp8_operands(m=32, k=64, n=48):
    torch.manual_seed(3)
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()
    return a, b, torch.tensor(0.5), torch.tensor(2.0 ** -3)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulated_scaled_mm_matches_torch(out_dtype):
    a, b, sa, sb = _fp8_operands()
    bias = torch.randn(48).to(out_dtype)
    want = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    with pytest.warns(RuntimeWarning, match=r"torch\._scaled_mm"):
        got = ct._emulated_scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    tol = 1e-5 if out_dtype is torch.float32 else 8e-3  # FP32 rounding; one BF16 ulp
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    out = torch.empty_like(want)
    assert ct._emulated_scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, out=out) is out
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


def test_missing_scaled_mm_binds_the_emulation(monkeypatch, reload_compat):
    monkeypatch.delattr(torch, "_scaled_mm")
    fresh = reload_compat()
    assert not fresh.HAS_SCALED_MM and fresh.scaled_mm is fresh._emulated_scaled_mm
    _, record = _twice(fresh.scaled_mm, *_fp8_operands(), out_dtype=torch.float32)
    _one_warning(record, "torch._scaled_mm")


def test_fp8_linear_on_the_emulated_gemm(monkeypatch):
    from coat_ds import Fp8LinearConfig, convert_to_fp8_linear
    from coat_ds.linear import function
    torch.manual_seed(0)
    ref = nn.Linear(64, 48)
    m = convert_to_fp8_linear(nn.Sequential(nn.Linear(64, 48)), config=Fp8LinearConfig(fp8_gemm="on",
                                                                                        backend="torch"))
    m[0].load_state_dict(ref.state_dict())
    x = torch.randn(4, 16, 64)
    native = m(x)
    monkeypatch.setattr(function, "scaled_mm", ct._emulated_scaled_mm)
    with pytest.warns(RuntimeWarning, match=r"torch\._scaled_mm"):
        emulated = m(x)
    torch.testing.assert_close(emulated, native, rtol=1e-5, atol=1e-5)
    assert sqnr_db(ref(x), emulated) > 25


# ---- No private access outside coat_ds/_compat ---------------------------------------------------

# Per dependency, what counts as private access (the done-when grep). The triton and
# deepspeed entries belong with their _compat modules.
PRIVATE_ACCESS_PATTERNS = {
    "torch": r"torch\._(functorch|inductor|dynamo|C|prims|subclasses|higher_order_ops)|_aot_autograd"
             r"|sys\._getframe|torch\._scaled_mm\(|prims\.inductor_force_stride_order",
    # the check over every dependency
    "any": r"torch\._(functorch|inductor|dynamo|C|prims|subclasses|higher_order_ops)|_aot_autograd|sys\._getframe"
           r"|CompiledKernel|\._[A-Za-z]+__[a-z]",
}


@pytest.mark.parametrize("dependency", list(PRIVATE_ACCESS_PATTERNS))
def test_private_access_only_in_compat(dependency):
    root = Path(coat_ds.__file__).parent
    pattern = re.compile(PRIVATE_ACCESS_PATTERNS[dependency])
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("_compat/"):
            continue
        found += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                  if pattern.search(line)]
    assert not found, "\n".join(found)
