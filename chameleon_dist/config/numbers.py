"""Parsing of compute rates ("312e12", "312 TFLOP/s") and durations ("5us", "0.2 ms", 3e-6).

A YAML file reads ``3e-6`` (no decimal point) as a string, and Megatron's launch arguments are strings,
so numbers written as strings are accepted everywhere. Functions here raise :class:`NumberError` whose
message says what is wrong with the value (the schema adds what to write instead).
"""

from __future__ import annotations

import math
import re

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_RATE_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<prefix>[kKMGTP]?)\s*(?:flops?(?:\s*/\s*s(?:ec)?)?)?\s*$",
                      re.IGNORECASE)
_DURATION_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<unit>[a-zµμ]*)\s*$", re.IGNORECASE)

# Tuples of pairs, not dicts, so that nothing module-level is mutable.
_RATE_PREFIXES: tuple[tuple[str, float], ...] = (("", 1.0), ("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12),
                                                  ("p", 1e15))
# unit -> how many of it make a second (a division keeps "5us" exactly 5e-06)
_DURATION_UNITS: tuple[tuple[str, float], ...] = (("", 1.0), ("s", 1.0), ("ms", 1e3), ("us", 1e6), ("µs", 1e6),
                                                  ("μs", 1e6), ("ns", 1e9))
DURATION_UNIT_NAMES = "s, ms, us (or µs), ns"


class NumberError(ValueError):
    """A value that is not a valid rate or duration; the message describes the value's problem."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _lookup(table: tuple[tuple[str, float], ...], key: str) -> float | None:
    for name, factor in table:
        if name == key:
            return factor
    return None


def _finite(number: float, original: object) -> float:
    if not math.isfinite(number):
        raise NumberError(f"{_short(original)} is not a finite number")
    return number


def _plain_number(value: object, what: str) -> float | None:
    """``value`` as a float when it is an int or float; None for a string; NumberError otherwise."""
    if isinstance(value, bool):
        raise NumberError(f"{value!r} is a boolean, not a {what}")
    if isinstance(value, (int, float)):
        return _finite(float(value), value)
    if not isinstance(value, str):
        raise NumberError(f"{_short(value)} ({type(value).__name__}) is not a {what}")
    return None


def parse_flop_per_s(value: object) -> float:
    """FLOP per second from a number or a string such as ``"312e12"``, ``"312T"`` or ``"312 TFLOP/s"``."""
    number = _plain_number(value, "rate")
    if number is None:
        match = _RATE_RE.match(str(value))
        if match is None:
            raise NumberError(f"{_short(value)} is not a FLOP rate")
        factor = _lookup(_RATE_PREFIXES, match.group("prefix").lower())
        number = _finite(float(match.group("number")) * (factor or 1.0), value)
    return number


def parse_seconds(value: object) -> float:
    """Seconds from a number (seconds) or a string such as ``"3e-6"``, ``"5us"``, ``"5 µs"`` or ``"0.2ms"``."""
    number = _plain_number(value, "duration")
    if number is None:
        match = _DURATION_RE.match(str(value))
        per_second = None if match is None else _lookup(_DURATION_UNITS, match.group("unit").lower())
        if match is None or per_second is None:
            raise NumberError(f"{_short(value)} is not a duration (units: {DURATION_UNIT_NAMES})")
        number = _finite(float(match.group("number")) / per_second, value)
    return number
