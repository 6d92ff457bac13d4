"""The hooks' compiled half: FP8 quantization written into torch.compile's graphs.

Our hooks reach autograd as `torch.fx.GraphModule`s. Eagerly they are plain calls into
`SavedTensorCompressor.pack`/`unpack`; but AOTAutograd treats a GraphModule pair on top of
the saved-tensor hooks stack as traceable and inlines it (`maybe_inline_graph_saved_tensors_hooks`):
the pack is traced on each saved value of a compiled forward graph (a FakeTensor) and put
at the graph's end, the unpack at the start of the backward graph, and at run time the
compiled function runs with the hooks disabled. Inductor then fuses the quantization into
the kernels that produce the tensor and the dequantization into those that read it back,
and no Python runs per saved tensor: the host cost that dominates the eager path is gone.

What to keep exact is decided by the same policy as eagerly (policy.py), from facts read off
the forward and backward graphs. A compressed value is quantized per group (group_size
consecutive elements, the non-linear inputs' granularity) whatever op saved it: a graph's
saved value does not say which op it feeds. Tensors are quantized in memory order and come
back with their strides; the codec is kernels/act_codec.py, the eager hooks' too (their
codes and exponents are the same for the same tensor), written for what Inductor makes of it."""
from __future__ import annotations

import hashlib
import operator
import weakref
from pathlib import Path

import torch

from .._compat import torch as compat_torch
from .._compat.torch import (HAS_SAVED_TENSOR_HOOK_CONTEXT, has_functorch_option, saved_tensor_hook_context,
                             static_input_indices)
from ..config import ActivationConfig
from ..kernels import act_codec, fp8, fp8_torch
from ..kernels.fp8 import get_format
from .packing import memory_order
from .policy import KEEP, SKIP, Policy

__all__ = ["graph_hook", "code_hash", "compile_settings", "TracedCodec", "TRACED_TAG", "ATTENTION_OPS"]

# Offer every saved value but parameters and other static inputs to the pack, which tells
# from the graphs which inputs are alive anyway. Without that context, only intermediates
# ("donated", torch's default), and the pack keeps them exact (_saved_value_facts).
FILTERING_MODE = "no_static" if HAS_SAVED_TENSOR_HOOK_CONTEXT else "donated"
TRACED_TAG = "coat_ds.fp8"


def compile_settings(config: ActivationConfig) -> dict:
    """AOTAutograd options a region sets while it runs: graphs compiled inside it read them."""
    settings = {}
    if has_functorch_option("saved_tensors_hooks_filtering_mode", "compiled graphs offer only their "
                            "intermediates to the pack (torch's default)"):
        settings["saved_tensors_hooks_filtering_mode"] = FILTERING_MODE
    if config.compiled_recompute and has_functorch_option(
            "ban_recompute_materialized_backward", "compiled_recompute has no effect: the partitioner saves what "
            "backward materializes anyway"):
        # The partitioner saves, rather than recomputes, a value that backward must
        # materialize anyway (a matrix product's input: a norm's output, the MLP's
        # silu(gate) * up, GQA's expanded k and v), since recomputing it costs a kernel.
        # Saved in FP8 it costs one too, its quantization in forward, and a recomputation
        # that reads FP8 inputs writes no more than a dequantization would: recomputing
        # is then the cheaper way, and its bytes are not stored at all.
        settings["ban_recompute_materialized_backward"] = False
    return settings


def _stands_for_a_hook(x):
    raise RuntimeError("coat_ds: a saved-tensor hook's placeholder graph was run; its module's __call__ is the hook")


def code_hash(config: ActivationConfig) -> str:
    """What the traced pack/unpack depend on: this code and the config."""
    h = hashlib.sha256(repr(config).encode())
    for path in (*sorted(Path(__file__).parent.glob("*.py")), Path(act_codec.__file__), Path(fp8_torch.__file__),
                 Path(fp8.__file__), Path(compat_torch.__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()


def graph_hook(fn, cache_hash: str) -> torch.fx.GraphModule:
    """A GraphModule that, called, is `fn`: AOTAutograd inlines hooks only of this type.

    Its graph is only what AOTAutograd's cache reads: one wrapped call whose cache hash is
    `cache_hash` (`code_hash`: our code and config), so that a cached compiled graph is never
    reused after either changes (an identity graph would key every configuration alike)."""
    graph = torch.fx.Graph()
    node = graph.call_function(_stands_for_a_hook, (graph.placeholder("x"),))
    node.meta["is_wrapped"] = True
    node.meta["user_cache_hash"] = cache_hash
    graph.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    # GraphModule gives each instance a class of its own; calling through nn.Module's
    # __call__ would add microseconds to every eager saved tensor.
    type(gm).__call__ = staticmethod(fn)
    return gm


# Ops through which a saved value is still its input's memory or a cast of it.
_VIEWS = {torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.view.default,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default, torch.ops.aten.transpose.int,
          torch.ops.aten.expand.default, torch.ops.aten.alias.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.detach.default}
_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _attention_ops() -> frozenset:
    """The ops whose first output is a fused attention's O, every overload (the policy's
    `attention_output`; hooks.ATTENTION_NODES are their autograd nodes): SDPA's flash (CUDA
    and CPU), efficient, cuDNN and overrideable kernels, the ops behind them, and flex
    attention's higher-order op. Their backward reads O for rowsum(dO * O). An op this torch
    version lacks is left out."""
    aten = torch.ops.aten
    ops = set()
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
                 "_efficient_attention_forward", "_cudnn_attention_forward"):
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops)


