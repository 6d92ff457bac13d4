"""Checkpoint folders that become visible only once complete, for every engine.

Layout of a save folder (DeepSpeed and FSDP alike):

    save_dir/
      step10/                   a complete checkpoint: the engine's files + coat_ds_checkpoint.json
      step15/
      .step20.partial/          a save in progress, or one that died: never loaded
      latest                    the name of the newest complete checkpoint (DeepSpeed reads it too)

`staged_save(save_dir/stepN, step)` is the one way our code writes a checkpoint: every rank
writes into `.stepN.partial`; when all of them have finished (a collective), rank 0 writes the
completion record (`coat_ds_checkpoint.json`: step, world size, every file with its size) last,
renames the folder to `stepN` and then points `latest` at it. A save never touches an existing
`stepN`: it fails before writing anything. A kill while `latest` is written leaves a
`.latest.*.tmp` file, which the next save removes.

`find_checkpoint(path)` is how resume chooses: `path` is either one checkpoint folder or a save
folder, in which case the complete checkpoint with the highest step is taken and every
incomplete candidate is reported by name (a `.stepN.partial` that holds every file and the
record, killed before its rename, as a complete save never published). A file missing from,
or shorter or longer than, the record fails with its path.

Checkpoint files are pickles, and unpickling runs whatever function the file names: one from a
shared folder or a model hub could run code on load. So every load reads them weights-only
(`weights_only_loads`, `load_file`, `load_dcp_metadata`): tensors, containers, numbers, strings
and the types torch allows, plus the exact types DeepSpeed and coat_ds write. Anything else is
refused with a `CheckpointError` naming it and the file, unless the caller passes
`trust_checkpoint=True`.

Tests kill a rank inside a save through `COAT_DS_CKPT_FAULT` (see `fault_point`).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import pickle
import re
import shutil
import signal
import sys
import time
import zipfile
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .atomic import atomic_write, fsync_dir, remove_stale_temps

__all__ = ["RECORD", "LATEST", "FORMAT", "CheckpointError", "Found", "staged_save", "find_checkpoint",
           "staging_path", "read_record", "check_new_checkpoints", "check_files", "fault_point", "skipped_message",
           "report_skipped", "weights_only_loads", "reading_file", "load_file", "load_dcp_metadata"]

RECORD = "coat_ds_checkpoint.json"  # completion record, written last inside each checkpoint folder
LATEST = "latest"  # save_dir/latest: the newest complete checkpoint's name (DeepSpeed's convention)
FORMAT = "coat_ds.io.checkpoint_folders/1"
_PARTIAL = ".partial"
_STEP_NAME = re.compile(r"^step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked; the message names the path."""


def staging_path(final: str | os.PathLike) -> str:
    """Where the ranks write `final` before it is complete: a hidden sibling folder."""
    final = os.path.abspath(os.fspath(final))
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}{_PARTIAL}")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _from_rank0(value):
    """Rank 0's `value` on every rank."""
    if _rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=_collective_device())
    return box[0]


