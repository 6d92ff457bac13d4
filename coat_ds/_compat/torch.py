"""Every private torch access of coat_ds (docs/compat.md, section torch).

Each wrapper is probed once, at import or at its first use, and was checked on torch 2.13
(CPU) and 2.11 (CUDA). Where a probe fails the wrapper takes its documented fallback and
warns once (RuntimeWarning) naming the feature, this torch version and the fallback. The
fallbacks keep results correct: where a fact about a saved tensor cannot be read, the
tensor is kept exact rather than compressed. Hot-path wrappers are torch's own functions
bound to module names, so calling them costs what calling torch directly does."""
from __future__ import annotations

import contextlib
import importlib
import sys

import torch

from . import warn_once

__all__ = [
    "VERSION", "swap_functorch_options", "has_functorch_option", "set_activation_memory_budget",
    "activation_memory_budget", "raise_recompile_limit", "current_graph_task_id", "top_saved_tensors_hooks", "inside_checkpoint", "compiled_on_its_own",
    "TRACED_TENSOR_TYPES", "autograd_node_classes", "flex_attention_backward_node", "detach_unseen",
    "HAS_SAVED_TENSOR_HOOK_CONTEXT", "saved_tensor_hook_context", "static_input_indices", "force_stride_order",
    "HAS_SCALED_MM", "scaled_mm", "queue_backward_callback", "custom_op_function",
]

VERSION = torch.__version__


def _warn(feature: str, fallback: str) -> None:
    warn_once(f"torch:{feature}", f"coat_ds: {feature} is not available in torch {VERSION}; {fallback}")


def _find(module: str, name: str):
    """`module.name`, or None where either is missing."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


# ---- torch._functorch.config: AOTAutograd options ------------------------------------------

try:
    import torch._functorch.config as _functorch_config
except ImportError:
    _functorch_config = None


def has_functorch_option(name: str, fallback: str) -> bool:
    """Whether AOTAutograd has the option `name` (torch._functorch.config; checked on 2.11,
    2.13). Fallback: False, warning once with `fallback` (what happens without it)."""
    if _functorch_config is not None and hasattr(_functorch_config, name):
        return True
    _warn(f"torch._functorch.config.{name}", fallback)
    return False


def swap_functorch_options(settings: dict) -> dict:
    """Set AOTAutograd options (names `has_functorch_option` accepted; checked on 2.11, 2.13)
    and return the values they replace. Graphs compiled meanwhile read them."""
    previous = {k: getattr(_functorch_config, k) for k in settings}
    for k, v in settings.items():
        if previous[k] != v:
            setattr(_functorch_config, k, v)
    return previous


_BUDGET = "activation_memory_budget"


def set_activation_memory_budget(value: float) -> float | None:
    """Set torch.compile's activation-memory budget (torch._functorch.config.
    activation_memory_budget, read when a graph is compiled; checked on 2.11, 2.13); returns
    the value it replaces. Fallback: nothing set, None returned, warning once: graphs compile
    under the partitioner's default."""
    if not has_functorch_option(_BUDGET, "the plan's compile_memory_budget is ignored: graphs compile under "
                                         "the partitioner's default"):
        return None
    before = getattr(_functorch_config, _BUDGET)
    setattr(_functorch_config, _BUDGET, value)
    return before


@contextlib.contextmanager
def activation_memory_budget(budget: float | None):
    """torch.compile's activation-memory budget set to `budget` (None: left as it is) inside
    the block, restored after (set_activation_memory_budget's probe and fallback)."""
    before = set_activation_memory_budget(budget) if budget is not None else None
    try:
        yield
    finally:
        if before is not None:
            setattr(_functorch_config, _BUDGET, before)


# ---- torch._dynamo.config ------------------------------------------------------------------

def raise_recompile_limit(at_least: int) -> None:
    """torch.compile's recompilations per function raised to at least `at_least`
    (torch._dynamo.config.recompile_limit, cache_size_limit before torch 2.6; checked on
    2.11, 2.13). Fallback: left as it is, warning once: past it a function runs eagerly."""
    config = _find("torch._dynamo", "config")
    for name in ("recompile_limit", "cache_size_limit"):
        if config is not None and hasattr(config, name):
            setattr(config, name, max(at_least, getattr(config, name)))
            return
    _warn("torch._dynamo.config.recompile_limit", "the recompile limit is left as it is: functions that "
          "recompile past it run eagerly")


# ---- torch._C: autograd state, dispatch modes, generated autograd nodes -----------------------

def _no_graph_task() -> int:
    _warn("torch._C._current_graph_task_id", "compress_activations cannot tell backward from forward: tensors "
          "recomputed by reentrant checkpointing in backward are compressed too (time only; gradients within "
          "the usual FP8 bounds)")
    return -1


# The running backward pass's id, -1 outside backward (checked on 2.11, 2.13). Fallback:
# always -1, warning once.
current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None) or _no_graph_task

