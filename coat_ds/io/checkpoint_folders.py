"""Checkpoint folders that become visible only once complete, for every engine.

Layout of a save folder (DeepSpeed and FSDP alike):

    save_dir/
      step10/                   a complete checkpoint: the engine's files + coat_ds_checkpoint.json
      step15/
      .step20.partial/          a save in progress, or one that died: never loaded
      latest                    the name of the newest complete checkpoint (DeepSpeed reads it too)

`staged_save(save_dir/stepN, step)` is the one way our code writes a checkpoint: every rank
writes into `.stepN.partial`; when all of them have finished (a collective), rank 0 writes the
completion record (`coat_ds_checkpoint.json`: step, world size, every file with its size, any
client state given) last, renames the folder to `stepN` and then points `latest` at it. A save never touches an existing
`stepN`: it fails before writing anything. A kill while `latest` is written leaves a
`.latest.*.tmp` file, which the next save removes. A write that fails on any rank (a full disk,
an unwritable folder) fails the save on every rank with a CheckpointError naming the folder and
the cause; the partial folder is removed (it only takes space) and earlier checkpoints stay as
they were.

`find_checkpoint(path)` is how resume chooses: `path` is either one checkpoint folder or a save
folder, in which case the complete checkpoint with the highest step is taken and every
incomplete candidate is reported by name (a `.stepN.partial` that holds every file and the
record, killed before its rename, as a complete save never published). A file missing from,
or shorter or longer than, the record fails with its path.

Files are read weights-only (io/safe_load.py); tests kill a rank inside a save through
`COAT_DS_CKPT_FAULT` (io/faults.py).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from .atomic import atomic_write, fsync_dir, remove_stale_temps
from .safe_load import CheckpointError, load_dcp_metadata

__all__ = ["RECORD", "LATEST", "FORMAT", "Found", "staged_save", "find_checkpoint", "staging_path", "read_record",
           "check_new_checkpoints", "check_files", "skipped_message", "report_skipped"]

RECORD = "coat_ds_checkpoint.json"  # completion record, written last inside each checkpoint folder
LATEST = "latest"  # save_dir/latest: the newest complete checkpoint's name (DeepSpeed's convention)
FORMAT = "coat_ds.checkpoint/1"  # the module's former name: records written since keep it
_PARTIAL = ".partial"
_STEP_NAME = re.compile(r"^step(\d+)$")


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
def staged_save(final: str | os.PathLike, step: int, engine: str = "",
                client_state: dict | None = None) -> Iterator[str]:
    """Call on every rank; yields the staging folder the engine writes into. On leaving the
    block without an exception on any rank, the checkpoint appears at `final` with its
    completion record (holding rank 0's `client_state`, JSON values, when given) and `latest`
    names it; otherwise `final` is not created and every rank raises. `final` must not exist
    yet."""
    final = os.path.abspath(os.fspath(final))
    if client_state is not None:
        json.dumps(client_state)  # not JSON: fails here on every rank, not on rank 0 after the writes
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
                problem = (CheckpointError, f"cannot save {final}: cannot create {staging}: {_write_error(e)}; the "
                                            "checkpoints saved before it are untouched")
    problem = _from_rank0(problem)
    if problem:
        raise problem[0](problem[1])
    error = None
    try:
        yield staging
    except BaseException as e:  # DCP's CheckpointException is one
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            _failed_ranks(False)  # the other ranks learn it, then this one stops
            raise
        error = e
    failed = _failed_ranks(error is None)  # also the barrier after the writes
    if failed:
        free = shutil.disk_usage(os.path.dirname(final)).free
        if rank == 0:  # every rank has stopped writing: the partial files only take space now
            shutil.rmtree(staging, ignore_errors=True)
        cause = f": {_write_error(error)}" if error is not None else f" (this is rank {rank}: it wrote its part)"
        raise CheckpointError(f"saving {final} failed on rank(s) {failed}{cause}; {final} was not created and the "
                              f"partial save {staging} was removed ({free:,} bytes were free there); the checkpoints "
                              "saved before it are untouched") from error
    if rank == 0:
        record = {"format": FORMAT, "name": os.path.basename(final), "step": int(step), "engine": engine,
                  "world_size": world, "saved_at": time.time(), "files": _synced_files(staging)}
        if client_state is not None:
            record["client_state"] = client_state
        with atomic_write(os.path.join(staging, RECORD)) as f:
            json.dump(record, f, indent=1)
        os.rename(staging, final)
        fsync_dir(os.path.dirname(final))
        _update_latest(os.path.dirname(final))
    _barrier()  # no rank goes on (or loads) before the checkpoint is visible


def _write_error(error: BaseException) -> str:
    """What went wrong in a failed write, for one line: the first OSError found in `error`, its
    cause or context, or (DCP's CheckpointException) the exceptions of its ranks, as its errno
    name, message and file; else the error's first line."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno:
            where = f" ({e.filename})" if e.filename else ""
            return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}{where}"
        todo += [e.__cause__, e.__context__] + [f[0] for f in getattr(e, "failures", {}).values()]
    for e in seen:
        if isinstance(e, OSError):
            return f"{type(e).__name__}: {e}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


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
    """Fail before training if `save_dir` cannot be written in, or, naming them, if checkpoints
    a run is about to write already exist there (a save never modifies an existing checkpoint)."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=save_dir):
            pass
    except OSError as e:
        raise CheckpointError(f"cannot save checkpoints in {os.fspath(save_dir)}: {_write_error(e)}") from e
    taken = [n for n in names if os.path.lexists(os.path.join(os.fspath(save_dir), n))]
    if taken:
        raise FileExistsError(f"{os.fspath(save_dir)} already holds {', '.join(taken)}, which this run would save "
                              "again: a save never modifies an existing checkpoint (use another save_dir, resume "
                              "from the newest one, or remove them)")
