"""Byte units, one definition for the whole engine: binary (GiB, what memory is allocated in)
and decimal (GB, what disks, downloads and bandwidths are quoted in)."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
GB = 10**9


def format_bytes(count: int | float) -> str:
    """"1.5 GB": decimal units, as the Hugging Face hub and file managers show sizes."""
    value = float(count)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
