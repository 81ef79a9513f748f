"""Byte sizes as people write them (``8GiB``, ``1.5 GB``, ``40%``) and as vqpool prints them.

Units, case-insensitive, with or without a space before them:

- binary: ``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB``, and the one-letter forms ``K``, ``M``,
  ``G``, ``T`` (binary too, as in ``docker --memory 8g`` and ``java -Xmx8g``);
- decimal: ``KB``, ``MB``, ``GB``, ``TB`` are powers of 1000 (``1GB`` is 1,000,000,000 bytes,
  about 0.93 GiB), as on a disk label and in macOS's Finder;
- no unit: bytes.

Fractions are allowed (``1.5GiB``) and rounded down to whole bytes. Every size is bounded by
:data:`MAX_BYTES` (1 PiB): a larger one is a typo, not a machine.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_BYTES = 2**50
"""The largest size accepted anywhere (1 PiB): far above any machine's memory, far below where
int arithmetic on byte counts could surprise anyone."""

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)")
_PERCENT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*%")
_FORMAT_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _checked(n: int, what: str, allow_zero: bool) -> int:
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {n}")
    if n == 0 and not allow_zero:
        raise ValueError(f"{what} must be more than 0 bytes")
    if n > MAX_BYTES:
        raise ValueError(f"{what} {format_bytes(n)} is over the largest accepted size (1 PiB)")
    return n


def parse_bytes(value: str | int, *, what: str = "size", allow_zero: bool = False) -> int:
    """``value`` in bytes: an int, or a string such as ``"8GiB"``, ``"1.5 GB"``, ``"4096"``.

    Args:
        value: The size; see the module docstring for the units.
        what: What the size is, for the error message (``"budget"``, ``"reserve"``).
        allow_zero: Accept 0 (a reserve may be 0; a budget may not).

    Raises:
        ValueError: Not a size, an unknown unit, negative, zero (unless allowed), or over
            :data:`MAX_BYTES`.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} must be a size such as 8GiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        return _checked(value, what, allow_zero)
    text = value.strip()
    if text.startswith("-"):
        raise ValueError(f"{what} must not be negative, got {value!r}")
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{what} {value!r}: not a size; write a number and a unit, such as 8GiB, 512MiB, "
            "1.5GB or 4096"
        )
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(
            f"{what} {value!r}: unknown unit {unit!r} (binary: B, KiB, MiB, GiB, TiB or K, M, G, "
            "T; decimal: KB, MB, GB, TB)"
        )
    # Exact arithmetic: float("0.1") * 2**30 would round, and a 1 PiB bound needs exact ints.
    return _checked(int(Fraction(number) * multiplier), what, allow_zero)


def parse_budget(value: str | int, total_memory: int, *, what: str = "budget") -> int:
    """A budget in bytes: a size (see :func:`parse_bytes`) or a percentage of ``total_memory``.

    ``"40%"`` is 40% of ``total_memory`` (pass ``psutil.virtual_memory().total`` for the
    machine's physical memory), rounded down to whole bytes; fractions such as ``"12.5%"`` work.

    Raises:
        ValueError: Not a size or a percentage in (0, 100], or the result is 0 bytes or over
            :data:`MAX_BYTES`.
    """
    if isinstance(value, str) and value.strip().endswith("%"):
        match = _PERCENT.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"{what} {value!r}: not a percentage such as 40%")
        percent = Fraction(match.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"{what} {value!r}: a percentage must be more than 0 and at most 100")
        if isinstance(total_memory, bool) or not isinstance(total_memory, int) or total_memory < 1:
            raise ValueError(
                f"total memory must be a positive number of bytes, got {total_memory!r}"
            )
        n = int(total_memory * percent / 100)
        if n == 0:
            raise ValueError(f"{what} {value!r} of {format_bytes(total_memory)} is 0 bytes")
        return _checked(n, what, allow_zero=False)
    return parse_bytes(value, what=what)


def format_bytes(n: int) -> str:
    """``n`` bytes for people, in binary units: ``0 B``, ``512 B``, ``8 GiB``, ``1.5 GiB``.

    Whole units print without decimals; others with up to two (``1.46 GiB``), so a value that
    :func:`parse_bytes` read from ``8GiB`` prints back as ``8 GiB``. Negative values keep their
    sign (a model over its budget by some bytes).
    """
    sign = "-" if n < 0 else ""
    size = abs(n)
    for unit, multiplier in _FORMAT_UNITS:
        if size >= multiplier:
            if size % multiplier == 0:
                return f"{sign}{size // multiplier} {unit}"
            text = f"{size / multiplier:.2f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
    return f"{sign}{size} B"
