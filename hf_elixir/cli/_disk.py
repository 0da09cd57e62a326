"""The disk tier on the command line: ``hf-elixir probe`` (the disk's write and read GB/s, kept in the hardware
cache) and ``hf-elixir plan --disk 30TB [--disk-gbps X]`` (a third tier beside host memory, priced by
``hf_elixir/search/_disk_cost.py``: [Note: disk tier pricing]).

``plan`` reports what the chosen plan keeps on the disk, the disk seconds a step and the tokens per step at which
they hide under compute (gradient accumulation: the optimizer state is read and written once per optimizer step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hf_elixir.cli._units import human_bytes, human_s

__all__ = ["DEFAULT_DISK_GBPS", "add_disk_flags", "add_probe_parser", "check_disk_args", "cmd_probe", "disk_lines",
           "disk_report", "disk_tier"]

#: the disk's rate without ``--disk-gbps`` (and without a measurement with ``--measure-here``), GB/s both ways:
#: ``hf_elixir.search._disk_cost.DEFAULT_DISK_BYTES_PER_S`` (one NVMe drive; not imported: no torch for --help)
DEFAULT_DISK_GBPS = 5.0


def add_disk_flags(target: argparse._ArgumentGroup, size, positive_float) -> None:
    """``plan``'s ``--disk`` and ``--disk-gbps`` (``size`` / ``positive_float``: the CLI's argparse types)."""
    target.add_argument("--disk", type=size, default=None,
                        help="a disk tier of this size per machine, e.g. 30TB: what does not fit --host-memory (fp32 "
                        "masters and optimizer moments first, then parameter chunks) lives in files there, read and "
                        "written back each step (ElixirConfig(offload_dir=..., disk_budget_bytes=...))")
    target.add_argument("--disk-gbps", type=positive_float, default=None,
                        help="the disk's sequential GB/s per machine, read and write, all GPUs together (default: "
                        f"{DEFAULT_DISK_GBPS:g}, one NVMe drive; with --measure-here: hf-elixir probe's measurement)")


def add_probe_parser(sub, size) -> None:
    probe = sub.add_parser("probe", help="measure this machine's disk (write and read GB/s) for the disk tier and "
                           "keep it in the hardware cache")
    probe.add_argument("--disk-dir", default=None,
                       help="a folder on the disk to measure, where ElixirConfig(offload_dir=...) would point "
                       "(default: the system's temporary folder)")
    probe.add_argument("--disk-size", type=size, default=256 * 2**20,
                       help="bytes of the temporary file (default 256MiB; larger is steadier)")
    probe.add_argument("--repeats", type=int, default=2, help="passes; the best counts (default 2)")
    probe.add_argument("--json", action="store_true", help="print the rates as JSON")


def check_disk_args(args: argparse.Namespace) -> None:
    """The disk flags together ([Note: CLI checks] in ``__init__``).

    Raises:
        ValueError: ``--disk-gbps`` without ``--disk``, ``probe --repeats`` below 1, an unusable ``--disk-dir``
            or a ``--disk-size`` above half its free space.
    """
    if args.command == "plan" and args.disk_gbps is not None and args.disk is None:
        raise ValueError(f"--disk-gbps {args.disk_gbps:g} prices a disk tier, which needs its size: add --disk, "
                         "e.g. --disk 30TB")
    if args.command == "probe":
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats} must be >= 1, e.g. 2")
        import tempfile

        from hf_elixir.profiler._disk_probe import check_directory

        check_directory(args.disk_dir or tempfile.gettempdir(), size_bytes=args.disk_size)


def disk_tier(args: argparse.Namespace, hardware) -> tuple[Any, list[dict]]:
    """``(DiskTier or None, rate rows)`` for ``plan``: ``--disk`` per machine at ``--disk-gbps``, else this
    machine's measured rates with ``--measure-here`` where ``hf-elixir probe`` ran, else :data:`DEFAULT_DISK_GBPS`."""
    if getattr(args, "disk", None) is None:
        return None, []
    from hf_elixir.search._disk_cost import DiskTier

    if args.disk_gbps is not None:
        read = write = args.disk_gbps * 1e9
        source = "--disk-gbps"
    elif getattr(args, "measure_here", False) and hardware.disk_read_bytes_per_s and hardware.disk_write_bytes_per_s:
        read, write = hardware.disk_read_bytes_per_s, hardware.disk_write_bytes_per_s
        source = f"measured on this machine by hf-elixir probe ({hardware.disk_dir})"
    else:
        read = write = DEFAULT_DISK_GBPS * 1e9
        source = "one NVMe drive (default; --disk-gbps for the target's, hf-elixir probe measures one)"
    rows = [{"rate": "disk read", "value": round(read / 1e9, 4), "unit": "GB/s per machine", "source": source},
            {"rate": "disk write", "value": round(write / 1e9, 4), "unit": "GB/s per machine", "source": source},
            {"rate": "disk per machine", "value": args.disk, "unit": "bytes", "source": "--disk"}]
    return DiskTier(capacity_bytes=args.disk, read_bytes_per_s=read, write_bytes_per_s=write), rows


