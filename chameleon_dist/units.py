"""Formatting of byte counts and durations for logs and reports."""

from __future__ import annotations

_BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(nbytes: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units, two decimals, plain bytes below 1 KiB."""
    for unit, size in _BINARY_UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"
