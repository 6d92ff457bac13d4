"""Bytes allocated during a region of code: the CUDA caching allocator's counters on a GPU,
and on a CPU (which keeps no such counters) a tracker of the storages that tensor ops create.

Both report relative to `start()`: `now` (still allocated) and `peak` (highest point);
`resident_bytes` is what they sit on."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..activation.packing import as_is
from .tensors import unique_storage_bytes

__all__ = ["Meter", "CudaMeter", "StorageMeter", "meter_for", "resident_bytes", "saved_tensor_bytes"]


class Meter:
    kind = ""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """End of the region (the CPU tracker stops watching new storages)."""

    @property
    def now(self) -> int:
        raise NotImplementedError

    @property
    def peak(self) -> int:
        raise NotImplementedError


class CudaMeter(Meter):
    kind = "cuda allocator (memory_allocated / max_memory_allocated)"

    def __init__(self, device: torch.device):
        self.device = device
        self._base = 0

    def start(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    @property
    def now(self):
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) - self._base

    @property
    def peak(self):
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._base


class _Track(TorchDispatchMode):
    def __init__(self, meter: "StorageMeter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Outputs that alias an input (views, in-place ops) allocate nothing new.
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.meter._note(t, inputs)
        return out


class StorageMeter(Meter):
    """CPU stand-in for the allocator: every storage a tensor op returns is counted from its
    creation until the last tensor using it dies (weak-reference finalizers). Tensors that
    autograd saves stay alive, so what remains after forward is what backward will read."""

    kind = "storage tracker (torch dispatch mode, CPU)"

    def __init__(self):
        self._live: dict[int, list[int]] = {}
        self._now = self._peak = 0
        self._mode: _Track | None = None

    def start(self):
        self._live.clear()
        self._now = self._peak = 0
        self._mode = _Track(self)
        self._mode.__enter__()

    def stop(self):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def _note(self, t: torch.Tensor, inputs: set[int]) -> None:
        key = t.untyped_storage().data_ptr()
        if key == 0 or (key in inputs and key not in self._live):
            return
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, t.untyped_storage().nbytes()]
            self._now += entry[1]
            self._peak = max(self._peak, self._now)
        entry[0] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self._now -= entry[1]

    @property
    def now(self):
        return self._now

    @property
    def peak(self):
        return self._peak


def meter_for(device: torch.device) -> Meter:
    return CudaMeter(device) if device.type == "cuda" else StorageMeter()


def resident_bytes(device: torch.device, tensors) -> int:
    """Bytes allocated when a measured step starts, under the meter's figures: the CUDA
    allocator's count on a GPU; on a CPU, which counts nothing, the distinct storages of
    `tensors`, those the caller knows to stay resident (weights, optimizer state)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return unique_storage_bytes(tensors)


class saved_tensor_bytes(torch.autograd.graph.saved_tensors_hooks):
    """Exact bytes autograd saves for backward in a forward without compression: distinct
    storages, leaving out parameters (and views of them) and the given inputs, which are
    alive anyway. The same rule as the compression hooks' ledger, so the two compare."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]):
        self.bytes = 0
        self._seen: set[int] = set()
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)):
            key = t.untyped_storage().data_ptr()
            if key not in self._seen and key not in self._inputs:
                self._seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return as_is(t)
