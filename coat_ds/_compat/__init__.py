"""Every access coat_ds makes to a dependency's private API, one module per dependency
(torch.py, triton.py, deepspeed.py). Each access is probed (at import or first use) and has a
documented fallback; a failed probe says so once, naming the feature, the installed version
and the fallback (docs/compat.md), never silently."""
from __future__ import annotations

import warnings

__all__ = ["warn_once"]

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """A RuntimeWarning with `message`, the first time `key` is seen in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
