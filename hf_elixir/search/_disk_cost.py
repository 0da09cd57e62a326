"""The disk tier in the cost model: what a plan keeps in files when its host bytes exceed host memory, the disk
traffic that costs each step, and the tokens per step at which that traffic hides under compute.

[Note: disk tier pricing]
Per machine, ``R`` ranks share host memory ``L`` and one disk (``DiskTier``: its capacity, its read and write
bytes per second for all ranks together, e.g. an NVMe RAID's aggregate). A priced configuration (``predict``)
holds ``H`` host bytes a rank; where ``R * H > L`` the rest goes to the disk, chunk by chunk, in the order the
runtime spills (``ElixirConfig(offload_dir=..., disk_budget_bytes=...)``):

1. the fp32 masters and optimizer moments of host-optimizer chunks (``4 k`` bytes a shard element for ``k``
   moments, plus the 4-byte master where it is not the parameter shard itself): read before the chunk's update
   and written back after it, once per step;
2. then, where those do not free enough, parameter chunks (host shards in the compute dtype, and the rank-local
   refill copies where the plan keeps them; read at each of the chunk's onloads, ``Prediction.chunk_onloads``, at
   least once, and written back after the update where the chunk is trained) and fp32 gradient shards (written by
   the reduce, read by the update), the fewest bytes moved per byte freed first.

The spill takes whole chunk parts until the host fits, and adds a bounded staging area in host memory:
:data:`STAGING_BUFFERS` buffers (one read ahead, one written back) of the largest spilled part, at most
:data:`STAGING_BUFFER_BYTES` each, since a part streams through in slices (the update is element-wise and a copy
to the device can start from a slice; ZeRO-Infinity's ``buffer_count`` x ``buffer_size``). At 3 GB/s a rank
turns a 128 MiB buffer over in about 45 ms, well under a step. A configuration the disk cannot hold (``R`` times
the spilled bytes above its capacity) or that no spill fits is dropped.

Time: the runtime reads ahead in the step's order and writes back asynchronously, both overlapping compute, so
the disk's seconds ``D = R * (read / read_rate + write / write_rate)`` (reads and writes share the disk, so they
add) bound the step from below: ``step = max(step without disk, D)``.

Where the disk hides: parameters and gradients cross the disk once per micro-step whatever its tokens, and the
optimizer state once per step, so only more compute per micro-step hides them (gradient accumulation would
repeat the parameter and gradient traffic with the compute). ``DiskSpill.hide_tokens`` is the least tokens per
step (one micro-step: batch x sequence x data-parallel ranks) whose step covers ``D``, the device compute
(``Prediction.compute_s``) growing in proportion to the tokens and everything else as priced:
``T * (1 + max(0, D - step) / compute)``. It is the arithmetic-intensity argument of ZeRO-Infinity (arXiv
2104.07857, section 4: the bandwidth a step needs falls as its tokens grow); the activations of that larger
micro-batch are not priced (recompute or offload them; the search prices them at the micro-batch asked for). No
queue depth or latency is modelled: the disk runs at its rated sequential rate (``hf-elixir probe`` measures it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hf_elixir.search._activation_cost import DTYPE_BYTES
from hf_elixir.search._chunked_step import ChunkedStep, Knobs
from hf_elixir.search._memory_cost import resolve_host_copies

__all__ = ["DEFAULT_DISK_BYTES_PER_S", "DiskSpill", "DiskTier", "config_disk_tier", "disk_reason", "STAGING_BUFFERS", "STAGING_BUFFER_BYTES", "fit_host", "least_host_bytes",
           "spill"]

#: host staging of the disk tier: this many buffers of the largest spilled part, at most this many bytes each
#: ([Note: disk tier pricing])
STAGING_BUFFERS, STAGING_BUFFER_BYTES = 2, 128 * 2**20


#: a disk's sequential rate where nothing better is known (bytes/s, read and write): one PCIe Gen4 NVMe drive,
#: derated (7 GB/s read, 5 GB/s write rated); ``hf-elixir probe`` measures the real one
DEFAULT_DISK_BYTES_PER_S = 5e9


def _staging_bytes(largest_part_bytes: int) -> int:
    return STAGING_BUFFERS * min(largest_part_bytes, STAGING_BUFFER_BYTES)


@dataclass(frozen=True)
class DiskTier:
    """One machine's disk for the spill ([Note: disk tier pricing]).

    Attributes:
        capacity_bytes: bytes the plan may keep on it (``--disk``; ``ElixirConfig.disk_budget_bytes`` times the
            ranks of a machine).
        read_bytes_per_s / write_bytes_per_s: sustained rates of all the machine's ranks together
            (``--disk-gbps``, or ``hf-elixir probe``'s measurement).
        optimizer_only: spill only fp32 masters and optimizer moments.
        runtime: spill what ``prepare``'s disk tier holds (``hf_elixir/optim/_disk_state.py``, [Note: disk
            parameters] in ``hf_elixir/chunk/_disk_pages.py``), in its order: the masters and moments, then the fp32
            gradient shards, then the parameter host shards of trained host-optimizer chunks, each from the last
            chunk; never the host shards of frozen chunks nor rank-local refill copies, which it keeps in host
            memory. ``False`` with ``optimizer_only`` ``False`` (``hf-elixir plan --disk``): every part, fewest bytes
            moved per byte first.

    Raises:
        ValueError: a capacity or a rate that is not positive.
    """

    capacity_bytes: int
    read_bytes_per_s: float
    write_bytes_per_s: float
    optimizer_only: bool = False
    runtime: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"DiskTier(capacity_bytes={self.capacity_bytes}) must be > 0 bytes, e.g. 30e12")
        for name in ("read_bytes_per_s", "write_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"DiskTier({name}={value}) must be a positive rate in bytes/s, e.g. 25e9")


@dataclass(frozen=True)
class DiskSpill:
    """What one configuration keeps on the disk and what it costs (bytes per rank, seconds per step).

    Attributes:
        optimizer_bytes / param_bytes / grad_bytes: fp32 masters and moments / parameter chunks / fp32 gradient
            shards on the disk.
        staging_bytes: the host staging buffer the spill adds.
        read_bytes / write_bytes: read from / written to the disk each step.
        disk_s: the disk's seconds a step, the machine's ranks sharing it.
        step_without_disk_s / compute_s: the configuration's step as priced without the disk, and its device
            compute.
    """

    optimizer_bytes: int
    param_bytes: int
    grad_bytes: int
    staging_bytes: int
    read_bytes: int
    write_bytes: int
    disk_s: float
    step_without_disk_s: float
    compute_s: float

    @property
    def spilled_bytes(self) -> int:
        return self.optimizer_bytes + self.param_bytes + self.grad_bytes

    def hide_tokens(self, tokens_per_step: int) -> int | None:
        """The least tokens per step at which the step covers the disk ([Note: disk tier pricing]), from the
        ``tokens_per_step`` it was priced at; ``None`` where nothing is computed (no tokens hide it)."""
        short = self.disk_s - self.step_without_disk_s
        if short <= 0:
            return tokens_per_step
        if self.compute_s <= 0:
            return None
        return math.ceil(tokens_per_step * (1.0 + short / self.compute_s))

    def step_s(self, tokens: int, tokens_per_step: int) -> float:
        """The step's seconds at ``tokens`` (priced at ``tokens_per_step``): its compute scaled, or the disk."""
        scaled = self.step_without_disk_s + (tokens / tokens_per_step - 1.0) * self.compute_s
        return max(scaled, self.disk_s)


