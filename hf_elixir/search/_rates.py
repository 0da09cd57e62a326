"""Compute and transfer rates of the cost model (``_cost.py``, [Note: time model]): each event's compute
seconds, the copy rates within the host and within the device, and the refresh of compute copies whose
master lives elsewhere (uploads, their cast on the host or on the device, and when they are done).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_elixir.profiler import HardwareProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES
from hf_elixir.search._event_seconds import event_seconds

if TYPE_CHECKING:
    from hf_elixir.search._chunked_step import ChunkedStep, Knobs

__all__ = ["SAME_PASS_CAST_FRACTION", "casts_on_device", "event_seconds", "refresh_upload_bytes_per_numel"]


def _host_copy_rate(hardware: HardwareProfile) -> float:
    """Bytes/s of a copy within host memory (the host lane's snapshots): the probe's copy rate. Off CUDA that
    is a memcpy between two host buffers; on CUDA the pinned host<->device rate stands in for it (the probe
    does not time a host memcpy there; PCIe 4/5 and one thread's memcpy are of the same order)."""
    return hardware.h2d_bytes_per_s or 1e10


def _local_copy_rate(hardware: HardwareProfile) -> float:
    """Bytes/s of a copy within the device (gradient into its buffer, a cast refreshing a compute copy).
    Off CUDA the "device" is host memory: the measured copy rate. On CUDA the copy is bound by HBM, which
    the fused AdamW rate measures: 28 bytes of traffic per element (see ``profiler/_gpu_presets.py``), a
    copy 2 bytes of traffic per byte copied."""
    if hardware.device_kind == "cuda" and hardware.device_adam_numel_per_s:
        return hardware.device_adam_numel_per_s * 28 / 2
    return hardware.h2d_bytes_per_s or 1e10


def _uploaded_chunks(step: ChunkedStep, knobs: Knobs) -> list[int]:
    """Trained chunks whose refresh is an upload: shard on the device, optimizer state (master) on the host."""
    held = knobs.resident | knobs.device_shard
    return [c for c in range(step.num_chunks) if step.trained_numels[c] and c in held and c not in knobs.device_optim]


def casts_on_device(step: ChunkedStep, knobs: Knobs) -> bool:
    """The uploads are cast on the device ([Note: refresh cast] in ``optim/_refresh.py``): ``refresh_cast`` is
    ``"device"`` and the compute dtype is narrower than the fp32 master."""
    return knobs.refresh_cast == "device" and step.precision != "fp32"


def refresh_upload_bytes_per_numel(step: ChunkedStep, knobs: Knobs) -> int:
    """PCIe bytes per element of an upload refreshing a compute copy: the fp32 master's 4 when cast on the
    device, else the compute dtype's (cast on the host, or fp32 with nothing to cast)."""
    return 4 if casts_on_device(step, knobs) else DTYPE_BYTES[step.precision]


def _device_cast_s(numel: int, step: ChunkedStep, hardware: HardwareProfile) -> float:
    """Seconds of the device cast of ``numel`` uploaded fp32 elements out of the staging buffer into the compute
    copy: ``4 + b`` bytes of memory traffic per element at twice the local copy rate (:func:`_local_copy_rate`
    counts 2 bytes of traffic per byte copied)."""
    return numel * (4 + DTYPE_BYTES[step.precision]) / (2 * _local_copy_rate(hardware))


#: [Note: same-pass host step] (``optim/_same_pass.py``): the runtime steps an AdamW host chunk with a staging buffer
#: block by block and casts each block into the staging buffer while it is in cache. What the cast then adds, as a
#: fraction of the AdamW step of the same elements, measured on this project's CPU (AMD EPYC, 32 MiB L3, 1 thread,
#: a 50.4 M element chunk shaped like an OPT-1.3B layer, blocks of 1 Mi elements, min of 9 interleaved rounds, load
#: average 6.3-7.3 on 2 cores, 2026-12-01 05:43 UTC): ``PYTHONPATH=$PWD flock /tmp/bench.lock python
#: benchmarks/host_adam.py --rounds 9 --stat min --blocks 524288,1048576,2097152,4194304 --diagnose``: step 33.3 ms,
#: same pass 40.6 ms (0.22). The same run measured the separate cast (step, then ``staging.copy_(master)`` over the
#: whole chunk, the path before) at 0.39 of the step, more than the 6 / 28 = 0.21 the traffic ratio had priced it at.
SAME_PASS_CAST_FRACTION = 0.22


def _host_cast_s(numel: int, hardware: HardwareProfile) -> float:
    """Seconds of the host cast fp32 master -> compute-dtype staging buffer of ``numel`` elements: done in the same
    pass as the host AdamW update ([Note: same-pass host step] in ``optim/_same_pass.py``), so priced as the measured
    :data:`SAME_PASS_CAST_FRACTION` of that update's time at the host AdamW rate."""
    return numel / (hardware.host_adam_numel_per_s or 1e9) * SAME_PASS_CAST_FRACTION


def _early_refresh(step: ChunkedStep, hardware: HardwareProfile) -> bool:
    """Whether the host lane's uploads go out during backward ([Note: early refresh] in ``optim/_refresh.py``):
    beside a CUDA compute stream, and not under fp16 loss scaling."""
    return hardware.can_overlap and step.precision != "fp16"


def _refresh_times(step: ChunkedStep, upload_s: dict[int, float]) -> dict[int, float]:
    """When each upload is done, seconds from the start of the step: issued back to back on the copy stream when
    the previous step ends, in the order the forward first uses the chunks (``ChunkManager.next_use_order``)."""
    first = step.first_access
    done, t = {}, 0.0
    for c in sorted(upload_s, key=lambda c: (first.get(c, len(step.groups)), c)):
        t += upload_s[c]
        done[c] = t
    return done
