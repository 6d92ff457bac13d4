"""train.py's metrics file: JSON lines, each step's records logged once across resumes."""
from __future__ import annotations

import json
import os

from ..io.atomic import atomic_write

__all__ = ["MetricsLog"]


class MetricsLog:
    """Appends one JSON object per line, every one with a "step" key.

    A run resumed from an earlier checkpoint replays steps the file already holds: records of
    any step up to the highest one already in the file are not written again, so each step
    appears once. A last line cut short by a crash is dropped when the file is opened (the
    step is logged again)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.last_step = self._existing_last_step()  # highest step already in the file (0: none)
        self._file = open(self.path, "a")

    def _existing_last_step(self) -> int:
        if not os.path.exists(self.path):
            return 0
        with open(self.path) as f:
            lines = f.read().split("\n")
        torn = lines.pop()  # after the final newline: "" unless the last write was cut short
        steps = []
        for number, line in enumerate(lines, 1):
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.path}, line {number}: not a metrics record ({e}): {line[:80]!r}") from e
        if torn:
            with atomic_write(self.path) as f:
                f.write("".join(line + "\n" for line in lines))
        return max(steps, default=0)

    def write(self, **record) -> bool:
        """Append `record` (it needs "step") unless the file already holds that step; True if written."""
        if int(record["step"]) <= self.last_step:
            return False
        self._file.write(json.dumps(record) + "\n")  # one write per line: a crash tears at most the last
        self._file.flush()
        return True

    def close(self) -> None:
        self._file.close()
