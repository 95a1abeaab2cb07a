"""Memory sizes as people write them (``141GB``, ``128GiB``, ``80 GB``, ``1.5TB``), parsed and printed."""

from __future__ import annotations

import re

UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class PlanError(ValueError):
    """A planner input it cannot use: the message names the option and the fix (the CLI prints it in one line)."""


def parse_size(text: str | int | float, option: str) -> int:
    """Bytes of a size: a number of bytes, or a number with a unit (kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB
    of 1024; a bare K/M/G/T is the decimal unit)."""
    if isinstance(text, bool):
        raise PlanError(f"{option} {text!r} is not a size; write it like 141GB or 128GiB.")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(text)
        if match is None:
            raise PlanError(f"{option} {text!r} is not a size; write it like 141GB or 128GiB.")
        value, unit = float(match.group(1)), match.group(2).lower()
    if unit not in UNITS:
        raise PlanError(
            f"{option} {text!r} has an unknown unit {unit!r}; use GB or TB (powers of 1000) or GiB or TiB (of 1024)."
        )
    size = int(value * UNITS[unit])
    if size <= 0:
        raise PlanError(f"{option} {text!r} must be larger than zero.")
    return size


def gb(size: float) -> str:
    """``size`` bytes in GB (10^9), one decimal."""
    return f"{size / 1e9:.1f} GB"