def _failed_ranks(ok: bool) -> list[int]:
    """Ranks whose `ok` is False; a collective, so it is also the barrier after the writes."""
    rank, world = _rank_world()
    if world == 1:
        return [] if ok else [0]
    flags = torch.zeros(world, dtype=torch.int32, device=_collective_device())
    flags[rank] = 0 if ok else 1
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _synced_files(folder: str) -> dict[str, int]:
    """Every file under `folder` (relative path -> bytes), the record excepted, each flushed
    to disk first: the record must not reach the disk before the data it vouches for."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder)
            if rel != RECORD:
                with open(full, "rb") as f:
                    os.fsync(f.fileno())
                out[rel] = os.path.getsize(full)
    return dict(sorted(out.items()))


@contextlib.contextmanager
def staged_save(final: str | os.PathLike, step: int, engine: str = "") -> Iterator[str]:
    """Call on every rank; yields the staging folder the engine writes into. On leaving the
    block without an exception on any rank, the checkpoint appears at `final` with its
    completion record and `latest` names it; otherwise `final` is not created and every rank
    raises. `final` must not exist yet."""
    final = os.path.abspath(os.fspath(final))
    staging = staging_path(final)
    rank, world = _rank_world()
    problem = None  # (exception class, message), decided by rank 0 for every rank
    if rank == 0:
        if os.path.lexists(final):
            problem = (FileExistsError, f"{final} already exists: a save never modifies an existing checkpoint "
                                        "(save to another folder, or remove it first)")
        else:
            try:
                shutil.rmtree(staging, ignore_errors=True)  # the leftover of a save that died
                os.makedirs(staging)
            except OSError as e:
                problem = (CheckpointError, f"cannot create {staging}: {e}")
    problem = _from_rank0(problem)
    if problem:
        raise problem[0](problem[1])
    ok = False
    try:
        yield staging
        ok = True
    finally:
        failed = _failed_ranks(ok)
    if failed:
        raise CheckpointError(f"rank(s) {failed} failed while writing {staging}; {final} was not created")
    if rank == 0:
        record = {"format": FORMAT, "name": os.path.basename(final), "step": int(step), "engine": engine,
                  "world_size": world, "saved_at": time.time(), "files": _synced_files(staging)}
        with atomic_write(os.path.join(staging, RECORD)) as f:
            json.dump(record, f, indent=1)
        os.rename(staging, final)
        fsync_dir(os.path.dirname(final))
        _update_latest(os.path.dirname(final))
    _barrier()  # no rank goes on (or loads) before the checkpoint is visible


def _update_latest(save_dir: str) -> None:
    newest = _scan(save_dir)[0]
    if newest is not None:
        with atomic_write(os.path.join(save_dir, LATEST)) as f:
            f.write(os.path.basename(newest[0]))
    remove_stale_temps(os.path.join(save_dir, LATEST))  # left by a save killed while writing `latest`


def read_record(folder: str | os.PathLike, verify: bool = True) -> dict | None:
    """The completion record of a checkpoint folder (None when it has none); with `verify`,
    its files are checked against it: a file missing, or of another size, fails naming it."""
    folder = os.fspath(folder)
    path = os.path.join(folder, RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        files, record["step"] = dict(record["files"]), int(record["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"unreadable completion record {path}: {e}") from e
    for rel, size in files.items() if verify else ():
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing (listed in {path})")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"{full} has {os.path.getsize(full)} bytes, {path} says {size}: "
                                  "the file was damaged after the save")
    return record


def check_files(folder: str | os.PathLike, trust_checkpoint: bool = False) -> None:
    """Cheap readability checks of a checkpoint folder without a completion record, failing
    with the path of the first bad file: every torch.save zip file must have its central
    directory (a cut-short file has none), every DCP data file must be long enough for what
    `.metadata` says it holds (read as `load_dcp_metadata` does)."""
    folder = os.fspath(folder)
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if name.endswith(".pt") and os.path.isfile(full):
            with open(full, "rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"  # else torch's legacy pickle format: not checkable
            if zipped and not zipfile.is_zipfile(full):
                raise CheckpointError(f"{full} is truncated or damaged (no zip central directory)")
    metadata = os.path.join(folder, ".metadata")
    if os.path.isfile(metadata):
        with open(metadata, "rb") as f:
            storage = load_dcp_metadata(f, metadata, trust_checkpoint).storage_data
        need: dict[str, int] = {}
        for info in storage.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for rel, size in sorted(need.items()):
            full = os.path.join(folder, rel)
            have = os.path.getsize(full) if os.path.isfile(full) else None
            if have is None or have < size:
                raise CheckpointError(f"{full} is {'missing' if have is None else f'{have} bytes'}; "
                                      f"{metadata} needs {size}")


def _looks_like_checkpoint(folder: str) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return RECORD in names or ".metadata" in names or any(n.endswith("model_states.pt") for n in names)


def _scan(save_dir: str) -> tuple[tuple[str, dict] | None, list[tuple[str, str]]]:
    """(newest complete checkpoint and its record, [(incomplete folder, why)]) in `save_dir`."""
    complete, skipped = [], []
    for name in sorted(os.listdir(save_dir)):
        folder = os.path.join(save_dir, name)
        if not os.path.isdir(folder):
            continue
        if name.startswith(".") and name.endswith(_PARTIAL):
            skipped.append((folder, _staging_state(folder)))
            continue
        if not os.path.isfile(os.path.join(folder, RECORD)):
            if _looks_like_checkpoint(folder) or _STEP_NAME.match(name):
                skipped.append((folder, f"incomplete checkpoint: no completion record {RECORD} (torn, or "
                                        "not saved through coat_ds; name the folder itself to load it unverified)"))
            continue
        complete.append((folder, read_record(folder, verify=False)))
    newest = max(complete, key=lambda c: (c[1]["step"], c[1].get("saved_at", 0))) if complete else None
    return newest, skipped


def _staging_state(staging: str) -> str:
    """What a staging folder left behind holds, from its contents: rank 0 writes the
    completion record only after every rank has written, and renames the folder after that."""
    final = os.path.basename(staging).removeprefix(".").removesuffix(_PARTIAL)
    try:
        record = read_record(staging)
    except CheckpointError as e:
        return f"incomplete checkpoint: an unfinished save whose files do not match its completion record ({e})"
    if record is None:
        return (f"incomplete checkpoint: an unfinished save, no completion record {RECORD} (stopped before every "
                "rank had written, or before rank 0 recorded it)")
    return (f"a complete save of step {record['step']} that was never published: every file and its completion "
            f"record are there, but the save stopped before renaming the folder to {final!r}; rename it to "
            f"{final!r} to resume from it")


@dataclass(frozen=True)
class Found:
    """The checkpoint a resume loads."""

    path: str  # the checkpoint folder
    step: int | None  # its step from the completion record (None: a folder without one)
    record: dict | None  # the completion record (None: a folder saved without coat_ds.io.checkpoint_folders)
    skipped: tuple[tuple[str, str], ...] = ()  # (folder, why) of each incomplete candidate passed over


def find_checkpoint(path: str | os.PathLike, trust_checkpoint: bool = False) -> Found:
    """The checkpoint to resume from `path`: the folder itself if it is one, else the newest
    complete checkpoint inside it (by recorded step), reporting the incomplete ones.
    `trust_checkpoint` as for `check_files`."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path not found: {path}")
    if os.path.basename(path).endswith(_PARTIAL):
        raise CheckpointError(f"{path} is a staging folder, not a checkpoint: {_staging_state(path)}")
    if _looks_like_checkpoint(path):
        record = read_record(path)
        if record is None:
            check_files(path, trust_checkpoint)
        return Found(path, None if record is None else record["step"], record)
    newest, skipped = _scan(path)
    if newest is None:
        why = "; ".join(f"{f}: {w}" for f, w in skipped) or "it holds no checkpoint folder"
        raise FileNotFoundError(f"no complete checkpoint in {path} ({why})")
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            named = f.read().strip()
        if named != os.path.basename(newest[0]):
            skipped.append((latest, f"it names {named!r}, not the newest complete checkpoint "
                                    f"{os.path.basename(newest[0])!r}"))
    return Found(newest[0], newest[1]["step"], read_record(newest[0]), tuple(skipped))


