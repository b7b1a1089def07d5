"""Size, rate and budget parsing (chameleon_dist.config.sizes)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_dist.config import ChameleonConfig, ConfigError
from chameleon_dist.config.sizes import SizeError, format_size, parse_budget, parse_size_bytes, resolve_budget_bytes


@pytest.mark.parametrize(
    ("text", "expected_bytes"),
    [
        ("123", 123),
        ("0", 0),
        ("123B", 123),
        ("123 b", 123),
        ("800kB", 800_000),
        ("800KB", 800_000),
        ("6GB", 6 * 10**9),
        ("6gb", 6 * 10**9),
        ("2 TB", 2 * 10**12),
        ("1MB", 10**6),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("1KiB", 1024),
        ("1TiB", 2**40),
        ("1.1kB", 1100),
        ("1e3", 1000),
        (" 4 GiB ", 4 * 2**30),
        (".5KiB", 512),
        (42, 42),
        (2.0**20, 2**20),
    ],
)
def test_size_table(text, expected_bytes):
    assert parse_size_bytes(text) == expected_bytes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("6 gigs", "is not a size (unknown unit 'gigs'"),
        ("GB", "is not a size"),
        ("", "is not a size"),
        ("6 G", "unknown unit 'G'"),
        ("1,5GB", "is not a size"),
        ("-5", "is negative"),
        ("-1GB", "is negative"),
        (-1, "is negative"),
        (True, "is a boolean"),
        (1.5, "not a whole number of bytes"),
        (float("nan"), "not a whole number of bytes"),
        ("1.5", "not a whole number of bytes"),
        ("2.5B", "not a whole number of bytes"),
        ([1], "(list) is not a size"),
        ("25GB/s", "is not a size"),  # "/s" only where a rate is expected
    ],
)
def test_size_errors(value, message):
    with pytest.raises(SizeError) as info:
        parse_size_bytes(value)
    assert message in str(info.value)


def test_rates_may_end_in_per_second():
    assert parse_size_bytes("25GB/s", per_second=True) == 25 * 10**9
    assert parse_size_bytes("1.5 GiB / s", per_second=True) == 3 * 2**29


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", "auto"),
        (" AUTO ", "auto"),
        (0.8, 0.8),
        (1.0, 1.0),
        ("0.8", 0.8),
        ("1.", 1.0),
        ("5e-1", 0.5),
        (1, 1),
        (0, 0),
        ("123", 123),
        ("6GB", 6 * 10**9),
    ],
)
def test_budget_table(value, expected):
    result = parse_budget(value)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize("value", [1.5, 0.0, -0.2, "1.5", "0.0", "1e9", float("inf")])
def test_budget_fraction_out_of_range(value):
    with pytest.raises(SizeError, match=r"is not a fraction in \(0, 1\]"):
        parse_budget(value)


def test_resolve_budget_bytes():
    assert resolve_budget_bytes("auto", 1000, 0.9) == 900
    assert resolve_budget_bytes(0.7, 100, 0.9) == 70  # not 69 from float rounding
    assert resolve_budget_bytes(0.5, 3, 0.9) == 1
    assert resolve_budget_bytes(1234, 10, 0.9) == 1234


@given(st.integers(min_value=0, max_value=2**62))
def test_bytes_round_trip_exactly(n):
    assert parse_size_bytes(f"{n}B") == n
    assert parse_size_bytes(f"{n} b") == n


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=2**52))
def test_mebibytes_round_trip_within_one_byte(n):
    assert abs(parse_size_bytes(f"{n / 2**20}MiB") - n) <= 1


@given(st.integers(min_value=0, max_value=2**50))
def test_format_size_round_trips(n):
    text = format_size(n)
    assert parse_size_bytes(text) == n
    assert ChameleonConfig(min_swap_bytes=text).min_swap_bytes == n


def test_format_size_prefers_short_units():
    assert format_size(2**20) == "1MiB"
    assert format_size(6 * 10**9) == "6GB"
    assert format_size(1001) == "1001B"


@given(st.floats(min_value=1e-9, max_value=1.0))
def test_fraction_budgets_stay_fractions(fraction):
    config = ChameleonConfig(memory_budget=fraction)
    assert config.memory_budget == fraction
    assert 0 <= config.memory_budget_bytes(10**12) <= 10**12


@given(st.floats(allow_nan=False).filter(lambda x: not 0 < x <= 1))
def test_fractions_out_of_range_always_name_the_field(value):
    with pytest.raises(ConfigError) as info:
        ChameleonConfig(host_memory_budget=value)
    assert info.value.problems[0].startswith("host_memory_budget: ")
    assert "fraction of host RAM in (0, 1]" in info.value.problems[0]