_OPTIM, _PARAM, _GRAD = range(3)


def _spill_units(step: ChunkedStep, knobs: Knobs, onloads: dict[int, int],
                 optimizer_only: bool = False, runtime: bool = False) -> list[tuple[int, int, int, int]]:
    """``(kind, bytes on disk, read, written)`` a step per spillable chunk part, in spill order ([Note: disk tier
    pricing]): optimizer state first, then (unless ``optimizer_only``) parameter chunks and gradient shards by
    fewest bytes moved per byte, or (``runtime``, ``DiskTier.runtime``) as ``prepare``'s disk tier spills."""
    if runtime:
        return _runtime_units(step, knobs, onloads)
    b = DTYPE_BYTES[step.precision]
    held = knobs.resident | knobs.device_shard
    optim, rest = [], []
    for c in range(step.num_chunks):
        s = step.shard_numel(c)
        trained = bool(step.trained_numels[c])
        if trained and c not in knobs.device_optim:
            master = 4 if (c in held or step.precision != "fp32") else 0  # else the host shard is the master
            nbytes = s * (4 * step.optim_states + master)
            if nbytes:
                optim.append((_OPTIM, nbytes, nbytes, nbytes))
            rest.append((_GRAD, 4 * s, 4 * s, 4 * s))
        nbytes = s * b if c not in held else 0
        if knobs.host_copies and step.world_size > 1 and c not in knobs.resident and step.group_size(c) > 1:
            nbytes += step.full_bytes(c)  # the rank-local refill copy (_fixed_memory's host_params)
        if nbytes:
            rest.append((_PARAM, nbytes, nbytes * max(1, onloads.get(c, 0)), nbytes if trained else 0))
    if optimizer_only:
        return optim
    rest.sort(key=lambda u: (u[2] + u[3]) / u[1])
    return optim + rest


