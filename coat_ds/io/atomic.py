"""Files that appear whole or not at all.

Every file coat_ds writes for later reading (checkpoint records, `latest`, the FP32
converter's output, the profiler's JSON and PNG, a rewritten metrics file) goes through
`atomic_write`: the bytes go to a temporary file next to the target, are flushed to disk,
and only then renamed onto the target name. A crash at any moment leaves either the old file
or the new one, never a truncated mix, and a failed write leaves the old file untouched.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import IO, Iterator

__all__ = ["atomic_write", "fsync_dir", "remove_stale_temps"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename inside it) to disk; a no-op where directories
    cannot be opened (some network file systems)."""
    try:
        fd = os.open(os.fspath(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_TEMP_SUFFIX = ".tmp"


def _temp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}."


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open `path` for writing ("w" or "wb"); what is written replaces `path` only when the
    block ends without an exception. Parent folders are created."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=_TEMP_SUFFIX, dir=folder)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make results unreadable to co-workers
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def remove_stale_temps(path: str | os.PathLike, min_age_s: float = 60.0) -> list[str]:
    """Delete the temporary files of `atomic_write(path)` calls that were killed before their
    rename (a kill skips the clean-up), once untouched for `min_age_s` seconds: a live write
    renames a small file such as `latest` long before that, and a large one keeps its
    modification time fresh while it writes. Returns the paths removed."""
    path = os.fspath(path)
    folder, prefix = os.path.dirname(path) or ".", _temp_prefix(path)
    removed = []
    for name in os.listdir(folder):
        if not (name.startswith(prefix) and name.endswith(_TEMP_SUFFIX)):
            continue
        tmp = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):  # another process removed it first
            if time.time() - os.path.getmtime(tmp) >= min_age_s:
                os.unlink(tmp)
                removed.append(tmp)
    return removed
