"""Numbers as a person reads them in the CLI's reports: bytes in binary units, counts, durations."""

from __future__ import annotations

__all__ = ["human_bytes", "human_count", "human_s"]


def human_bytes(value: float | int | None) -> str:
    """``"812 MiB"``, ``"75.97 GiB"``, ``"1 TiB"``: binary units, no scientific notation."""
    if value is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(value)} B"


def human_count(value: float) -> str:
    """Parameters and elements: ``"124.4 M"``, ``"46.7 B"``, ``"31.6 K"``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{int(value)}"


def human_s(seconds: float | None) -> str:
    """A duration in the unit a person reads: ``"812 ms"``, ``"3.41 s"``, ``"2.5 min"``, ``"1.2 h"``."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120.0:
        return f"{seconds:.3g} s"
    if seconds < 7200.0:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"
