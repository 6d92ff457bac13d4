"""The saved-tensor hooks: the eager facts about each saved tensor, handed to the policy
(policy.py) that decides what to store in FP8, at which granularity, and what to leave alone.

`pack` runs for every tensor autograd saves, on the host, while the GPU runs ahead; any
microsecond here is paid per saved tensor and shows in step time once the host falls
behind. So it reads only cheap tensor attributes (no storage objects, no torch.device
objects in keys), keys tables by plain tuples in dicts of weak references (read inline, not
through _WeakTable.get), calls the policy's halves positionally (keyword arguments cost
more per call), resolves formats and kernels once, and never reads a device value: nothing
in pack or unpack synchronizes with the GPU."""
from __future__ import annotations

import weakref
from collections import deque

import torch
from torch import nn

from .._compat.torch import TRACED_TENSOR_TYPES, autograd_node_classes, detach_unseen, flex_attention_backward_node
from ..config import ActivationConfig
from ..kernels.registry import get
from ..kernels.fp8 import get_format
from .accounting import Ledger, storage_key
from .packing import FP8Saved, FP8View, Kept, has_gaps, memory_order
from .policy import KEEP, SKIP, Policy
from .traced import TRACED_TAG, TracedCodec, code_hash, graph_hook

__all__ = ["SavedTensorCompressor", "ATTENTION_NODES"]

_PLAIN = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_TRACED = TRACED_TENSOR_TYPES
_LOW = (torch.bfloat16, torch.float16)  # what autocast casts weights to


def _is_parameter(t: torch.Tensor) -> bool:
    # nn.Parameter's isinstance is a Python metaclass hook; a plain torch.Tensor is never a
    # Parameter (only subclass instances carry the `_is_param` mark it also accepts).
    return type(t) is not _PLAIN and isinstance(t, nn.Parameter)


# FP8 copies remembered for _keep_attention_inputs: q, k and v, each maybe a dedup hit, and
# what the op saves between them and its output.
_RECENT = 8

# The autograd node of a dtype conversion (ToCopyBackward0), compared by identity: reading
# its name per saved tensor costs more.
_TO_COPY_NODE = type(torch.empty(1, requires_grad=True).to(torch.float64).grad_fn)


def _casts_a_parameter(fn) -> bool:
    """`fn`, a ToCopyBackward0 node, casts straight from a parameter's AccumulateGrad: its
    output is a weight copy (autocast's BF16 copy of an FP32 weight), whose FP8 error would
    reach every gradient that weight touches, as a weight's would. Pack reads the node's
    type itself (type(root.grad_fn) is _TO_COPY_NODE) and calls this only on a match."""
    nxt = fn.next_functions
    acc = nxt[0][0] if nxt else None
    return acc is not None and _is_parameter(getattr(acc, "variable", None))


def _attention_nodes() -> frozenset:
    """The autograd nodes whose output is a fused attention's O (the policy's
    `attention_output`): SDPA's flash (CUDA and CPU), efficient, cuDNN and overrideable
    kernels, the flash, efficient and cuDNN ops behind them, and flex attention. Each
    backward reads O for rowsum(dO * O). SDPA's math backend has none: it is plain ops,
    and its softmax saves the probabilities instead (docs/activations.md). A node this
    torch version lacks is left out."""
    names = ("ScaledDotProductFlashAttentionBackward0", "ScaledDotProductFlashAttentionForCpuBackward0",
             "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0",
             "ScaledDotProductFusedAttentionOverrideableBackward0", "FlashAttentionBackward0",
             "EfficientAttentionBackward0", "CudnnAttentionBackward0")
    nodes = autograd_node_classes(names)
    flex = flex_attention_backward_node()
    if flex is not None:
        nodes.add(flex)
    return frozenset(nodes)


# Compared by the node's type, as _TO_COPY_NODE is: one set lookup per candidate tensor.
ATTENTION_NODES = _attention_nodes()

# `t.detach()`, made where no Python dispatch mode sees it. FP8Saved keeps it for its
# version counter and swaps its data for an empty tensor; a mode tracking storages by the
# tensors that use them (the profiler's CPU meter) would count t's storage as held by it.
_version_alias = detach_unseen


class _WeakTable:
    """key -> object, valid only while that object lives: keys hold addresses, which the
    allocator reuses once the object is gone. Dead entries are dropped when the table has
    doubled since the last sweep, so a sweep costs O(1) per insertion however many live."""

    __slots__ = ("refs", "_sweep_at")

    def __init__(self):
        self.refs: dict = {}
        self._sweep_at = 4096

    def add(self, key, obj) -> None:
        refs = self.refs
        if len(refs) >= self._sweep_at:
            self.refs = refs = {k: r for k, r in refs.items() if r() is not None}
            self._sweep_at = max(4096, 2 * len(refs))
        refs[key] = weakref.ref(obj)

    def get(self, key):
        ref = self.refs.get(key)
        return ref() if ref is not None else None


