"""Typed checks of user settings (YAML, flags, DeepSpeed JSON): each returns the value or
raises a `ConfigError` naming the key, the value given and what is allowed.

Strict on purpose: a string is never read as a number or a boolean (`"no"` is not False,
`"8"` is not 8), a boolean is never read as a number, and non-finite numbers are refused.
"""
from __future__ import annotations

import math

__all__ = ["ConfigError", "integer", "number", "boolean", "choice", "text"]


class ConfigError(ValueError):
    """A setting outside what is allowed."""

    def __init__(self, key: str, value, allowed: str, where: str = ""):
        self.key, self.value, self.allowed = key, value, allowed
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{key}: got {value!r} ({type(value).__name__}); allowed: {allowed}{_hint(value)}")


def _hint(value) -> str:
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    if "e" in value.lower() and "." not in value:
        # PyYAML follows YAML 1.1: 1e-3 (no dot) is a string there, 1.0e-3 a float.
        return " (YAML reads an exponent without a dot as text: write 1.0e-3, not 1e-3)"
    return " (text that looks like a number: write it without quotes)"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounds(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    return " and ".join(parts)


def integer(key: str, value, lo: int | None = None, hi: int | None = None, where: str = "") -> int:
    allowed = " ".join(["an integer", _bounds(lo, hi)]).strip()
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(key, value, allowed, where)
    return value


def number(key: str, value, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, where: str = "") -> float:
    allowed = " ".join(["a finite number", _bounds(lo, hi, lo_open, hi_open)]).strip()
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        raise ConfigError(key, value, allowed, where)
    return float(value)


def boolean(key: str, value, where: str = "") -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false (a boolean, not a string or number)", where)
    return value


def choice(key: str, value, options, where: str = ""):
    if not isinstance(value, str) or value not in options:
        raise ConfigError(key, value, "one of " + ", ".join(repr(o) for o in options), where)
    return value


def text(key: str, value, *, nonempty: bool = False, where: str = "") -> str:
    if not isinstance(value, str) or (nonempty and not value):
        raise ConfigError(key, value, "a non-empty string" if nonempty else "a string", where)
    return value
