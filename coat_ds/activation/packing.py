"""One saved tensor stored in FP8, and how it is restored for backward.

Everything here runs once per saved tensor, on the host, while the GPU works ahead: the
format, group size and kernels arrive resolved (no string parsing or dispatch per call),
and a contiguous tensor, the common case, skips the permutations entirely."""
from __future__ import annotations

import weakref

import torch

from .policy import FLOATS, PER_TENSOR

__all__ = ["FLOATS", "FP8Saved", "FP8View", "Kept", "memory_order", "has_gaps", "as_is", "version_error"]


def version_error(now: int, saved: int, dtype: torch.dtype, shape) -> RuntimeError:
    """Autograd's own error for a tensor saved at version `saved` and now at `now`.

    Autograd checks the versions of the tensors it saves itself, but not of those handed to
    saved-tensor hooks: without a check at unpack, backward would silently use the FP8
    snapshot (or the modified values) where plain autograd refuses. Each restore compares
    the version inline (a call per unpack costs more than the compare) and raises this."""
    kind = torch.empty(0, dtype=dtype).type()
    return RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{kind} {list(shape)}], saved for backward (through coat_ds's saved-tensor "
        f"hooks), is at version {now}; expected version {saved} instead. Hint: the tensor was "
        "changed in place between forward and backward; clone it before modifying it.")


