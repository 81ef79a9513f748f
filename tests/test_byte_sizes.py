"""Byte sizes: parsing what people write, refusing what they did not mean, printing them back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (" 4096 ", 4096),
        ("512B", 512),
        ("1KiB", 1024),
        ("8GiB", 8 * 2**30),
        ("8 GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        ("8G", 8 * 2**30),
        ("8g", 8 * 2**30),
        ("1.5GiB", 3 * 2**29),
        (".5MiB", 2**19),
        ("2TiB", 2 * 2**40),
        ("1KB", 1000),
        ("1.5GB", 1_500_000_000),
        ("3MB", 3_000_000),
        ("1TB", 10**12),
        ("1.1KiB", 1126),  # 1126.4 rounded down to whole bytes
        (4096, 4096),
    ],
)
def test_parse_bytes_accepts_units(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_fractions_are_exact_not_float_rounded() -> None:
    # float("0.1") * 2**30 is 107374182.40000001; exact arithmetic floors to ...182.
    assert parse_bytes("0.1GiB") == 107374182


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1GiB", "must not be negative"),
        (-5, "must not be negative"),
        ("0", "more than 0"),
        ("0GiB", "more than 0"),
        (0, "more than 0"),
        ("", "not a size"),
        ("GiB", "not a size"),
        ("lots", "not a size"),
        ("1e9", "not a size"),
        ("8 GiBs", "unknown unit"),
        ("8PiB", "unknown unit"),
        ("1 2GiB", "not a size"),
        ("2PiB", "unknown unit"),
        ("1025TiB", "over the largest"),
        (MAX_BYTES + 1, "over the largest"),
        (True, "must be a size"),
        (1.5, "must be a size"),
        (None, "must be a size"),
    ],
)
def test_parse_bytes_refuses_bad_input(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bytes(value)  # type: ignore[arg-type]


def test_zero_only_where_allowed_and_what_is_named() -> None:
    assert parse_bytes("0", allow_zero=True) == 0
    assert parse_bytes(0, allow_zero=True) == 0
    with pytest.raises(ValueError, match=r"^reserve must not be negative"):
        parse_bytes("-1", what="reserve", allow_zero=True)
    assert parse_bytes(MAX_BYTES) == MAX_BYTES


def test_parse_budget_percentages() -> None:
    total = 16 * 2**30
    assert parse_budget("40%", total) == int(total * 0.4)
    assert parse_budget("12.5 %", total) == 2 * 2**30
    assert parse_budget("100%", total) == total
    assert parse_budget("8GiB", total) == 8 * 2**30  # a size is not scaled
    assert parse_budget(1000, total) == 1000


@pytest.mark.parametrize(
    ("value", "total", "message"),
    [
        ("0%", 2**30, "more than 0 and at most 100"),
        ("101%", 2**30, "more than 0 and at most 100"),
        ("-5%", 2**30, "not a percentage"),
        ("%", 2**30, "not a percentage"),
        ("forty%", 2**30, "not a percentage"),
        ("1%", 50, "is 0 bytes"),
        ("40%", 0, "total memory must be a positive"),
        ("0B", 2**30, "more than 0"),
    ],
)
def test_parse_budget_refuses_bad_input(value: str, total: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_budget(value, total)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (8 * 2**30, "8 GiB"),
        (3 * 2**29, "1.5 GiB"),
        (1_500_000_000, "1.4 GiB"),
        (2**40, "1 TiB"),
        (2**50, "1024 TiB"),
        (-(2**30), "-1 GiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@given(st.integers(1, 1023), st.sampled_from(["B", "KiB", "MiB", "GiB", "TiB"]))
def test_whole_units_round_trip(count: int, unit: str) -> None:
    n = parse_bytes(f"{count}{unit}")
    assert parse_bytes(format_bytes(n)) == n
