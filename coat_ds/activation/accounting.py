"""Exact byte accounting of what autograd holds for backward, as seen by the hooks."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["ActivationStats", "Ledger", "storage_key"]

_SWEEP_AT = 4096


@dataclass(frozen=True)
class ActivationStats:
    """Saved-for-backward bytes since the last reset (one step, if reset once per step)."""

    uncompressed_bytes: int  # held without compression: unique storages of the non-skipped saved tensors
    compressed_bytes: int  # held with compression: FP8 codes and scales plus the tensors kept as they are
    compressed_tensors: int  # distinct tensors stored in FP8
    kept_tensors: int  # saved tensors kept uncompressed (tiny, non-float, not dense)
    kept_bytes: int  # their storage bytes, counted in both totals above
    dedup_hits: int  # saves served by an FP8 copy made for an earlier save of the same tensor
    skipped_bytes: int  # parameters, buffers and region leaf inputs: alive anyway, in neither total
    alive_anyway_bytes: int  # compressed tensors whose original was still alive when read (wasted)

    @property
    def ratio(self) -> float:
        """compressed_bytes / uncompressed_bytes (1.0 when nothing was saved)."""
        return self.compressed_bytes / self.uncompressed_bytes if self.uncompressed_bytes else 1.0


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(device index, address of t's storage) of a plain tensor, computed from the tensor:
    `untyped_storage()` would build a Python storage object on every saved tensor."""
    return t.get_device(), t.data_ptr() - t.storage_offset() * t.element_size()


class Ledger:
    """Counters behind ActivationStats.

    A storage is counted once per step: storages are keyed by address, guarded by a weak
    reference to the tensor that owns them, because once the original of a compressed
    tensor dies its address can be reused by an unrelated tensor in the same step. Only
    counters and weak references are touched per saved tensor; stats() does the sums."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._storages: dict[tuple[int, int], weakref.ref] = {}
        self._originals: list[tuple[weakref.ref, int]] = []
        self._sweep_at = _SWEEP_AT
        self.uncompressed = self.compressed = self.n_compressed = 0
        self.n_kept = self.kept = self.dedup_hits = self.skipped = 0
        # Storages of compressed tensors kept as they are after all (to_kept), as _storages.
        self._kept_again: dict[tuple[int, int], weakref.ref] = {}

    def _first_sight(self, key: tuple[int, int], root_ref: weakref.ref, table: dict | None = None) -> bool:
        table = self._storages if table is None else table
        ref = table.get(key)
        if ref is not None and ref() is not None:
            return False
        if len(table) >= self._sweep_at:
            self._sweep()
        table[key] = root_ref
        return True

    def _sweep(self) -> None:
        # Only live entries matter for later lookups; without sweeping, a run that never
        # resets would grow these tables by a few entries per saved tensor forever. The
        # threshold doubles with what is live, so sweeping stays O(1) per saved tensor.
        self._originals = [(ref, n) for ref, n in self._originals if ref() is not None]
        self._storages = {k: ref for k, ref in self._storages.items() if ref() is not None}
        self._kept_again = {k: ref for k, ref in self._kept_again.items() if ref() is not None}
        self._sweep_at = max(_SWEEP_AT, 2 * max(len(self._originals), len(self._storages), len(self._kept_again)))

    # The callers pass what they have already read: `key` is storage_key(t), `root_ref` a
    # weak reference to the tensor owning t's storage (t itself, or its base).
    def add_compressed(self, t: torch.Tensor, key: tuple[int, int], root_ref: weakref.ref, packed_bytes: int) -> None:
        if self._first_sight(key, root_ref):
            self.uncompressed += t.untyped_storage().nbytes()
        self.compressed += packed_bytes
        self.n_compressed += 1
        self._originals.append((root_ref, t.nbytes))
        if len(self._originals) >= self._sweep_at:
            self._sweep()

    def add_kept(self, t: torch.Tensor, key: tuple[int, int], root_ref: weakref.ref) -> None:
        if self._first_sight(key, root_ref):
            n = t.untyped_storage().nbytes()
            self.uncompressed += n
            self.compressed += n
            self.kept += n
            self.n_kept += 1

    def to_kept(self, t: torch.Tensor, packed_bytes: int) -> None:
        """A tensor counted by add_compressed is kept as it is after all (eager attention
        inputs, hooks.py): its codes no longer count, its storage does (once per storage)."""
        self.compressed -= packed_bytes
        self.n_compressed -= 1
        self.n_kept += 1
        root = t if t._base is None else t._base
        originals = self._originals
        for i in range(len(originals) - 1, -1, -1):  # it was compressed a few saves ago
            if originals[i][0]() is root:
                del originals[i]
                break
        if self._first_sight(storage_key(t), weakref.ref(root), self._kept_again):
            n = t.untyped_storage().nbytes()
            self.compressed += n
            self.kept += n

    def add_other(self, t: torch.Tensor) -> None:
        """A tensor subclass kept as is: counted by its logical size (its storage may not
        be addressable, as for DTensor)."""
        n = t.numel() * t.element_size()
        self.uncompressed += n
        self.compressed += n
        self.kept += n
        self.n_kept += 1

    def add_skipped(self, t: torch.Tensor) -> None:
        self.skipped += t.numel() * t.element_size()

    def stats(self) -> ActivationStats:
        alive = sum(n for ref, n in self._originals if ref() is not None)
        return ActivationStats(self.uncompressed, self.compressed, self.n_compressed, self.n_kept, self.kept,
                               self.dedup_hits, self.skipped, alive)
