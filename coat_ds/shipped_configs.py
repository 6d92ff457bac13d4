"""The DeepSpeed JSONs shipped in `ds_configs/`, found from any working directory.

They live at the top of the source tree (train.py, the docs and the tests name them as
`ds_configs/<name>.json`); a wheel installs them under `sys.prefix/share/coat_ds/ds_configs`
(setup.cfg's data_files).
"""
from __future__ import annotations

import os
import sys

__all__ = ["SHIPPED_PREFIX", "shipped_dirs", "resolve_ds_config"]

SHIPPED_PREFIX = "ds_configs"


def shipped_dirs() -> list[str]:
    """Where the shipped configs may be: the source checkout coat_ds is imported from, then the install."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [os.path.join(package_root, SHIPPED_PREFIX), os.path.join(sys.prefix, "share", "coat_ds", SHIPPED_PREFIX)]


def resolve_ds_config(path: str) -> str:
    """`path` itself when it names a file; else, for `ds_configs/<name>.json` (a shipped config
    named from outside the source tree), the shipped file; else `path` unchanged, for the caller
    to report as missing."""
    if os.path.isfile(path):
        return path
    head, name = os.path.split(os.path.normpath(path))
    if head != SHIPPED_PREFIX:
        return path
    for directory in shipped_dirs():
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return candidate
    return path