def as_is(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor handed back to autograd uncompressed.

    Not `t` itself: a node that saves its own output (rsqrt, exp) would then hold itself
    through t.grad_fn, a cycle inside autograd's C++ graph that only backward breaks. After
    an exception in forward (an out-of-memory error) it would keep the whole graph alive,
    and through ZeRO-3's backward hooks the model, its partitions and the optimizer."""
    return t.detach() if t.grad_fn is not None else t


class Kept:
    """A saved tensor stored as it is, with the version it was saved at."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        # as_is(t), inlined: this runs for every saved tensor not compressed.
        self.tensor = t.detach() if t.grad_fn is not None else t
        self.version = t._version

    @classmethod
    def weight_view(cls, t: torch.Tensor) -> "Kept":
        """`t`, a view of a parameter (weight.t()), kept without detaching: its grad_fn is the
        view op's node, never the node saving it, so it closes no cycle (see as_is), and a
        detach per linear layer's weight costs time for nothing."""
        kept = cls.__new__(cls)
        kept.tensor, kept.version = t, t._version
        return kept

    def restore(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise version_error(t._version, self.version, t.dtype, t.shape)
        return t


def memory_order(t: torch.Tensor) -> list[int] | None:
    """A permutation that orders `t`'s dims by stride, outermost first ([] when `t` is
    contiguous), or None if `t` overlaps itself (an expanded view: its logical elements
    could outnumber its storage's). Under the permutation `t` is contiguous, or a view with
    gaps (q, k or v sliced from a fused projection). Quantizing in memory order keeps a dense
    tensor's strides on restore (some backward kernels expect them) and puts groups along
    the stride-1 dim."""
    if t.is_contiguous():
        return []
    perm = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)
    span = 1  # elements covered by the dims inside this one
    for d in reversed(perm):
        if t.shape[d] == 1:
            continue
        if t.stride(d) < span:
            return None
        span = t.stride(d) * t.shape[d]
    return perm


def has_gaps(t: torch.Tensor, perm: list[int]) -> bool:
    """Whether `t`, non-overlapping with dims in memory order `perm`, skips elements of its
    storage (read from strides: a permute per saved tensor costs microseconds)."""
    if not perm:
        return False
    span = 1
    for d in reversed(perm):
        n = t.shape[d]
        if n != 1:
            if t.stride(d) != span:
                return True
            span *= n
    return False


class FP8Saved:
    """FP8 codes plus power-of-two scale exponents of one saved tensor (or, after
    keep_exact, the tensor itself)."""

    __slots__ = ("codes", "exps", "kind", "fmt", "group_size", "dtype", "inverse", "ops", "_restored",
                 "pending", "origin", "shape", "stride", "gapped", "counter", "version", "tensor", "__weakref__")

    def __init__(self, t: torch.Tensor, version: int, perm: list[int], gapped: bool, kind: str, fmt, group_size: int,
                 ops, origin: weakref.ref, empty: torch.Tensor):
        """`t`: a detached alias of the saved tensor, which this takes over (below), saved at
        `version`; `perm`: memory_order(t); `gapped`: has_gaps(t, perm); `fmt` an Fp8Format;
        `empty`: a zero-element tensor on t's device."""
        x = t.permute(perm) if perm else t
        # A view with gaps holds its whole storage alive (v holds all of a fused qkv output);
        # its own elements are copied dense and come back dense, in the same dim order:
        # autograd takes any strides, and the gapped layout would need that storage again.
        self.gapped = gapped
        if gapped:
            x = x.contiguous()
        if kind == PER_TENSOR:
            self.codes, self.exps = ops.quantize_tensor(x, fmt)
        else:
            self.codes, self.exps = ops.quantize_rows(x, group_size, fmt)
        self.kind, self.fmt, self.group_size, self.ops = kind, fmt, group_size, ops
        self.dtype = t.dtype
        self.shape, self.stride = t.shape, t.stride()
        if perm:
            inverse = [0] * len(perm)
            for i, d in enumerate(perm):
                inverse[d] = i
            self.inverse = inverse
        else:
            self.inverse = None
        self._restored = None
        # Saves this copy serves (the hooks count dedup hits) that backward has not yet
        # unpacked; while some remain, the restored tensor is held.
        self.pending = 1
        self.origin = origin  # weak reference to the tensor compressed
        # In-place changes after the save must fail backward as they do without hooks, also
        # when the original is gone by then (modified, then freed). `t` shares the original's
        # version counter; swapping its data for an empty tensor keeps the counter and lets
        # the storage go (`.data =` does not bump the version).
        self.version = version
        t.data = empty
        self.counter = t
        self.tensor = None  # set by keep_exact

    @property
    def nbytes(self) -> int:
        return 0 if self.codes is None else self.codes.nbytes + self.exps.nbytes

    def keep_exact(self, t: torch.Tensor) -> None:
        """Hold `t`, the tensor this copy was made from (still alive), and drop the codes:
        the hooks learn only after the save that a fused attention read it (hooks.py)."""
        self.tensor = as_is(t)
        self.codes = self.exps = self._restored = None

    def restore(self) -> torch.Tensor:
        """The dequantized tensor, with the original shape and strides.

        Every backward node that saved this tensor (q, k and v projections for one norm
        output) gets the one restored tensor: it is held until the last of them has
        unpacked, then only weakly. Without the hold it would die between those nodes and
        be dequantized again for each (a launch and a full write each time). Holding it
        costs no more than BF16 autograd, which keeps the original until the last of those
        nodes has run."""
        if self.counter._version != self.version:
            raise version_error(self.counter._version, self.version, self.dtype, self.shape)
        if self.tensor is not None:
            return self.tensor
        x = self._restored
        if isinstance(x, weakref.ref):
            x = x()
        if x is None:
            if self.kind == PER_TENSOR:
                x = self.ops.dequantize_tensor(self.codes, self.exps, self.fmt, self.dtype)
            else:
                x = self.ops.dequantize_rows(self.codes, self.exps, self.group_size, self.fmt, self.dtype)
            if self.inverse is not None:
                x = x.permute(self.inverse)
        self.pending -= 1
        self._restored = x if self.pending > 0 else weakref.ref(x)
        return x


class FP8View:
    """Another view of the memory an FP8Saved holds (same first element, same element count,
    both dense): an attention output saved as (B, H, S, D) and, reshaped, as o_proj's input."""

    __slots__ = ("saved", "shape", "stride")

    def __init__(self, saved: FP8Saved, t: torch.Tensor):
        self.saved, self.shape, self.stride = saved, t.shape, t.stride()

    def restore(self) -> torch.Tensor:
        x = self.saved.restore()
        return x.as_strided(self.shape, self.stride, x.storage_offset())