def skipped_message(found: Found) -> str:
    """One warning line per candidate `find_checkpoint` passed over ('' if none)."""
    return "\n".join(f"WARNING: skipping {f}: {why}" for f, why in found.skipped)


def report_skipped(found: Found) -> None:
    """Print `skipped_message`, and a warning for a folder without completion record, to
    stderr, once (rank 0)."""
    lines = [skipped_message(found)] if found.skipped else []
    if found.record is None:
        lines.append(f"WARNING: {found.path} has no completion record {RECORD}: loading it unverified")
    if lines and _rank_world()[0] == 0:
        print("\n".join(lines), file=sys.stderr, flush=True)


def check_new_checkpoints(save_dir: str | os.PathLike, names: list[str]) -> None:
    """Fail, naming them, if checkpoints a run is about to write already exist in `save_dir`
    (before training: a save never modifies an existing checkpoint)."""
    taken = [n for n in names if os.path.lexists(os.path.join(os.fspath(save_dir), n))]
    if taken:
        raise FileExistsError(f"{os.fspath(save_dir)} already holds {', '.join(taken)}, which this run would save "
                              "again: a save never modifies an existing checkpoint (use another save_dir, resume "
                              "from the newest one, or remove them)")


# -- reading pickled files that may come from anywhere ------------------------------------------

