"""Device memory accounting: a byte-budgeted pool (real on CUDA, simulated on CPU) and counters.

[Note: simulated device pool] Without CUDA the compute device is the CPU. The pool still holds a
byte budget and every "device" allocation of model data (shards, unsharded chunks, gradient buffers,
device optimizer states) is charged to it, so onload/offload/eviction/prefetch run and are counted
on CPU-only CI exactly as they would on a GPU.

[Note: activations in the budget] The activations autograd saves during forward are measured (the
bytes of every distinct storage packed by ``torch.autograd.graph.saved_tensors_hooks`` that is not a
chunk, released when the storage dies: after backward, or with the graph of a forward that had none, [Note:
pack without a cycle] in ``chunk/_activations.py``) and reported (``activation_bytes``,
``activation_peak_bytes``, ``device_total_peak_bytes`` = the peak of model data plus activations plus
temporaries). The budget is the whole device a user grants (docs/design/rules.md: "The budget is the whole card"):
an explicit ``device_memory_budget_bytes`` (with ``ElixirConfig.budget_covers_activations=True``, the
default) and ``None`` on CUDA (what the card has, :func:`whole_device_budget_bytes`) both *charge*
activations and autograd's temporaries (a parameter's ``.grad`` before it lands in its chunk): chunks
are evicted to make room for them, and a step whose activations do not fit beside the chunks it has
pinned raises :class:`DeviceBudgetExceededError` (naming the activation and model-data bytes and the
fixes) instead of running out of memory on the real card. When ``prepare`` knows the activation bytes
(``ElixirPlan.activation_peak_bytes``, which ``search="auto"`` records from its profiled step), placement
sizes the resident set and working set against the budget less those bytes, and
``hf_elixir.min_device_budget_bytes(..., activation_bytes=...)`` adds them to the floor.
``budget_covers_activations=False`` keeps the older model-data-only meaning: activations are measured but
not charged, and their room is left outside the budget. Each step on CUDA the pool is reconciled with
``torch.cuda.memory_allocated`` (one warning when they drift apart by more than 10%).

[Note: device reserve] Of the free memory ``torch.cuda.mem_get_info`` reports at ``prepare``, a
reserve is left to what the pool cannot see: the caching allocator's fragmentation and rounding (a
few percent of the card), cuBLAS / cuDNN workspaces and NCCL's communicator buffers (each tens to
hundreds of MiB): ``max(512 MiB, 8% of the card's total memory)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Callable

import psutil

import torch
import torch.distributed as dist

__all__ = ["DEVICE_RESERVE_FRACTION", "DEVICE_RESERVE_MIN_BYTES", "DeviceBudgetExceededError", "MemoryCounters",
           "DevicePool", "default_host_budget_bytes", "device_reserve_bytes", "resolve_budget_bytes",
           "whole_device_budget_bytes"]

logger = logging.getLogger(__name__)

DEVICE_RESERVE_FRACTION = 0.08
DEVICE_RESERVE_MIN_BYTES = 512 * 2**20
DRIFT_WARN_FRACTION = 0.10


def device_reserve_bytes(total_bytes: int) -> int:
    """Bytes of the card kept out of the budget ([Note: device reserve])."""
    return max(DEVICE_RESERVE_MIN_BYTES, int(total_bytes * DEVICE_RESERVE_FRACTION))


def whole_device_budget_bytes(device: torch.device, group=None) -> int:
    """``device_memory_budget_bytes=None`` on CUDA: the free memory of ``device`` at ``prepare`` less the
    reserve ([Note: device reserve]), the smallest over the ranks of ``group`` (placement decisions
    choose collectives, so every rank must make them from the same figure).

    Args:
        device: a CUDA device.
        group: the model's data-parallel group (``None``: this rank alone).

    Returns:
        bytes (>= 0).
    """
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    budget = max(0, int(free_bytes) - device_reserve_bytes(int(total_bytes)))
    if group is not None and dist.get_world_size(group) > 1:
        figure = torch.tensor([budget], dtype=torch.int64, device=device)
        dist.all_reduce(figure, op=dist.ReduceOp.MIN, group=group)
        budget = int(figure.item())  # once, at prepare
    return budget


def resolve_budget_bytes(budget_bytes: int | None, device: torch.device, group=None,
                         covers_activations: bool = True) -> tuple[int | None, bool]:
    """The budget ``prepare`` enforces for ``ElixirConfig.device_memory_budget_bytes=budget_bytes``.

    Args:
        budget_bytes: the configured budget (bytes) or ``None``.
        device: the compute device.
        group: the ranks whose smallest free memory a ``None`` budget on CUDA takes.
        covers_activations: ``ElixirConfig.budget_covers_activations`` (an explicit budget pays for
            activations and temporaries too).

    Returns:
        ``(budget, charges_activations)``: an explicit budget as given, charging activations when
        ``covers_activations``; ``None`` on a CUDA device: :func:`whole_device_budget_bytes`, always
        charging them ([Note: activations in the budget]); ``None`` elsewhere stays unlimited (the
        simulated device has no card to measure; nothing to charge against).
    """
    if budget_bytes is not None:
        return budget_bytes, covers_activations
    if device.type != "cuda":
        return None, False
    return whole_device_budget_bytes(device, group), True


class DeviceBudgetExceededError(RuntimeError):
    """Raised when model data, activations or autograd's temporaries cannot fit the device budget even
    after evicting every unpinned chunk."""


@dataclass
class MemoryCounters:
    """Cumulative counters (bytes are ints). ``memory_stats`` adds ``step_*`` deltas of the last step."""

    device_used_bytes: int = 0
    device_peak_bytes: int = 0
    activation_bytes: int = 0
    activation_peak_bytes: int = 0
    device_total_peak_bytes: int = 0  # model data + activations + temporaries
    host_bytes: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    num_evictions: int = 0
    num_onloads: int = 0
    num_prefetches: int = 0
    # all-gathers issued ahead of use by the prefetch, and issued inside an access for the chunk it needs
    # (the compute waits for the whole collective): [Note: gather prefetch] in _prefetch.py
    num_prefetched_gathers: int = 0
    num_blocking_gathers: int = 0
    # evictions of a chunk used sooner, forced by an all-gather issued ahead that every rank had agreed on
    # ([Note: agreed gathers ahead] in _agreed_gathers.py): this rank's batch left less room than the one it voted with
    num_agreed_gather_evictions: int = 0
    # uploads of the optimizer's new values into device shards issued without making the compute wait, each
    # waited for at its chunk's first use ([Note: overlapped refresh] in hf_elixir/optim/_refresh.py)
    num_refreshes_ahead: int = 0
    num_unshards: int = 0
    # batches of offloaded activations (one block call's saved tensors) copied back ahead of their block's
    # backward, and at its first unpack (the backward waits for the copy): [Note: activation onload ahead]
    num_prefetched_act_onloads: int = 0
    num_blocking_act_onloads: int = 0
    # seconds the compute thread spent blocked in all-gathers (inside an access) and in gradient
    # reduce-scatters / all-reduces (issuing them and waiting for them to finish)
    gather_wait_s: float = 0.0
    reduce_wait_s: float = 0.0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class DevicePool:
    """Charges device allocations of model data against ``budget_bytes`` (``None`` = unlimited).

    The pool does not allocate itself; callers :meth:`charge` before allocating and :meth:`release`
    after freeing, and ask :meth:`fits` before deciding to evict. With ``charges_activations`` the budget
    covers activations and autograd's temporaries too ([Note: activations in the budget]).
    """

    def __init__(self, budget_bytes: int | None, counters: MemoryCounters, charges_activations: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.counters = counters
        self.charges_activations = charges_activations
        # bytes placement kept out of the budget for activations (a plan's ``activation_peak_bytes``); 0 when
        # ``prepare`` had no measured figure: the advice in :meth:`activation_error` depends on which
        self.activation_reserve_bytes = 0
        # what placement commits on the device at the least (no cache): a budget shared by several models gives
        # the others the rest ([Note: one device budget for several models] in _shared_budget.py)
        self.committed_bytes: int | None = None
        # placement's count of committed bytes with the given chunk ids off the device (re-placement for a model
        # that joins the shared budget), set with committed_bytes
        self.recommit: Callable[[frozenset], int] | None = None
        self.drift_warned = False

    @property
    def used_bytes(self) -> int:
        extra = self.counters.activation_bytes if self.charges_activations else 0
        return self.counters.device_used_bytes + extra

    def fits(self, nbytes: int) -> bool:
        return self.budget_bytes is None or self.used_bytes + nbytes <= self.budget_bytes

    def _note_total_peak(self) -> None:
        total = self.counters.device_used_bytes + self.counters.activation_bytes
        self.counters.device_total_peak_bytes = max(self.counters.device_total_peak_bytes, total)

    def charge_activation(self, nbytes: int) -> None:
        """Record ``nbytes`` of activations (the caller made room first when ``charges_activations``)."""
        self.counters.activation_bytes += nbytes
        self.counters.activation_peak_bytes = max(self.counters.activation_peak_bytes, self.counters.activation_bytes)
        self._note_total_peak()

    def release_activation(self, nbytes: int) -> None:
        self.counters.activation_bytes -= nbytes
        assert self.counters.activation_bytes >= 0, "device pool released more activation bytes than it charged"

    def reconcile(self, allocated_bytes: int, reserved_bytes: int) -> bool:
        """Compare what the pool charges (model data + activations) with the allocator's
        ``memory_allocated``; log ONE warning (per pool) giving both figures when they differ by more than
        10%. Returns whether they drifted."""
        charged = self.counters.device_used_bytes + self.counters.activation_bytes
        drift = abs(allocated_bytes - charged) > DRIFT_WARN_FRACTION * max(allocated_bytes, charged, 1)
        if drift and not self.drift_warned:
            self.drift_warned = True
            logger.warning(
                "device memory drift: hf_elixir's pool charges %d bytes (model data %d + activations %d) but "
                "torch.cuda.memory_allocated reports %d bytes (memory_reserved %d); the budget is enforced on "
                "the pool's figure, so allocations it does not see can run the device out of memory",
                charged, self.counters.device_used_bytes, self.counters.activation_bytes, allocated_bytes,
                reserved_bytes)
        return drift

    def reconcile_cuda(self, device: torch.device) -> bool:
        """:meth:`reconcile` with ``torch.cuda.memory_allocated`` / ``memory_reserved`` of ``device``."""
        return self.reconcile(int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device)))

    def charge(self, nbytes: int, what: str) -> None:
        if not self.fits(nbytes):
            raise DeviceBudgetExceededError(
                f"device memory budget exceeded while allocating {nbytes} bytes for {what}: "
                f"{self.used_bytes} bytes in use ({self.in_use_breakdown()}), budget {self.budget_bytes} bytes and "
                f"nothing left to evict; raise ElixirConfig.device_memory_budget_bytes to at least "
                f"{self.used_bytes + nbytes}" + self._activation_fixes()
            )
        self.counters.device_used_bytes += nbytes
        self.counters.device_peak_bytes = max(self.counters.device_peak_bytes, self.counters.device_used_bytes)
        self._note_total_peak()

    def in_use_breakdown(self) -> str:
        """What :attr:`used_bytes` is made of, for error messages."""
        if not self.charges_activations:
            return f"model data {self.counters.device_used_bytes}; activations are outside this budget"
        return (f"model data and temporaries {self.counters.device_used_bytes}, activations "
                f"{self.counters.activation_bytes}")

    def _activation_fixes(self) -> str:
        if not (self.charges_activations and self.counters.activation_bytes):
            return ""
        return (f"; {self.counters.activation_bytes} of those bytes are activations (the budget covers them): "
                "activation checkpointing (model.gradient_checkpointing_enable()) or a smaller batch or sequence "
                "needs less, and budget_covers_activations=False makes the budget bound model data only")

    def activation_error(self, nbytes: int, shape: tuple, pinned_bytes: int) -> DeviceBudgetExceededError:
        """The error for an activation of ``nbytes`` (a tensor of ``shape``) that cannot fit beside the
        ``pinned_bytes`` of model data no eviction can free ([Note: activations in the budget])."""
        live = self.counters.activation_bytes
        return DeviceBudgetExceededError(
            f"activations do not fit the device budget: autograd saves {nbytes} more bytes for backward (a tensor "
            f"of shape {shape}) on top of {live} bytes of activations already saved and {pinned_bytes} bytes of "
            f"model data that cannot be evicted ({self.in_use_breakdown()}); ElixirConfig.device_memory_budget_bytes="
            f"{self.budget_bytes} covers activations (budget_covers_activations=True). This is part-way through "
            f"the forward: the step needs more than {self.counters.device_used_bytes + live + nbytes} bytes, and "
            "chunks that prepare placed resident (or pinned) are not evicted for activations. Fixes: "
            + self._placement_fix() +
            "turn on activation checkpointing (model.gradient_checkpointing_enable() or "
            "ElixirConfig(activation_policy='recompute')), use a smaller batch or sequence, or "
            "budget_covers_activations=False to make the budget bound model data only")

    def _placement_fix(self) -> str:
        """The first fix :meth:`activation_error` names: with no measured activations, let the search measure them;
        with a plan's figure, say that this batch needs more than the batch it was measured on."""
        if not self.activation_reserve_bytes:
            return ("prepare with search='auto' and a sample batch (it measures the step's activations and places the "
                    "chunks beside them: hf_elixir.prepare(model, optimizer, ElixirConfig(search='auto', ...), "
                    "sample_batch=batch); ElixirPlugin and ElixirCallback take the first training batch), ")
        return (f"placement kept {self.activation_reserve_bytes} bytes of the budget for activations, the plan's "
                "activation_peak_bytes measured on its sample batch, and this batch saves more: search again (or "
                "run hf-elixir plan) with the largest batch and sequence the run trains on, ")

    def release(self, nbytes: int) -> None:
        self.counters.device_used_bytes -= nbytes
        assert self.counters.device_used_bytes >= 0, "device pool released more bytes than it charged"


def default_host_budget_bytes() -> int:
    """80% of this machine's RAM divided by the ranks on it (``LOCAL_WORLD_SIZE``, set by torchrun and
    ``accelerate launch``; 1 when unset): what ``ElixirConfig.host_memory_budget_bytes=None`` means."""
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return int(0.8 * psutil.virtual_memory().total) // local_ranks
