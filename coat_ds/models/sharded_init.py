"""Initial weights filled shard by shard: each rank draws only the elements it holds, with
the values the whole tensor has whatever the number of ranks.

A parameter's elements, in flat (row-major) order, are cut into blocks of `BLOCK_NUMEL`;
block b of parameter `name` is drawn from a generator of its own, seeded from (seed, name,
b), always whole and in FP32, then rounded to the parameter's dtype. A rank holding flat
elements [start, end) draws only the blocks that overlap them, so the work and the
temporary memory per rank are its shard plus at most two blocks. The values depend on the
seed, the names and shapes, and on the device type that draws them (CPU and CUDA generators
differ); not on the world size, nor on how the parameter is cut (FSDP2's rows, ZeRO-3's
flat partitions).
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._compat.deepspeed import zero3_local_range

__all__ = ["BLOCK_NUMEL", "LocalRange", "fill_normal", "local_range", "init_local_shards"]

BLOCK_NUMEL = 1 << 22


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@torch.no_grad()
def fill_normal(out: torch.Tensor, start: int, numel: int, std: float, seed: int, name: str) -> None:
    """Write elements [start, start + out.numel()) of parameter `name` (`numel` elements in
    all), drawn from N(0, std^2), into `out` (1-D, contiguous)."""
    end = start + out.numel()
    for block in range(start // BLOCK_NUMEL, (end - 1) // BLOCK_NUMEL + 1 if end > start else 0):
        lo = block * BLOCK_NUMEL
        hi = min(lo + BLOCK_NUMEL, numel)  # the block's length is the parameter's, never the shard's
        gen = torch.Generator(device=out.device).manual_seed(_block_seed(seed, name, block))
        a, b = max(lo, start), min(hi, end)
        if lo >= start and hi <= end and out.dtype == torch.float32:
            out[lo - start:hi - start].normal_(0.0, std, generator=gen)
            continue
        values = torch.empty(hi - lo, dtype=torch.float32, device=out.device).normal_(0.0, std, generator=gen)
        out[a - start:b - start].copy_(values[a - lo:b - lo])


def _dtensor_offset(p: DTensor) -> int:
    """First row of this rank's shard of a DTensor cut along dim 0 (FSDP2, HSDP), as
    torch.chunk cuts: ceil(rows / n) rows per rank."""
    rows, offset = p.shape[0], 0
    coordinate = p.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise ValueError(f"sharded init fills DTensors cut along dim 0 only, got placements {p.placements}")
        chunk = -(-rows // p.device_mesh.size(mesh_dim))
        offset += chunk * coordinate[mesh_dim]
        rows = max(0, min(chunk, rows - chunk * coordinate[mesh_dim]))
    return offset


class LocalRange(NamedTuple):
    """The elements of a parameter this rank holds."""

    flat: torch.Tensor  # 1-D view of them
    start: int  # flat index of the first, in the whole parameter
    numel: int  # elements of the whole parameter
    padding: torch.Tensor | None  # storage past the parameter's end in this rank's piece (ZeRO-3), or None


def local_range(p: torch.Tensor) -> LocalRange:
    """A DTensor's local shard, ZeRO-3's partition, or a whole plain tensor."""
    if isinstance(p, DTensor):
        local = p.to_local()
        return LocalRange(local.view(-1), _dtensor_offset(p) * math.prod(p.shape[1:]), p.numel(), None)
    partition = zero3_local_range(p)
    if partition is not None:
        return LocalRange(*partition)
    return LocalRange(p.data.view(-1), 0, p.numel(), None)


@torch.no_grad()
def init_local_shards(model: nn.Module, std_of: Callable[[str], float | None], seed: int) -> None:
    """Fill every parameter's local elements: N(0, std_of(name)^2), or ones where it gives
    None (norm weights). Padding past a ZeRO-3 partition's end is zeroed."""
    for name, p in model.named_parameters():
        r = local_range(p)
        std = std_of(name)
        if std is None:
            r.flat.fill_(1.0)
        else:
            fill_normal(r.flat, r.start, r.numel, std, seed, name)
        if r.padding is not None:
            r.padding.zero_()
