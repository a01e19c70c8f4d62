"""Sizes in bytes as people write them: 4GiB, 512MB, 2e9, or a share of memory such as 25%."""
from __future__ import annotations

import math
import re

import psutil

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def memory_share(value: object) -> float | None:
    """'25%' -> 0.25; None if `value` is not a percentage; ValueError if it is one outside (0%, 100%]."""
    if not (isinstance(value, str) and value.strip().endswith("%")):
        return None
    try:
        pct = float(value.strip()[:-1])
    except ValueError:
        pct = -1.0
    if not 0 < pct <= 100:
        raise ValueError(f"a memory share must be in (0%, 100%], got {value!r}")
    return pct / 100


def parse_bytes(value: str | int | float, allow_zero: bool = False, of: int | None = None) -> int:
    """'4GiB', '512MiB', '2e9', 1073741824 -> bytes; '25%' -> that share of `of` bytes (default: the host
    memory available now)."""
    share = memory_share(value)
    if share is not None:
        return int((psutil.virtual_memory().available if of is None else of) * share)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size in bytes (examples: 4GiB, 512MiB, 2e9)")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(n):  # '1e400'
            raise ValueError(f"{value!r} is too large a size in bytes")
        n = int(n)
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"a memory size must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    return n
