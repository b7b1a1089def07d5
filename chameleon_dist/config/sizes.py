"""Parsing of byte sizes ("6GB", "512MiB", 123), bandwidths ("25GB/s") and memory budgets.

Decimal SI units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of 1024;
units are case-insensitive, "B" alone (or no unit) means bytes, and a space before the unit is allowed.

A *budget* is a size, a fraction of a total in (0, 1], or ``"auto"``: a Python ``float`` (or a unitless
string with a decimal point or exponent, as ``--chameleon-memory-budget 0.8`` gives) is a fraction, an
``int`` (or ``"123"``, ``"6GB"``) is bytes.

Functions here raise :class:`SizeError` whose message says what is wrong with the value (not what to use
instead: the schema adds that, since it knows the setting).
"""

from __future__ import annotations

import decimal
import math
import re
from fractions import Fraction
from typing import Literal

AUTO = "auto"

# Lower-cased unit -> bytes. A tuple of pairs, not a dict, so that nothing module-level is mutable.
_UNITS: tuple[tuple[str, int], ...] = (
    ("", 1),
    ("b", 1),
    ("kb", 10**3),
    ("mb", 10**6),
    ("gb", 10**9),
    ("tb", 10**12),
    ("kib", 2**10),
    ("mib", 2**20),
    ("gib", 2**30),
    ("tib", 2**40),
)
UNIT_NAMES = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_SIZE_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<unit>[A-Za-z]*)\s*(?P<rate>/\s*s(?:ec)?)?\s*$")

Budget = int | float | Literal["auto"]


class SizeError(ValueError):
    """A value that is not a valid size, rate or budget; the message describes the value's problem."""


def _unit_bytes(unit: str) -> int | None:
    lowered = unit.lower()
    for name, factor in _UNITS:
        if name == lowered:
            return factor
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _from_number(number: decimal.Decimal, factor: int, original: object) -> int:
    if number < 0:
        raise SizeError(f"{_short(original)} is negative; a size is 0 bytes or more")
    scaled = number * factor
    if factor == 1 and scaled != scaled.to_integral_value():
        raise SizeError(f"{_short(original)} is not a whole number of bytes")
    return int(scaled.to_integral_value(rounding=decimal.ROUND_HALF_EVEN))


def parse_size_bytes(value: object, *, per_second: bool = False) -> int:
    """Bytes (an int) from an int, an integral float, or a size string such as ``"1.5 GiB"``.

    With ``per_second`` the string may end in ``/s`` (``"25GB/s"``). Fractional bytes round to the
    nearest byte. Raises :class:`SizeError` for booleans, negative sizes and anything unparseable.
    """
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is a boolean, not a size")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{value} is negative; a size is 0 bytes or more")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise SizeError(f"{value!r} is not a whole number of bytes")
        return _from_number(decimal.Decimal(value), 1, value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None or (match.group("rate") and not per_second):
            raise SizeError(f"{_short(value)} is not a size")
        factor = _unit_bytes(match.group("unit"))
        if factor is None:
            raise SizeError(f"{_short(value)} is not a size (unknown unit {match.group('unit')!r}; units: {UNIT_NAMES})")
        return _from_number(decimal.Decimal(match.group("number")), factor, value)
    raise SizeError(f"{_short(value)} ({type(value).__name__}) is not a size")


def _fraction(value: float, original: object) -> float:
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise SizeError(f"{_short(original)} is not a fraction in (0, 1] (a float is read as a fraction)")
    return float(value)


def parse_budget(value: object) -> Budget:
    """Normalise a budget: ``"auto"``, a float fraction in (0, 1], or int bytes."""
    if isinstance(value, bool):
        raise SizeError(f"{value!r} is a boolean, not a size")
    if isinstance(value, float):
        return _fraction(value, value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        match = _SIZE_RE.match(text)
        if match is not None and not match.group("unit") and not match.group("rate"):
            number = match.group("number")
            if any(c in number for c in ".eE"):
                return _fraction(float(number), value)
    return parse_size_bytes(value)


def is_bare_integer(value: object) -> bool:
    """True for an int (not a bool) or a string holding only a whole number: bytes without a unit."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, str) and value.strip().lstrip("+").isdigit()


def resolve_budget_bytes(budget: Budget, total_bytes: int, auto_fraction: float, shares: int = 1) -> int:
    """Bytes for ``budget`` against ``total_bytes`` (``"auto"`` is ``auto_fraction`` of it), a fraction
    divided among ``shares`` users of the same total (a byte budget is taken as it is).

    Fractions are applied exactly as written (0.7 of 100 bytes is 70, not 69) and rounded down.
    """
    if budget == AUTO:
        budget = auto_fraction
    if isinstance(budget, float):
        if total_bytes < 0 or shares < 1:
            raise ValueError(f"total_bytes must be >= 0 and shares >= 1, got {total_bytes} and {shares}")
        return math.floor(Fraction(repr(budget)) * total_bytes / shares)
    return int(budget)


def format_size(nbytes: int) -> str:
    """The shortest exact size string for ``nbytes`` (``1048576 -> '1MiB'``, ``6000000000 -> '6GB'``)."""
    for name, factor in (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9),
                         ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("kB", 10**3)):
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{name}"
    return f"{nbytes}B"
