"""The tensors this rank holds and the bytes behind them: a DTensor's local shard, and the
distinct storages under a set of tensors."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor", "unique_storage_bytes"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: a DTensor's local shard, else `t` itself. The shard itself,
    not `to_local()`'s autograd view: the optimizer's hot path calls this for every tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor counts its
    local shard): views of one flat buffer count once, with the buffer's padding, because
    that is what the allocator holds."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = local_tensor(t).untyped_storage()
        if s.data_ptr() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total
