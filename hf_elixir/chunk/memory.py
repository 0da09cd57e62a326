"""Device memory accounting: a byte-budgeted pool (real on CUDA, simulated on CPU) and counters.

[Note: simulated device pool] Without CUDA the compute device is the CPU. The pool still holds a
byte budget and every "device" allocation of model data (shards, unsharded chunks, gradient buffers,
device optimizer states) is charged to it, so onload/offload/eviction/prefetch run and are counted
on CPU-only CI exactly as they would on a GPU. Activations are not charged: like Gemini's chunk
budget, the pool bounds model data; the profiler measures activations separately.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["DeviceBudgetExceededError", "MemoryCounters", "DevicePool"]


class DeviceBudgetExceededError(RuntimeError):
    """Raised when model data cannot fit the device budget even after evicting every unpinned chunk."""


@dataclass
class MemoryCounters:
    """Cumulative counters (bytes are ints). ``memory_stats`` adds ``step_*`` deltas of the last step."""

    device_used_bytes: int = 0
    device_peak_bytes: int = 0
    host_bytes: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    num_evictions: int = 0
    num_onloads: int = 0
    num_prefetches: int = 0
    num_unshards: int = 0
    # seconds the compute thread spent blocked in all-gathers (inside an access) and in gradient
    # reduce-scatters / all-reduces (issuing them and waiting for them to finish)
    gather_wait_s: float = 0.0
    reduce_wait_s: float = 0.0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class DevicePool:
    """Charges device allocations of model data against ``budget_bytes`` (``None`` = unlimited).

    The pool does not allocate itself; callers :meth:`charge` before allocating and :meth:`release`
    after freeing, and ask :meth:`fits` before deciding to evict.
    """

    def __init__(self, budget_bytes: int | None, counters: MemoryCounters) -> None:
        self.budget_bytes = budget_bytes
        self.counters = counters

    @property
    def used_bytes(self) -> int:
        return self.counters.device_used_bytes

    def fits(self, nbytes: int) -> bool:
        return self.budget_bytes is None or self.used_bytes + nbytes <= self.budget_bytes

    def charge(self, nbytes: int, what: str) -> None:
        if not self.fits(nbytes):
            raise DeviceBudgetExceededError(
                f"device memory budget exceeded while allocating {nbytes} bytes for {what}: "
                f"{self.used_bytes} bytes in use, budget {self.budget_bytes} bytes and nothing left to evict; "
                f"raise ElixirConfig.device_memory_budget_bytes to at least {self.used_bytes + nbytes}"
            )
        self.counters.device_used_bytes += nbytes
        self.counters.device_peak_bytes = max(self.counters.device_peak_bytes, self.counters.device_used_bytes)

    def release(self, nbytes: int) -> None:
        self.counters.device_used_bytes -= nbytes
        assert self.counters.device_used_bytes >= 0, "device pool released more bytes than it charged"