def _runtime_units(step: ChunkedStep, knobs: Knobs, onloads: dict[int, int]) -> list[tuple[int, int, int, int]]:
    """:func:`_spill_units` as ``prepare``'s disk tier spills (``DiskTier.runtime``): per kind (masters and moments,
    gradient shards, parameter host shards) the trained host-optimizer chunks from the last one."""
    b = DTYPE_BYTES[step.precision]
    held = knobs.resident | knobs.device_shard
    kinds: dict[int, list] = {_OPTIM: [], _GRAD: [], _PARAM: []}
    for c in reversed(range(step.num_chunks)):
        if not step.trained_numels[c] or c in knobs.device_optim:
            continue
        s = step.shard_numel(c)
        master = 4 if (c in held or step.precision != "fp32") else 0  # else the host shard is the master
        state = s * (4 * step.optim_states + master)
        if state:
            kinds[_OPTIM].append((_OPTIM, state, state, state))
        kinds[_GRAD].append((_GRAD, 4 * s, 4 * s, 4 * s))
        if c not in held:
            kinds[_PARAM].append((_PARAM, s * b, s * b * max(1, onloads.get(c, 0)), s * b))
    return kinds[_OPTIM] + kinds[_GRAD] + kinds[_PARAM]


def spill(step: ChunkedStep, knobs: Knobs, pred, disk: DiskTier, host_limit_bytes: int, ranks_per_host: int,
          activations_on_device: bool = False, host_budget_bytes: int | None = None):
    """``pred`` with the disk tier (the ``Prediction`` with ``step_s``, ``host_bytes`` and ``disk`` set), or ``None``
    when neither host nor disk hold it; ``pred`` itself when the host does ([Note: disk tier pricing]).

    ``host_limit_bytes``: host memory per machine; ``activations_on_device`` / ``host_budget_bytes``: as given to
    ``predict`` (they decide the rank-local host copies it priced).
    """
    def fits(host_bytes: int) -> bool:
        return host_bytes * ranks_per_host <= host_limit_bytes

    if fits(pred.host_bytes):
        return pred
    knobs = resolve_host_copies(step, knobs, activations_on_device, host_budget_bytes)
    taken: list[tuple[int, int, int, int]] = []
    spilled = largest = 0
    for unit in _spill_units(step, knobs, pred.chunk_onloads, disk.optimizer_only, disk.runtime):
        if fits(pred.host_bytes - spilled + _staging_bytes(largest)):
            break
        taken.append(unit)
        spilled += unit[1]
        largest = max(largest, unit[1])
    staging = _staging_bytes(largest)
    if not fits(pred.host_bytes - spilled + staging) or spilled * ranks_per_host > disk.capacity_bytes:
        return None
    by_kind = [sum(u[1] for u in taken if u[0] == kind) for kind in (_OPTIM, _PARAM, _GRAD)]
    read, written = sum(u[2] for u in taken), sum(u[3] for u in taken)
    disk_s = ranks_per_host * (read / disk.read_bytes_per_s + written / disk.write_bytes_per_s)
    info = DiskSpill(optimizer_bytes=by_kind[_OPTIM], param_bytes=by_kind[_PARAM], grad_bytes=by_kind[_GRAD],
                     staging_bytes=staging, read_bytes=read, write_bytes=written, disk_s=disk_s,
                     step_without_disk_s=pred.step_s, compute_s=pred.compute_s)
    return replace(pred, step_s=max(pred.step_s, disk_s), host_bytes=pred.host_bytes - spilled + staging, disk=info)