class SavedTensorCompressor:
    """pack/unpack functions for `torch.autograd.graph.saved_tensors_hooks`, with its ledger.

    `hooks` is the pair to install: GraphModules, so that torch.compile inlines them into
    its graphs (`traced.py`); called eagerly they are `pack` and `unpack`."""

    def __init__(self, config: ActivationConfig):
        self.config = config
        self.ledger = Ledger()
        # One FP8 copy per saved tensor: a norm output saved by the q, k and v projections
        # is stored once. Entries die with the autograd graph that holds them.
        self._fp8 = _WeakTable()
        self._linear_inputs = _WeakTable()
        self._keep = _WeakTable()
        # Device index -> kernels (benchmarks set entries to stub them), and -> (kernels,
        # zero-element tensor) as pack uses them.
        self._ops: dict[int, object] = {}
        self._per_device: dict[int, tuple] = {}
        self.policy = Policy(config)
        # The last FP8 copies made, (tensor, copy) weakly: a fused attention's q, k and v
        # are among them when its output is saved (_keep_attention_inputs). None: not kept.
        self._recent = deque(maxlen=_RECENT) if self.policy.exact_attention_inputs else None
        # Its two halves, bound once: pack calls them for every saved tensor.
        self._screen, self._candidate = self.policy.screen, self.policy.candidate
        self._formats = {False: get_format(config.other_format), True: get_format(config.linear_input_format)}
        self._group_size = config.group_size
        self._traced = TracedCodec(config, self.policy)
        cache_hash = code_hash(config)
        # pack/unpack looked up per call, so that a wrapper set on the instance (tests,
        # benchmarks) is used.
        self.hooks = (graph_hook(lambda t: self.pack(t), cache_hash),
                      graph_hook(lambda saved: self.unpack(saved), cache_hash))
        # For regions too small to compress eagerly (ActivationConfig.eager_min_region_numel):
        # the same compiled graphs, and eagerly each tensor kept at the least host cost.
        self.eager_exact_hooks = (graph_hook(lambda t: self.pack_eager_exact(t), cache_hash), self.hooks[1])

    def note_linear_input(self, x) -> None:
        if type(x) is _PLAIN:
            self._linear_inputs.add((x.get_device(), x.data_ptr(), x.numel(), x.dtype), x)

    def note_alive_anyway(self, t) -> None:
        """`t` outlives the region (a leaf input the caller holds, a buffer): never copy it."""
        # Only plain tensors: pack returns subclasses and their views untouched anyway.
        if type(t) is _PLAIN:
            self._keep.add(storage_key(t), t)

    def _ops_for(self, t: torch.Tensor):
        dev = t.get_device()
        ops = self._ops.get(dev)
        if ops is None:
            ops = self._ops[dev] = get("act_codec", t.device, self.config.backend)
        return ops

    def _device_state(self, dev: int, t: torch.Tensor):
        """(kernels, zero-element tensor) for t's device `dev` (t.get_device()), resolved at
        the first compressed tensor: the empty tensor is what FP8Saved swaps its version
        alias to."""
        state = self._per_device.get(dev)
        if state is None:
            state = self._per_device[dev] = (self._ops_for(t), torch.empty(0, device=t.device))
        return state

    def pack(self, t: torch.Tensor):
        ledger = self.ledger
        if type(t) is not _PLAIN:
            if isinstance(t, _TRACED) or _is_compiling():
                # AOTAutograd tracing the pack into a compiled graph (a fake tensor, then a
                # functional one; torch 2.11 is not "compiling" then). Not in the ledger:
                # the graph runs it on every call, without us.
                return self._traced.pack(t)
            if isinstance(t, nn.Parameter):
                # Weights (FSDP2/ZeRO-3 gathered ones included) are re-gathered for
                # backward; a copy would keep a second full weight alive.
                ledger.add_skipped(t)
            else:
                # Tensor subclasses (DTensor, FP8 wrappers) are not ours to copy.
                ledger.add_other(t)
            return Kept(t)
        if not (t.is_cuda or t.is_cpu):
            ledger.add_other(t)
            return Kept(t)
        base = t._base
        if base is not None and _is_parameter(base):
            # A view of a weight (weight.t() for every linear: a third of all saves) is alive
            # anyway, which the policy's first rule skips whatever else holds; reading the
            # other facts first would cost microseconds per save for nothing.
            ledger.add_skipped(t)
            return Kept.weight_view(t)
        root = t if base is None else base
        dtype = t.dtype
        dev, addr, numel = t.get_device(), t.data_ptr(), t.numel()
        skey = (dev, addr - t.storage_offset() * t.element_size())  # accounting.storage_key
        ref = self._keep.refs.get(skey)
        # The policy's first half on the facts at hand (integers, tiny tensors, statistics,
        # what the caller holds anyway), before the costlier ones only a candidate needs.
        # grad_flows is requires_grad: False for a statistic such as logsumexp, or a value
        # computed from inputs that need no gradient (see the docs' limits).
        kind = self._screen(dtype, numel, t.requires_grad, ref is not None and ref() is not None)
        if kind is not None:
            if kind is SKIP:
                ledger.add_skipped(t)
            else:
                ledger.add_kept(t, skey, weakref.ref(root))
            return Kept(t)
        perm = memory_order(t)
        if perm is None:
            gapped, row_len = False, 1
        else:
            gapped = bool(perm) and has_gaps(t, perm)  # [] (contiguous, the usual case): none
            row_len = t.shape[perm[-1] if perm else -1] if t.dim() else 1
        # A dense tensor is its first element's address plus its element count; views of the
        # same memory (any shape or strides) share one FP8 copy while its original lives. A
        # view with gaps is copied dense: only the same view of it can share that copy.
        ident = (dev, addr, numel, dtype)
        # A linear layer saves its input, or a 2-D view of it: same memory, same count.
        ref = self._linear_inputs.refs.get(ident)
        linear_input = ref is not None and ref() is not None
        # The node that made the memory: a view of an attention's output (o_proj's input,
        # where O's layout makes the reshape free) is that output.
        fn = root.grad_fn
        node = type(fn)
        weight_copy = node is _TO_COPY_NODE and dtype in _LOW and _casts_a_parameter(fn)
        attention_output = node in ATTENTION_NODES
        dense_order = perm is not None
        kind = self._candidate(row_len, dense_order, weight_copy, linear_input, attention_output)
        if attention_output and self._recent is not None:
            self._keep_attention_inputs(fn)
        root_ref = weakref.ref(root)
        if kind is KEEP:
            ledger.add_kept(t, skey, root_ref)
            return Kept(t)
        version = t._version
        key = (dev, addr, numel, dtype, version, t.shape, t.stride()) if gapped else (dev, addr, numel, dtype, version)
        ref = self._fp8.refs.get(key)
        hit = ref() if ref is not None else None
        if hit is not None and hit.origin() is not None:
            ledger.dedup_hits += 1
            hit.pending += 1
            if self._recent is not None:
                self._recent.append((weakref.ref(t), weakref.ref(hit)))
            return hit if hit.shape == t.shape and hit.stride == t.stride() else FP8View(hit, t)
        ops, empty = self._device_state(dev, t)
        saved = FP8Saved(_version_alias(t), version, perm, gapped, kind, self._formats[linear_input], self._group_size, ops,
                         root_ref, empty)
        self._fp8.add(key, saved)
        ledger.add_compressed(t, skey, root_ref, saved.nbytes)
        if self._recent is not None:
            self._recent.append((weakref.ref(t), weakref.ref(saved)))
        return saved

    def _keep_attention_inputs(self, fn) -> None:
        """`fn`, a fused attention's node, is saving its output O: switch the FP8 copies of
        its q, k and v back to the tensors themselves (the policy's `attention_input`). The
        op saved its inputs before it ran, when nothing told them from other tensors, so
        they were compressed; they are still alive as its arguments. They are found among
        the last copies made, as the tensors whose node (or, for a leaf, whose
        AccumulateGrad) is one of fn's inputs."""
        inputs = {node for node, _ in fn.next_functions if node is not None}
        recent = self._recent
        for t_ref, saved_ref in recent:
            t, saved = t_ref(), saved_ref()
            if t is None or saved is None or saved.tensor is not None:
                continue
            made_by = t.grad_fn
            if made_by in inputs if made_by is not None else any(getattr(n, "variable", None) is t for n in inputs):
                self.ledger.to_kept(t, saved.nbytes)
                saved.keep_exact(t)
        recent.clear()

    def pack_eager_exact(self, t: torch.Tensor):
        """`pack` for a region called on an input too small to compress eagerly: a traced
        tensor (a compiled graph) is packed as `pack` does; an eager one is kept as it is,
        with its version, and not counted in the ledger."""
        if type(t) is not _PLAIN and (isinstance(t, _TRACED) or _is_compiling()):
            return self._traced.pack(t)
        return Kept(t)

    def unpack(self, saved):
        kind = type(saved)
        if kind is FP8Saved or kind is FP8View or kind is Kept:
            return saved.restore()
        if kind is tuple and saved and saved[0] == TRACED_TAG:
            return self._traced.unpack(saved)
        return saved