def disk_report(pred, tokens_per_step: int, gpus_per_machine: int) -> dict | None:
    """The chosen plan's disk tier (``None`` where the host holds everything): bytes per GPU, seconds per step, and
    the tokens per step at which the disk hides under compute ([Note: disk tier pricing] in
    ``hf_elixir/search/_disk_cost.py``)."""
    info = getattr(pred, "disk", None)
    if info is None:
        return None
    tokens = info.hide_tokens(tokens_per_step)
    hidden_s = None if tokens is None else info.step_s(tokens, tokens_per_step)
    return {"optimizer_bytes_per_gpu": info.optimizer_bytes, "param_bytes_per_gpu": info.param_bytes,
            "grad_bytes_per_gpu": info.grad_bytes, "staging_bytes_per_gpu": info.staging_bytes,
            "disk_bytes_per_machine": info.spilled_bytes * gpus_per_machine,
            "read_bytes_per_step_per_gpu": info.read_bytes, "write_bytes_per_step_per_gpu": info.write_bytes,
            "disk_s": round(info.disk_s, 6), "step_without_disk_s": round(info.step_without_disk_s, 6),
            "compute_s": round(info.compute_s, 6), "hidden": info.disk_s <= info.step_without_disk_s,
            "hide_tokens_per_step": tokens, "hide_step_s": None if hidden_s is None else round(hidden_s, 6),
            "hide_tokens_per_s": None if hidden_s is None else round(tokens / hidden_s, 1)}


def disk_lines(report: dict) -> list[str]:
    """The report's disk lines (none without a disk tier in the plan)."""
    disk = report.get("disk")
    if not disk:
        return []
    lines = [f"Disk per GPU: {human_bytes(disk['optimizer_bytes_per_gpu'])} of fp32 masters and moments, "
             f"{human_bytes(disk['param_bytes_per_gpu'])} of parameter chunks, {human_bytes(disk['grad_bytes_per_gpu'])}"
             f" of fp32 gradients ({human_bytes(disk['disk_bytes_per_machine'])} a machine; host staging "
             f"{human_bytes(disk['staging_bytes_per_gpu'])}); a step reads {human_bytes(disk['read_bytes_per_step_per_gpu'])}"
             f" and writes {human_bytes(disk['write_bytes_per_step_per_gpu'])} per GPU: {human_s(disk['disk_s'])} of "
             f"disk against {human_s(disk['step_without_disk_s'])} of step"]
    if disk["hidden"]:
        lines.append("  the disk hides under the step")
    elif disk["hide_tokens_per_step"] is None:
        lines.append("  the disk never hides: the step computes nothing")
    else:
        lines.append(f"  the disk hides under compute from {disk['hide_tokens_per_step']:,} tokens per step "
                     f"({human_s(disk['hide_step_s'])} a step, {disk['hide_tokens_per_s']:,.0f} tokens/s; the "
                     "compute grows with the tokens, the disk traffic does not)")
    if disk["param_bytes_per_gpu"]:  # docs/disk.md: the runtime's tier holds less
        lines.append("  note: prepare's disk tier (ElixirConfig(offload_dir=...)) holds fp32 masters, moments, gradient "
                     "shards and the parameter host shards of trained chunks; frozen chunks' shards and rank-local "
                     "refill copies stay in host memory (hf_elixir.min_host_budget_bytes gives what a prepared model "
                     "needs there)")
    return lines


def cmd_probe(args: argparse.Namespace) -> int:
    """``hf-elixir probe``: time the disk ([Note: disk probe] in ``hf_elixir/profiler/_disk_probe.py``), keep the
    rates in the hardware cache, print them."""
    import tempfile

    from hf_elixir.profiler._hardware import default_cache_path, probe_disk

    directory = args.disk_dir or tempfile.gettempdir()
    rates = probe_disk(directory, size_bytes=args.disk_size, repeats=args.repeats)
    out = {"disk_dir": rates.directory, "write_gbps": round(rates.write_bytes_per_s / 1e9, 4),
           "read_gbps": round(rates.read_bytes_per_s / 1e9, 4), "size_bytes": rates.size_bytes,
           "read_method": rates.method, "cache": str(default_cache_path())}
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    note = {"direct": "O_DIRECT reads", "fadvise": "reads after dropping the page cache (posix_fadvise)",
            "cached": "reads possibly from the page cache: a memory rate, not the disk's"}[rates.method]
    print(f"disk {rates.directory}: write {out['write_gbps']:g} GB/s (fsync'd), read {out['read_gbps']:g} GB/s "
          f"({note}), {rates.size_bytes / 2**20:.0f} MiB file; kept in {out['cache']} for plan --measure-here "
          f"--disk ...{os.linesep}", end="")
    return 0
