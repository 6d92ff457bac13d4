"""Exact byte accounting of what autograd holds for backward, as seen by the hooks."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["ActivationStats", "Ledger"]

_PRUNE_AT = 4096


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


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Ledger:
    """Counters behind ActivationStats.

    A storage is counted once per step: storages are keyed by address, guarded by a weak
    reference to the tensor that owns them, because once the original of a compressed
    tensor dies its address can be reused by an unrelated tensor in the same step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._storages: dict[int, weakref.ref] = {}
        self._originals: list[tuple[weakref.ref, int]] = []
        self.uncompressed = self.compressed = self.n_compressed = 0
        self.n_kept = self.kept = self.dedup_hits = self.skipped = 0

    def _first_sight(self, t: torch.Tensor, root: torch.Tensor) -> bool:
        key = t.untyped_storage().data_ptr()
        ref = self._storages.get(key)
        if ref is not None and ref() is not None:
            return False
        self._storages[key] = weakref.ref(root)
        return True

    def add_compressed(self, t: torch.Tensor, root: torch.Tensor, packed_bytes: int) -> None:
        if self._first_sight(t, root):
            self.uncompressed += storage_bytes(t)
        self.compressed += packed_bytes
        self.n_compressed += 1
        self._originals.append((weakref.ref(root), t.numel() * t.element_size()))
        if len(self._originals) > _PRUNE_AT:
            self._prune()

    def _prune(self) -> None:
        # Only live entries matter for later lookups; without pruning a run that never
        # resets would grow these tables by a few entries per saved tensor forever.
        self._originals = [(ref, n) for ref, n in self._originals if ref() is not None]
        self._storages = {k: ref for k, ref in self._storages.items() if ref() is not None}

    def add_kept(self, t: torch.Tensor, root: torch.Tensor) -> None:
        if len(self._storages) > _PRUNE_AT:
            self._prune()
        if self._first_sight(t, root):
            self.uncompressed += storage_bytes(t)
            self.compressed += storage_bytes(t)
            self.kept += storage_bytes(t)
            self.n_kept += 1

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