ATTENTION_OPS = _attention_ops()


def _attention_output(node) -> bool:
    """`node` is (a view of) the first output of an attention op."""
    while node.op == "call_function" and node.target in _VIEWS and node.args:
        node = node.args[0]
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0
            and getattr(node.args[0], "target", None) in ATTENTION_OPS)


def _attention_input(node) -> bool:
    """`node`, or a view, cast or copy of it (`.contiguous()`, GQA's repeated k and v), is
    an input of an attention op: q, k or v."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u.target in ATTENTION_OPS:
                return True
            if u.target in _VIEWS or u.target in _CASTS or u.target is torch.ops.aten.clone.default:
                todo.append(u)
    return False


# The facts of a value that outlives the graph (only alive_anyway decides it).
_ALIVE = dict(alive_anyway=True, grad_flows=True, weight_copy=False, attention_output=False, attention_input=False)


class _GraphFacts:
    """What one forward graph says about its values, computed once per graph."""

    def __init__(self, fw: torch.fx.Graph, bw: torch.fx.Graph):
        inputs = list(fw.find_nodes(op="placeholder"))
        grads = bw.output_node().args[0]
        # The backward graph returns one gradient per forward input, None where none flows;
        # if the counts differ we cannot tell, and count every input as getting one.
        known = len(grads) == len(inputs)
        self.grad_inputs = {p for i, p in enumerate(inputs) if not known or grads[i] is not None}
        self.mapped = known
        # Static inputs (parameters, buffers) are known only to the function that calls the
        # pack. Where it is not found, every input counts as one: casts of them stay exact.
        static = static_input_indices()
        self.static = set(inputs) if static is None else {inputs[i] for i in static if i < len(inputs)}
        # A value a gradient flows through is computed from an input that gets one (graph
        # order is topological). Rope tables built in the graph from a buffer and integer
        # positions are not: they are kept exact, as eagerly (requires_grad False).
        flows = set(self.grad_inputs)
        for node in fw.nodes:
            if node.op == "call_function" and any(a in flows for a in node.all_input_nodes):
                flows.add(node)
        self.flows = flows
        self.fw_outs = fw.output_node().args[0]

    def of(self, node) -> dict:
        """Policy facts of the saved value `node`."""
        if sum(o is node for o in self.fw_outs) > 1:
            return dict(_ALIVE)  # returned and saved
        if node.op == "placeholder":
            # A graph input that gets no gradient (the caller's data) outlives the graph.
            return dict(_ALIVE, alive_anyway=not self.mapped or node not in self.grad_inputs,
                        attention_input=_attention_input(node))
        # An op's auxiliary output that only its backward reads (attention's logsumexp; no
        # gradient flows through it) is a statistic.
        aux = node.target is operator.getitem and all(u.op == "output" for u in node.users)
        src, cast = node, False
        while src.op == "call_function" and (src.target in _VIEWS or src.target in _CASTS) and src.args:
            cast = cast or src.target in _CASTS
            src = src.args[0]
        weight = src in self.static
        # attention_output: the SDPA backward (and o_proj's weight gradient, where the
        # partitioner saves O's reshape for it) read O through views of the one saved value.
        return dict(alive_anyway=weight and not cast, grad_flows=node in self.flows and not aux,
                    weight_copy=weight and cast, attention_output=_attention_output(node),
                    attention_input=_attention_input(node))


_FACTS: "weakref.WeakKeyDictionary[torch.fx.Graph, _GraphFacts]" = weakref.WeakKeyDictionary()


def _saved_value_facts() -> dict:
    """Policy facts of the value being packed, from the graph context AOTAutograd hands the
    hook. Without it nothing tells a weight's copy from an activation: the value is kept."""
    ctx = saved_tensor_hook_context()
    if ctx is None:
        return dict(_ALIVE)
    node, fw, bw = ctx.get("_node"), ctx.get("_fw_graph"), ctx.get("_bw_graph")
    if node is None or fw is None or bw is None:
        return dict(_ALIVE)
    facts = _FACTS.get(fw)
    if facts is None:
        facts = _FACTS[fw] = _GraphFacts(fw, bw)
    return facts.of(node)


class TracedCodec:
    """pack/unpack bodies traced into compiled graphs (torch ops only, shapes static)."""

    def __init__(self, config: ActivationConfig, policy: Policy | None = None):
        self.fmt = get_format(config.other_format)
        self.group_size = config.group_size
        self.policy = policy if policy is not None else Policy(config)

    def pack(self, t: torch.Tensor):
        perm = memory_order(t)
        x = t.permute(perm) if perm else t
        kind = self.policy.decide(dtype=t.dtype, numel=t.numel(), row_len=x.shape[-1] if x.dim() else 1,
                                  dense_order=perm is not None, linear_input=False, **_saved_value_facts())
        if kind is SKIP or kind is KEEP or not x.is_contiguous():
            return t  # a view with gaps: the eager path copies it; a graph rarely saves one
        codes, exps = act_codec.quantize_groups(x, self.group_size, self.fmt)
        inverse = tuple(perm.index(d) for d in range(len(perm))) if perm else ()
        return TRACED_TAG, codes, exps, t.dtype, inverse

    def unpack(self, packed) -> torch.Tensor:
        _, codes, exps, dtype, inverse = packed
        x = act_codec.dequantize_groups(codes, exps, self.group_size, self.fmt, dtype)
        return x.permute(inverse) if inverse else x
