"""Every private access coat_ds makes to its dependencies, one module per dependency
(`torch.py`, `triton.py`, `deepspeed.py`). Each names the versions it was checked on and
probes its feature; where a probe fails the library takes the documented fallback and says
so once, through `warn_once`."""
from __future__ import annotations

import warnings

__all__ = ["warn_once"]

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """`warnings.warn(message, RuntimeWarning)` the first time `key` is seen in this process.
    The message names the feature, the installed version and the fallback taken."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
