"""Memory sizes as text: the sizes a user gives (``"2GiB"``) read as bytes, and bytes written for reports
(``"1.50 MiB"``)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string with a unit: ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise TypeError(f"a memory size is a number of bytes or a string such as '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size: give bytes, or a number with one of the units "
                             "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '2GiB')")
        number = float(match.group(1)) * _UNITS[unit]
    if number <= 0:
        raise ValueError(f"a memory limit must be positive, got {value!r}")
    return int(number)


def format_bytes(n: float) -> str:
    """Bytes as a short text in binary units (``"512 B"``, ``"1.50 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
