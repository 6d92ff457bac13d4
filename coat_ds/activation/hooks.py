"""The saved-tensor hooks: what to store in FP8, at which granularity, and what to leave alone.

`pack` runs for every tensor autograd saves, on the host, while the GPU runs ahead; any
microsecond here is paid per saved tensor and shows in step time once the host falls
behind. So it reads only cheap tensor attributes (no storage objects, no torch.device
objects in keys), keys tables by plain tuples in dicts of weak references, resolves
formats and kernels once, and never reads a device value: nothing in pack or unpack
synchronizes with the GPU."""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..config import ActivationConfig
from ..kernels.act_ops import get_act_ops
from ..kernels.fp8 import get_format
from .accounting import Ledger, storage_key
from .packing import FLOATS, PER_GROUP, PER_TENSOR, FP8Saved, FP8View, as_is, memory_order
from .traced import TRACED_TAG, TracedCodec, code_hash, graph_hook

__all__ = ["SavedTensorCompressor"]

_PLAIN = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_TRACED = (FakeTensor, FunctionalTensor)


def _is_parameter(t: torch.Tensor) -> bool:
    # nn.Parameter's isinstance is a Python metaclass hook; a plain torch.Tensor is never a
    # Parameter (only subclass instances carry the `_is_param` mark it also accepts).
    return type(t) is not _PLAIN and isinstance(t, nn.Parameter)


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
        self._ops: dict[tuple[str, int], object] = {}
        self._min_numel = max(1, config.min_numel)
        other = (PER_GROUP, get_format(config.other_format))
        linear = (PER_TENSOR if config.per_tensor_linear_inputs else PER_GROUP, get_format(config.linear_input_format))
        self._kinds = {False: other, True: linear}
        self._group_size = config.group_size
        self._traced = TracedCodec(config)
        cache_hash = code_hash(config)
        # pack/unpack looked up per call, so that a wrapper set on the instance (tests,
        # benchmarks) is used.
        self.hooks = (graph_hook(lambda t: self.pack(t), cache_hash),
                      graph_hook(lambda saved: self.unpack(saved), cache_hash))

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
            ops = self._ops[dev] = get_act_ops(t.device, self.config.backend)
        return ops

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
            return as_is(t)
        base = t._base
        root = t if base is None else base
        if base is not None and _is_parameter(base):
            ledger.add_skipped(t)
            return as_is(t)
        if not (t.is_cuda or t.is_cpu):
            ledger.add_other(t)
            return as_is(t)
        if t.dtype not in FLOATS or t.numel() < self._min_numel:
            ledger.add_kept(t, root)
            return as_is(t)
        if self._keep.refs and self._keep.get(storage_key(t)) is not None:
            ledger.add_skipped(t)
            return as_is(t)
        perm = memory_order(t)
        # A statistic stays as it is: an op's output that no gradient flows through (the
        # logsumexp attention's backward rebuilds its probabilities from), or one value per
        # row (a norm's rsqrt). One FP8 error there scales a whole row of gradients; the
        # bytes are a sliver of the activations'.
        if perm is None or not t.requires_grad or t.shape[perm[-1] if perm else -1] == 1:
            ledger.add_kept(t, root)
            return as_is(t)
        # A dense tensor is its first element's address plus its element count; views of the
        # same memory (any shape or strides) share one FP8 copy while its original lives.
        ident = (t.get_device(), t.data_ptr(), t.numel(), t.dtype)
        key = (*ident, t._version)
        hit = self._fp8.get(key)
        if hit is not None and hit.origin() is not None:
            same = hit.shape == t.shape and hit.stride == t.stride()
            # A gapped tensor's copy comes back dense: another view of its memory is not a view of that.
            if same or not hit.gapped:
                ledger.dedup_hits += 1
                hit.pending += 1
                return hit if same else FP8View(hit, t)
        # A linear layer saves its input, or a 2-D view of it: same memory, same count.
        kind, fmt = self._kinds[self._linear_inputs.get(ident) is not None]
        saved = FP8Saved(t.detach(), perm, kind, fmt, self._group_size, self._ops_for(t), weakref.ref(root))
        self._fp8.add(key, saved)
        ledger.add_compressed(t, root, saved.nbytes)
        return saved

    def unpack(self, saved):
        kind = type(saved)
        if kind is FP8Saved or kind is FP8View:
            return saved.restore()
        if kind is tuple and saved and saved[0] == TRACED_TAG:
            return self._traced.unpack(saved)
        return saved
