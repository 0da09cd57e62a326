"""What the benchmark reports share: a timestamped progress line, markdown tables, a verdict against a target, and
the machine and versions a result came from."""

from __future__ import annotations

import os
import time

__all__ = ["log", "md_table", "verdict", "versions", "machine"]


def log(message: str) -> None:
    """A progress line with the wall-clock time (stdout, flushed: the benchmarks run for minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def md_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table (a ``|`` inside a cell becomes ``/``)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def versions() -> str:
    """Python, torch, transformers, DeepSpeed and hf_elixir versions, in one line."""
    import importlib.metadata as md
    import platform

    names = ["torch", "transformers", "deepspeed", "hf-elixir"]
    found = []
    for n in names:
        try:
            found.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            if n == "hf-elixir":
                import hf_elixir

                found.append(f"hf_elixir {hf_elixir.__version__} (source tree)")
            else:
                found.append(f"{n} not installed")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def machine() -> str:
    """This machine in one line: CPU, cores, load average, RAM."""
    import platform

    import psutil

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPU cores (shared with other jobs; "
            f"load average at the end {load}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, no GPU; "
            "torch.distributed backend gloo")


def verdict(what: str, ratio: float, target: float, lower_is_better: bool, alt: str = "") -> str:
    """``- **what: 1.23x** (target <= 1.0x): met`` or ``MISSED - missed by ...``; ``alt`` adds a second figure."""
    met = ratio <= target if lower_is_better else ratio >= target
    sign = "<=" if lower_is_better else ">="
    gap = "" if met else (f" - missed by {ratio / target:.2f}x" if lower_is_better else f" - missed by {target / ratio:.2f}x")
    return (f"- **{what}: {ratio:.2f}x** (target {sign} {target}x): {'met' if met else 'MISSED'}{gap}"
            + (f" ({alt}: the fastest step of each, less disturbed by other jobs on this machine)" if alt else ""))