_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch reads it at every torch.load
_TRUST_HINT = ("if you trust where this checkpoint comes from, load it with trust_checkpoint=True "
               "(train.py: --trust-checkpoint)")


def _global_name(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@contextlib.contextmanager
def weights_only_loads(trust_checkpoint: bool = False, allowed: Sequence = ()) -> Iterator[None]:
    """Every torch.load in the block, those inside DeepSpeed and DCP that ask for
    weights_only=False included, unpickles weights-only, with the classes and functions in
    `allowed` permitted besides torch's own; nothing changes with `trust_checkpoint`. The
    switch is process-wide while the block runs (torch takes it from the environment)."""
    if trust_checkpoint:
        yield
        return
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


def _weights_only_refusal(path, source, error: Exception) -> CheckpointError:
    """The refusal of the torch.save file `source` (path or stream): the globals it holds that
    weights-only unpickling does not allow, else torch's own words for what it refused."""
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # a legacy (non-zip) file cannot be listed
        names = []
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


# -- fault injection for tests ----------------------------------------------------------------

_FAULT_ENV = "COAT_DS_CKPT_FAULT"
_FAULT_KEYS = ("rank", "ckpt", "file", "action", "pidfile")
_ACTIONS = ("raise", "torn", "pause")


def _fault() -> dict | None:
    spec = os.environ.get(_FAULT_ENV)
    if not spec:
        return None
    fault = dict(item.split("=", 1) for item in spec.split(","))
    bad = set(fault) - set(_FAULT_KEYS)
    if bad or fault.get("action") not in _ACTIONS or "rank" not in fault:
        raise ValueError(f"{_FAULT_ENV}={spec!r}: keys {_FAULT_KEYS} (rank and action required), "
                         f"action one of {_ACTIONS}")
    if fault["action"] == "pause" and "pidfile" not in fault:
        raise ValueError(f"{_FAULT_ENV}={spec!r}: action=pause needs pidfile=PATH")
    return fault


@contextlib.contextmanager
def fault_point(path: str | os.PathLike) -> Iterator[None]:
    """Wraps the writing of one checkpoint file `path`; does nothing unless
    `COAT_DS_CKPT_FAULT` picks this file.

    The variable holds `rank=R,action=A[,ckpt=stepN][,file=SUBSTRING][,pidfile=P]`: on rank R,
    when saving checkpoint stepN, at the files whose name contains SUBSTRING, A is `raise`
    (an exception instead of the write), `torn` (the file written, cut to half its size, then
    the process SIGKILLs itself) or `pause` (this process's id written to P, then it waits to
    be killed from outside, before writing)."""
    fault = _fault()
    path = os.fspath(path)
    if fault is None or not _fault_matches(fault, path):
        yield
        return
    if fault["action"] == "raise":
        raise OSError(f"{_FAULT_ENV}: injected failure writing {path}")
    if fault["action"] == "pause":
        with atomic_write(fault["pidfile"]) as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(1)
    yield
    os.truncate(path, os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _fault_matches(fault: dict, path: str) -> bool:
    if int(fault["rank"]) != _rank_world()[0]:
        return False
    if "ckpt" in fault and f".{fault['ckpt']}{_PARTIAL}" not in path.split(os.sep):
        return False
    return fault.get("file", "") in os.path.basename(path)
