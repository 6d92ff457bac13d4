"""Reading checkpoint files that may come from anywhere.

Checkpoint files are pickles, and unpickling runs whatever function the file names: one from a
shared folder or a model hub could run code on load. So every load reads them weights-only
(`weights_only_loads`, `load_file`, `load_dcp_metadata`): tensors, containers, numbers, strings
and the types torch allows, plus the exact types DeepSpeed and coat_ds write. Anything else is
refused with a `CheckpointError` naming it and the file, unless the caller passes
`trust_checkpoint=True`.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import re
from typing import Iterator, Sequence

import torch

__all__ = ["CheckpointError", "check_load_environment", "weights_only_loads", "listed_refusal", "reading_file",
           "load_file", "load_dcp_metadata"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked; the message names the path."""


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch reads it at every torch.load
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses every load while both are set
_TRUST_HINT = ("if you trust where this checkpoint comes from, load it with trust_checkpoint=True "
               "(train.py: --trust-checkpoint)")


def _global_name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def check_load_environment(trust_checkpoint: bool = False) -> None:
    """Refuse, naming the variable and the ways out, a weights-only load that torch would fail
    on: with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set (torch's own values: 1, y, yes, true), the
    switch `weights_only_loads` turns on makes torch refuse every load, sound files included."""
    value = os.environ.get(_FORCE_NO_WEIGHTS_ONLY, "0")
    if not trust_checkpoint and value.lower() in ("1", "y", "yes", "true"):
        raise CheckpointError(
            f"{_FORCE_NO_WEIGHTS_ONLY}={value} is set in the environment: it asks torch to unpickle whatever a "
            "checkpoint names, and coat_ds loads checkpoints weights-only unless told to trust them. Unset it "
            f"(`unset {_FORCE_NO_WEIGHTS_ONLY}`), or, if you trust where the checkpoint comes from, load it with "
            "trust_checkpoint=True (train.py: --trust-checkpoint)")


@contextlib.contextmanager
def weights_only_loads(trust_checkpoint: bool = False, allowed: Sequence = ()) -> Iterator[None]:
    """Every torch.load in the block, those inside DeepSpeed and DCP that ask for
    weights_only=False included, unpickles weights-only, with the classes and functions in
    `allowed` permitted besides torch's own; nothing changes with `trust_checkpoint`. The
    switch is process-wide while the block runs (torch takes it from the environment)."""
    if trust_checkpoint:
        yield
        return
    check_load_environment()
    before = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(list(allowed)):
            yield
    finally:
        if before is None:
            del os.environ[_FORCE_WEIGHTS_ONLY]
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = before


def _refusal(path, names: Sequence[str]) -> CheckpointError:
    return CheckpointError(f"refusing to load {path}: it holds {', '.join(names)}, which is none of the types torch, "
                           f"DeepSpeed and coat_ds write into checkpoints; unpickling it could run arbitrary code. "
                           f"{_TRUST_HINT}")


def _unsafe_globals(source) -> list[str]:
    """The globals the torch.save file `source` (path or stream) names that weights-only
    unpickling does not allow, read from its pickle alone ([] for a file that cannot be listed)."""
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # a legacy (non-zip) or damaged file cannot be listed
        return []


def listed_refusal(path) -> CheckpointError | None:
    """The refusal a weights-only load of the torch.save file `path` would raise for a global
    its pickle names, found without reading its tensors (call inside `weights_only_loads`, so
    that those it allows are not listed); None when none is found."""
    names = _unsafe_globals(path)
    return _refusal(path, names) if names else None


def _weights_only_refusal(path, source, error: Exception) -> CheckpointError:
    """The refusal of the torch.save file `source` (path or stream): the globals it holds that
    weights-only unpickling does not allow, else torch's own words for what it refused."""
    names = _unsafe_globals(source)
    if names:
        return _refusal(path, names)
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", str(error))
    why = found.group(1) if found else str(error).strip().splitlines()[0]
    return CheckpointError(f"refusing to load {path}: weights-only unpickling failed: {why}. {_TRUST_HINT}")


@contextlib.contextmanager
def reading_file(path, trust_checkpoint: bool = False, source=None) -> Iterator[None]:
    """Errors raised while reading checkpoint file `path` become a CheckpointError naming it;
    unless trusted, a weights-only refusal names the globals refused (listed from `source`,
    the stream read, default `path`; call inside `weights_only_loads` so that those it
    allows are not listed)."""
    try:
        yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        if trust_checkpoint:
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        raise _weights_only_refusal(path, path if source is None else source, e) from e
    except Exception as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e


def load_file(path: str | os.PathLike, trust_checkpoint: bool = False, allowed: Sequence = (),
              map_location="cpu"):
    """torch.load of one checkpoint file, weights-only with `allowed` permitted unless
    `trust_checkpoint`; fails with its path (and, when refused, what it holds)."""
    with weights_only_loads(trust_checkpoint, allowed), reading_file(path, trust_checkpoint):
        return torch.load(path, map_location=map_location, weights_only=not trust_checkpoint)


def _dcp_metadata_globals() -> dict:
    """What DCP's `.metadata` pickle names (found by unpickling real FSDP1/FSDP2 ones): its own
    dataclasses, torch.Size, dtypes, layouts, memory formats and the save's path."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    objs = [md.Metadata, md.MetadataIndex, md.StorageMeta, md.TensorStorageMetadata, md.BytesStorageMetadata,
            md.ChunkStorageMetadata, md.TensorProperties, md._MEM_FORMAT_ENCODING, filesystem._StorageInfo,
            torch.Size, torch.serialization._get_layout, pathlib.PosixPath, pathlib.WindowsPath]
    allowed = {_global_name(o): o for o in objs}
    allowed.update({f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Hands out only the allowed globals, without importing anything the file names."""

    def __init__(self, file, path):
        super().__init__(file)
        self._path, self._allowed = path, _dcp_metadata_globals()

    def find_class(self, module, name):
        obj = self._allowed.get(f"{module}.{name}")
        if obj is None:
            raise _refusal(self._path, [f"{module}.{name}"])
        return obj


def load_dcp_metadata(file, path, trust_checkpoint: bool = False):
    """The `torch.distributed.checkpoint` Metadata pickled in `file` (a binary stream of the
    `.metadata` file `path`), unpickled with only DCP's own types allowed unless trusted."""
    try:
        return pickle.load(file) if trust_checkpoint else _MetadataUnpickler(file, path).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e
