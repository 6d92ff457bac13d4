"""The hooks' compiled half: FP8 quantization written into torch.compile's graphs.

Our hooks reach autograd as `torch.fx.GraphModule`s. Eagerly they are plain calls into
`SavedTensorCompressor.pack`/`unpack`; but AOTAutograd treats a GraphModule pair on top of
the saved-tensor hooks stack as traceable and inlines it (`maybe_inline_graph_saved_tensors_hooks`):
the pack is traced on each saved value of a compiled forward graph (a FakeTensor) and put
at the graph's end, the unpack at the start of the backward graph, and at run time the
compiled function runs with the hooks disabled. Inductor then fuses the quantization into
the kernels that produce the tensor and the dequantization into those that read it back,
and no Python runs per saved tensor: the host cost that dominates the eager path is gone.

Here the tensor is quantized per group (1 x group_size, the non-linear inputs' granularity)
whatever op saved it: a graph's saved value does not say which op it feeds. Tensors are
quantized in memory order and come back with their strides."""
from __future__ import annotations

import hashlib
import operator
from pathlib import Path

import torch
import torch._functorch.config as functorch_config
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import ActivationConfig
from ..kernels import fp8, reference
from ..kernels.fp8 import get_format
from .packing import FLOATS, memory_order

__all__ = ["graph_hook", "code_hash", "compile_settings", "TracedCodec", "TRACED_TAG"]

try:
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
except ImportError:  # older torch: no graph context for the pack
    _get_saved_tensor_hook_context = None

# Offer every saved value but parameters and other static inputs to the pack, which tells
# from the graphs which inputs are alive anyway. Without that context, only intermediates
# ("donated", torch's default): the residual stream entering each layer then stays BF16.
FILTERING_MODE = "no_static" if _get_saved_tensor_hook_context is not None else "donated"
TRACED_TAG = "coat_ds.fp8"


def compile_settings(config: ActivationConfig) -> dict:
    """AOTAutograd options a region sets while it runs: graphs compiled inside it read them."""
    settings = {}
    if hasattr(functorch_config, "saved_tensors_hooks_filtering_mode"):
        settings["saved_tensors_hooks_filtering_mode"] = FILTERING_MODE
    if config.compiled_recompute and hasattr(functorch_config, "ban_recompute_materialized_backward"):
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
    for path in (*sorted(Path(__file__).parent.glob("*.py")), Path(reference.__file__), Path(fp8.__file__)):
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


def _kept_as_is() -> bool:
    """Whether the graph says to store the saved value as it is:
    * it outlives the graph whatever we do: a graph input that gets no gradient (the
      caller's data, rope tables), or a value also returned to the caller;
    * it is an op's auxiliary output that only that op's backward reads (attention's
      logsumexp; no gradient flows through it): a statistic, see hooks.py.
    Without the graph context we are offered intermediates only (FILTERING_MODE)."""
    ctx = _get_saved_tensor_hook_context() if _get_saved_tensor_hook_context is not None else None
    if ctx is None:
        return _get_saved_tensor_hook_context is not None
    node, fw, bw = ctx.get("_node"), ctx.get("_fw_graph"), ctx.get("_bw_graph")
    if node is None or fw is None or bw is None:
        return True
    fw_outs = fw.output_node().args[0]
    if sum(o is node for o in fw_outs) > 1:
        return True  # returned and saved
    if node.op != "placeholder":
        return node.target is operator.getitem and all(u.op == "output" for u in node.users)
    inputs = list(fw.find_nodes(op="placeholder"))
    grads = bw.output_node().args[0]
    if len(grads) != len(inputs):
        return True
    # The backward graph returns one gradient per forward input, None where none flows.
    return grads[inputs.index(node)] is None


class TracedCodec:
    """pack/unpack bodies traced into compiled graphs (torch ops only, shapes static)."""

    def __init__(self, config: ActivationConfig):
        self.fmt = get_format(config.other_format)
        self.group_size = config.group_size
        self.min_numel = max(1, config.min_numel)

    def pack(self, t: torch.Tensor):
        # With dynamic shapes numel is symbolic: only a tensor known to be small is kept.
        if t.dtype not in FLOATS or statically_known_true(t.numel() < self.min_numel):
            return t
        perm = memory_order(t)
        if perm is None or _kept_as_is():
            return t
        x = t.permute(perm) if perm else t
        if not x.is_contiguous():
            return t  # a view with gaps: the eager path copies it; a graph rarely saves one
        if statically_known_true(x.shape[-1] == 1):
            return t  # one value per row: a statistic (see hooks.py)
        codes, exps = reference.act_quantize_rows(x, self.group_size, self.fmt)
        inverse = tuple(perm.index(d) for d in range(len(perm))) if perm else ()
        return TRACED_TAG, codes, exps, t.dtype, inverse

    def unpack(self, packed) -> torch.Tensor:
        _, codes, exps, dtype, inverse = packed
        x = reference.act_dequantize_rows(codes, exps, self.group_size, self.fmt, dtype)
        return x.permute(inverse) if inverse else x