def least_host_bytes(step: ChunkedStep, knobs: Knobs, pred, disk: DiskTier | None, ranks_per_host: int,
                     activations_on_device: bool = False, host_budget_bytes: int | None = None) -> int:
    """The least host bytes per rank ``pred`` needs: all of them without a disk; with one, what stays after every
    spillable chunk that the disk holds went there, plus the staging ([Note: disk tier pricing])."""
    if disk is None:
        return pred.host_bytes
    knobs = resolve_host_copies(step, knobs, activations_on_device, host_budget_bytes)
    spilled = largest = 0
    for _, nbytes, *_ in _spill_units(step, knobs, pred.chunk_onloads, disk.optimizer_only, disk.runtime):
        if (spilled + nbytes) * ranks_per_host > disk.capacity_bytes:
            break
        spilled += nbytes
        largest = max(largest, nbytes)
    return pred.host_bytes - spilled + _staging_bytes(largest)


def fit_host(candidates: list, step: ChunkedStep, host_limit_bytes: int, ranks_per_host: int,
             disk: DiskTier | None, activations_on_device: bool = False,
             host_budget_bytes: int | None = None) -> tuple[list, int, float]:
    """The search's host filter: ``(kept, dropped count, least host bytes per rank of a dropped one)``; each kept
    candidate's prediction is its :func:`spill` where a ``disk`` takes what the host does not hold."""
    kept, least = [], math.inf
    for cand in candidates:
        pred = cand.prediction
        if disk is not None:
            pred = spill(step, cand.knobs, pred, disk, host_limit_bytes, ranks_per_host, activations_on_device,
                         host_budget_bytes)
        elif pred.host_bytes * ranks_per_host > host_limit_bytes:
            pred = None
        if pred is None:
            least = min(least, least_host_bytes(step, cand.knobs, cand.prediction, disk, ranks_per_host,
                                                activations_on_device, host_budget_bytes))
        else:
            kept.append(cand if pred is cand.prediction else replace(cand, prediction=pred))
    return kept, len(candidates) - len(kept), least


def config_disk_tier(config, hardware, ranks_per_host: int) -> DiskTier | None:
    """The disk tier ``prepare``'s search prices for ``config`` (``None`` without ``ElixirConfig.offload_dir``): its
    ``disk_budget_bytes`` a rank (default: the free space of the folder's file system, shared by the machine's
    ranks), at the rates ``hf-elixir probe`` measured on this machine (``hardware.disk_*``), else
    :data:`DEFAULT_DISK_BYTES_PER_S`. What spills is what ``prepare``'s disk tier spills (``runtime``): a plan must
    not count on the disk holding what the runtime keeps in host memory."""
    folder = getattr(config, "offload_dir", None)
    if folder is None:
        return None
    budget = getattr(config, "disk_budget_bytes", None)
    if budget is not None:
        capacity = int(budget) * ranks_per_host
    else:
        import shutil  # noqa: PLC0415

        try:
            capacity = shutil.disk_usage(folder).free
        except OSError:
            return None  # prepare's own checks name an unusable offload_dir
    read = getattr(hardware, "disk_read_bytes_per_s", None) or DEFAULT_DISK_BYTES_PER_S
    write = getattr(hardware, "disk_write_bytes_per_s", None) or DEFAULT_DISK_BYTES_PER_S
    return DiskTier(capacity_bytes=max(1, capacity), read_bytes_per_s=read, write_bytes_per_s=write, runtime=True)


def disk_reason(pred, ranks_per_host: int) -> str | None:
    """The plan's reason for its disk tier (``None`` where the host holds everything)."""
    info = getattr(pred, "disk", None)
    if info is None:
        return None
    return (f"disk tier: {info.spilled_bytes * ranks_per_host} bytes a machine on the disk (masters and moments "
            f"{info.optimizer_bytes}, parameter chunks {info.param_bytes}, gradients {info.grad_bytes} bytes a rank), "
            f"{info.read_bytes + info.write_bytes} bytes moved a rank a step: {info.disk_s:.4g} s of disk against "
            f"{info.step_without_disk_s:.4g} s of step ([Note: disk tier pricing])")
