"""The DeepSpeed JSONs shipped in `ds_configs/` and train.py's YAML presets in `configs/`,
found from any working directory.

They live at the top of the source tree (train.py, the docs and the tests name them as
`ds_configs/<name>.json` and `configs/<name>.yaml`); a wheel installs the JSONs under
`sys.prefix/share/coat_ds/ds_configs` (setup.cfg's data_files). The YAML presets are train.py's,
which runs from a source tree, so the source tree is where they are looked up.
"""
from __future__ import annotations

import os
import sys

__all__ = ["SHIPPED_PREFIX", "PRESETS_PREFIX", "shipped_dirs", "resolve_ds_config", "find_ds_config",
           "find_train_preset"]

SHIPPED_PREFIX = "ds_configs"
PRESETS_PREFIX = "configs"
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shipped_dirs() -> list[str]:
    """Where the shipped configs may be: the source checkout coat_ds is imported from, then the install."""
    return [os.path.join(_SOURCE_ROOT, SHIPPED_PREFIX), os.path.join(sys.prefix, "share", "coat_ds", SHIPPED_PREFIX)]


def _resolve(path: str, prefix: str, dirs: list[str]) -> str:
    """`path` itself when it names a file; else, for `<prefix>/<name>` named from outside the
    source tree, the first of `dirs` that holds `<name>`; else `path` unchanged."""
    if os.path.isfile(path):
        return path
    head, name = os.path.split(os.path.normpath(path))
    if head != prefix:
        return path
    for directory in dirs:
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return candidate
    return path


def _find(path: str, prefix: str, dirs: list[str], what: str) -> str:
    found = _resolve(path, prefix, dirs)
    if os.path.isfile(found):
        return found
    raise FileNotFoundError(f"{what} not found: {path} (relative paths start at {os.getcwd()}; "
                            f"{prefix}/<name> is also looked up in {', '.join(dirs)})")


def resolve_ds_config(path: str) -> str:
    """`path` itself when it names a file; else, for `ds_configs/<name>.json` (a shipped config
    named from outside the source tree), the shipped file; else `path` unchanged, for the caller
    to report as missing."""
    return _resolve(path, SHIPPED_PREFIX, shipped_dirs())


def find_ds_config(path: str | os.PathLike) -> str:
    """The DeepSpeed JSON `path` names: the file itself when it exists (relative to the working
    directory), else the shipped `ds_configs/<name>.json`. FileNotFoundError names `path` and
    every place looked in."""
    return _find(os.fspath(path), SHIPPED_PREFIX, shipped_dirs(), "DeepSpeed config file")


def find_train_preset(path: str) -> str:
    """train.py's `--config` YAML: the file itself, else `configs/<name>.yaml` of the source tree.
    FileNotFoundError names `path` and every place looked in."""
    return _find(path, PRESETS_PREFIX, [os.path.join(_SOURCE_ROOT, PRESETS_PREFIX)], "YAML settings file")