_engine_queue_callback = getattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)


def queue_backward_callback(fn, fallback: str) -> bool:
    """Run `fn()` once the running backward pass has finished, after the callbacks queued
    before it (torch.autograd.Variable._execution_engine.queue_callback; checked on 2.11,
    2.13). Must be called inside backward. Fallback: returns False without queueing,
    warning once with `fallback` (what the caller does instead)."""
    if _engine_queue_callback is None:
        _warn("torch.autograd.Variable._execution_engine.queue_callback", fallback)
        return False
    _engine_queue_callback(fn)
    return True


_maybe_get_opdef = _find("torch._library.custom_ops", "_maybe_get_opdef")


def custom_op_function(op):
    """The Python function behind a torch.library.custom_op `op` (an OpOverload), or None
    where `op` is not one (torch._library.custom_ops._maybe_get_opdef and the definition's
    `_init_fn`; checked on 2.13). Fallback where that is missing: None, warning once (the
    caller then treats the op as opaque)."""
    if _maybe_get_opdef is None:
        _warn("torch._library.custom_ops._maybe_get_opdef", "custom ops are taken as opaque")
        return None
    opdef = _maybe_get_opdef(op)
    return None if opdef is None else getattr(opdef, "_init_fn", None)


_top_hooks = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)


def top_saved_tensors_hooks():
    """The (pack, unpack) pair on top of autograd's saved-tensors hooks stack, or None
    (torch._C._autograd._top_saved_tensors_default_hooks; checked on 2.11, 2.13). Fallback:
    None, warning once: compression regions inside a non-reentrant checkpoint then store
    FP8 copies where the checkpoint would have stored nothing (memory only)."""
    if _top_hooks is None:
        _warn("torch._C._autograd._top_saved_tensors_default_hooks", "compress_activations cannot see a "
              "non-reentrant checkpoint around its regions and stores FP8 copies inside it (memory only)")
        return None
    return _top_hooks(False)


def compiled_on_its_own(module: torch.nn.Module) -> bool:
    """Whether `module.compile()` compiled this module's calls (nn.Module._compiled_call_impl;
    checked on 2.11, 2.13), or its forward was replaced on the instance (a compiled or
    checkpointed forward). Fallback: instance forward only."""
    return getattr(module, "_compiled_call_impl", None) is not None or "forward" in module.__dict__


def inside_checkpoint() -> bool:
    """Whether a non-reentrant torch.utils.checkpoint's hooks are on top of the saved-tensors
    hooks stack (its forward or its recomputation runs)."""
    top = top_saved_tensors_hooks()
    return top is not None and getattr(top[0], "__module__", "") == "torch.utils.checkpoint"


def _traced_tensor_types() -> tuple:
    fake = _find("torch._subclasses.fake_tensor", "FakeTensor")
    functional = _find("torch._subclasses.functional_tensor", "FunctionalTensor")
    if fake is None or functional is None:
        _warn("torch._subclasses FakeTensor/FunctionalTensor", "tensors saved while AOTAutograd traces a graph are "
              "told apart by torch.compiler.is_compiling() alone; where it is False they are kept exact")
    return tuple(t for t in (fake, functional) if t is not None)


# The tensor types AOTAutograd traces a saved-tensor hook with (checked on 2.11, 2.13).
# Probed at import: pack reads it per saved tensor. Fallback: the types found (none or one).
TRACED_TENSOR_TYPES = _traced_tensor_types()


def autograd_node_classes(names) -> set:
    """The generated autograd node classes of `names` that this torch has (torch._C.
    _functions; checked on 2.11, 2.13). Fallback, where torch._C._functions is gone: none,
    warning once: fused attention's output is then compressed as other activations are."""
    generated = getattr(torch._C, "_functions", None)
    if generated is None:
        _warn("torch._C._functions", "fused attention outputs are not recognized eagerly and are compressed "
              "per group as other activations")
        return set()
    return {getattr(generated, n) for n in names if hasattr(generated, n)}


def flex_attention_backward_node():
    """flex attention's autograd node class, or None where this torch has no flex attention
    (torch._higher_order_ops.flex_attention; checked on 2.11, 2.13). Fallback, where flex
    attention exists but that class is not found: None, warning once."""
    op = _find("torch._higher_order_ops.flex_attention", "FlexAttentionAutogradOp")
    node = getattr(op, "_backward_cls", None)
    if node is None and _find("torch.nn.attention.flex_attention", "flex_attention") is not None:
        _warn("torch._higher_order_ops.flex_attention.FlexAttentionAutogradOp", "flex attention's output is "
              "not recognized eagerly and is compressed per group as other activations")
    return node


_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
_no_dispatch = getattr(torch._C, "_DisableTorchDispatch", None)

if _dispatch_depth is not None and _no_dispatch is not None:
    def detach_unseen(t: torch.Tensor) -> torch.Tensor:
        """`t.detach()`, made where no Python dispatch mode sees it (torch._C.
        _len_torch_dispatch_stack and _DisableTorchDispatch; checked on 2.11, 2.13)."""
        if _dispatch_depth():
            with _no_dispatch():
                return t.detach()
        return t.detach()
