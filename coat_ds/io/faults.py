"""Fault injection for tests: `COAT_DS_CKPT_FAULT` kills, tears or fails a rank's write inside a
checkpoint save (`fault_point` marks where), so that tests can check what a crash or a full disk
leaves."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator

import torch.distributed as dist

from .atomic import atomic_write
from .checkpoint_folders import staging_path

__all__ = ["fault_point"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_FAULT_ENV = "COAT_DS_CKPT_FAULT"
_FAULT_KEYS = ("rank", "ckpt", "file", "action", "pidfile")
_ACTIONS = ("raise", "torn", "pause", "full")


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
    be killed from outside, before writing) or `full` (the file created as a link to /dev/full,
    whose writes the kernel fails with ENOSPC: the engine's own write meets a full disk)."""
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
    if fault["action"] == "full":
        os.symlink("/dev/full", path)
        yield
        return
    yield
    os.truncate(path, os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _fault_matches(fault: dict, path: str) -> bool:
    if int(fault["rank"]) != _rank():
        return False
    if "ckpt" in fault and os.path.basename(staging_path(fault["ckpt"])) not in path.split(os.sep):
        return False
    return fault.get("file", "") in os.path.basename(path)
