"""The saved-tensor hooks: what to store in FP8, at which granularity, and what to leave alone."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ..config import ActivationConfig
from ..kernels.act_ops import get_act_ops
from .accounting import Ledger
from .packing import PER_GROUP, PER_TENSOR, FP8Saved, FP8View, memory_order

__all__ = ["SavedTensorCompressor", "COMPILE_MESSAGE"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DEVICES = ("cuda", "cpu")

COMPILE_MESSAGE = (
    "coat_ds.compress_activations: the saved-tensor pack hook is being traced by torch.compile "
    "(it must run eagerly, on real tensors, from AOTAutograd's save_for_backward). Compile with "
    "graph breaks allowed at the compressed regions (no fullgraph=True over them), or call "
    "handle.remove() before compiling.")


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning `t`'s storage in autograd's view tracking (`_base` is never itself a view)."""
    return t._base if t._base is not None else t


class _WeakTable:
    """key -> tensor, valid only while that tensor lives: keys are storage addresses, which
    the allocator reuses once the tensor is gone."""

    def __init__(self):
        self._refs: dict = {}

    def add(self, key, t: torch.Tensor) -> None:
        if len(self._refs) > 4096:
            self._refs = {k: r for k, r in self._refs.items() if r() is not None}
        self._refs[key] = weakref.ref(t)

    def __contains__(self, key) -> bool:
        ref = self._refs.get(key)
        return ref is not None and ref() is not None

    def clear(self) -> None:
        self._refs.clear()


class SavedTensorCompressor:
    """pack/unpack functions for `torch.autograd.graph.saved_tensors_hooks`, with its ledger."""

    def __init__(self, config: ActivationConfig):
        self.config = config
        self.ledger = Ledger()
        # One FP8 copy per saved tensor: a norm output saved by the q, k and v projections
        # is stored once. Entries die with the autograd graph that holds them.
        self._fp8: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._linear_inputs = _WeakTable()
        self._keep = _WeakTable()
        self._ops: dict[torch.device, object] = {}

    def note_linear_input(self, x) -> None:
        if isinstance(x, torch.Tensor):
            self._linear_inputs.add((x.device, x.data_ptr(), x.dtype, x.numel()), x)

    def note_alive_anyway(self, t) -> None:
        """`t` outlives the region (a leaf input the caller holds, a buffer): never copy it."""
        if isinstance(t, torch.Tensor):
            self._keep.add((t.device, t.untyped_storage().data_ptr()), t)

    def _ops_for(self, device: torch.device):
        ops = self._ops.get(device)
        if ops is None:
            ops = self._ops[device] = get_act_ops(device, self.config.backend)
        return ops

    def pack(self, t: torch.Tensor):
        if torch.compiler.is_compiling():
            raise RuntimeError(COMPILE_MESSAGE)
        root = _root(t)
        if isinstance(t, nn.Parameter) or isinstance(root, nn.Parameter):
            # Weights (FSDP2/ZeRO-3 gathered ones included) are re-gathered for backward;
            # a copy would keep a second full weight alive.
            self.ledger.add_skipped(t)
            return t
        if type(t) is not torch.Tensor or t.device.type not in _DEVICES:
            # Tensor subclasses (DTensor, FP8 wrappers) and other devices are not ours to copy.
            self.ledger.add_other(t)
            return t
        if t.dtype not in _FLOATS or t.numel() < max(1, self.config.min_numel):
            self.ledger.add_kept(t, root)
            return t
        if (t.device, t.untyped_storage().data_ptr()) in self._keep:
            self.ledger.add_skipped(t)
            return t
        perm = memory_order(t)
        if perm is None:
            self.ledger.add_kept(t, root)
            return t
        # A dense tensor is its first element's address plus its element count; views of the
        # same memory (any shape or strides) share one FP8 copy while its original lives.
        key = (t.device, t.data_ptr(), t.numel(), t.dtype, t._version)
        hit = self._fp8.get(key)
        if hit is not None and hit.origin() is not None:
            self.ledger.dedup_hits += 1
            same = hit.shape == tuple(t.shape) and hit.stride == t.stride()
            return hit if same else FP8View(hit, t)
        cfg = self.config
        # A linear layer saves its input, or a 2-D view of it: same memory, same count.
        if (t.device, t.data_ptr(), t.dtype, t.numel()) in self._linear_inputs:
            kind = PER_TENSOR if cfg.per_tensor_linear_inputs else PER_GROUP
            fmt = cfg.linear_input_format
        else:
            kind, fmt = PER_GROUP, cfg.other_format
        with torch.no_grad():
            saved = FP8Saved(t, perm, kind, fmt, cfg.group_size, self._ops_for(t.device))
        saved.origin = weakref.ref(root)
        self._fp8[key] = saved
        self.ledger.add_compressed(t, root, saved.nbytes)
        return saved

    @staticmethod
    def unpack(saved):
        return saved.restore() if isinstance(saved, (FP8Saved, FP8View)) else saved