else:
    def detach_unseen(t: torch.Tensor) -> torch.Tensor:
        """Fallback: `t.detach()` in sight of dispatch modes, warning once."""
        _warn("torch._C._DisableTorchDispatch", "FP8 copies' version aliases are made in sight of Python dispatch "
              "modes: the memory profiler's CPU meter may count their storage twice (accounting only)")
        return t.detach()


# ---- AOTAutograd's saved-tensor hook context and static inputs --------------------------------

_GRAPH_COMPILE = "torch._functorch._aot_autograd.graph_compile"
_hook_context = _find(_GRAPH_COMPILE, "_get_saved_tensor_hook_context")
# Whether AOTAutograd tells an inlined pack which graph value it packs (checked on 2.11, 2.13).
HAS_SAVED_TENSOR_HOOK_CONTEXT = _hook_context is not None


def saved_tensor_hook_context() -> dict | None:
    """The graph context AOTAutograd gives the pack it is tracing (`_node`, `_fw_graph`,
    `_bw_graph`), or None outside one (torch._functorch._aot_autograd.graph_compile.
    _get_saved_tensor_hook_context; checked on 2.11, 2.13). Fallback: None, warning once;
    the traced pack then keeps every value exact (no FP8 in compiled graphs)."""
    if _hook_context is None:
        _warn(f"{_GRAPH_COMPILE}._get_saved_tensor_hook_context", "compiled graphs keep every saved tensor exact "
              "(no FP8 in them; the eager path is unaffected)")
        return None
    return _hook_context()


def _inline_code():
    fn = _find(_GRAPH_COMPILE, "maybe_inline_graph_saved_tensors_hooks")
    code = getattr(fn, "__code__", None)
    return code if code is not None and "static_input_indices" in code.co_varnames else None


# The function whose local `static_input_indices` lists a forward graph's parameters and
# buffers, which AOTAutograd gives no hook (checked on 2.11, 2.13).
_INLINE_CODE = _inline_code()


def static_input_indices() -> list[int] | None:
    """Indices of the forward graph's static inputs (parameters, buffers), read from the
    frame of AOTAutograd's maybe_inline_graph_saved_tensors_hooks that calls the pack
    (checked on 2.11, 2.13). Fallback, where that frame is not found: None, warning once;
    callers then count every graph input as static, so casts of inputs (weight copies among
    them) are kept exact."""
    code = _INLINE_CODE
    frame = sys._getframe(1) if code is not None else None
    while frame is not None:
        if frame.f_code is code:
            return list(frame.f_locals.get("static_input_indices") or ())
        frame = frame.f_back
    _warn(f"{_GRAPH_COMPILE}.maybe_inline_graph_saved_tensors_hooks(static_input_indices)", "compiled graphs "
          "keep casts and views of every graph input exact (weight copies among them)")
    return None


# ---- Inductor's stride pin ---------------------------------------------------------------------

_STRIDE_OP = "inductor_force_stride_order"


def force_stride_order(t: torch.Tensor) -> torch.Tensor:
    """`t` with its strides pinned for Inductor (prims.inductor_force_stride_order, which
    Inductor registers when it loads: probed at each call, made only while compiling;
    checked on 2.11, 2.13): one buffer that every GEMM reading it shares. Fallback: `t` as
    it is, warning once: Inductor may write one FP8 copy per GEMM (speed and memory only)."""
    op = getattr(getattr(torch.ops.prims, _STRIDE_OP, None), "default", None)
    if op is None:
        _warn("torch.ops.prims.inductor_force_stride_order", "Inductor may write one FP8 copy of a shared input "
              "per GEMM that reads it (speed and memory only)")
        return t
    return op(t, t.stride())


# ---- FP8 GEMM ------------------------------------------------------------------------------------

HAS_SCALED_MM = hasattr(torch, "_scaled_mm")


def _emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, out=None):
    """torch._scaled_mm's result computed in FP32 from the dequantized operands: the same
    product to FP32 rounding, without FP8 GEMM speed."""
    _warn("torch._scaled_mm", "FP8 GEMMs are emulated in FP32 from the dequantized operands (same result to "
          "FP32 rounding, no FP8 speed-up)")
    y = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
    if bias is not None:
        y = y + bias.float()
    y = y.to(out_dtype if out_dtype is not None else a.dtype)
    return y if out is None else out.copy_(y)


# a @ b scaled per tensor, FP8 operands (torch._scaled_mm: cuBLASLt on CUDA; checked on 2.11
# CUDA, 2.13 CPU). torch's own function where present, so calling it costs nothing more.
# Fallback: _emulated_scaled_mm, warning once.
scaled_mm = torch._scaled_mm if HAS_SCALED_MM else _emulated_scaled_mm
