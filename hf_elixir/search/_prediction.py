"""What the cost model predicts for one configuration (:class:`Prediction`, built by
:func:`~hf_elixir.search._cost.predict`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Prediction"]


@dataclass
class Prediction:
    """Cost-model output for one configuration (seconds and bytes, per rank)."""

    step_s: float
    forward_backward_s: float
    optimizer_s: float
    compute_s: float
    onloads: int
    h2d_bytes: int
    d2h_bytes: int
    allgather_bytes: int
    reduce_scatter_bytes: int
    device_model_bytes: int
    device_peak_bytes: int
    host_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    # the host lane's rollback snapshots, on top of ``host_bytes``: taken only while they fit the host
    # budget given to :func:`predict` (``ElixirConfig.host_memory_budget_bytes``), so never what rules a plan out
    host_snapshot_bytes: int = 0
    timeline: list[tuple[float, int, str]] = field(default_factory=list)  # (time s, device bytes, label)
    chunk_onloads: dict[int, int] = field(default_factory=dict)
    cache_blocks: int = 0
    # all-gathers priced as issued ahead of their event, in forward and in backward ([Note: overlap])
    gathers_ahead: dict[str, int] = field(default_factory=dict)
    # the device bytes at the peak by kind (resident chunks, device shards, device optimizer states, refresh staging,
    # cached chunks, gradient buffers and reduce outputs, onload staging, gradient buffers kept for reuse off CUDA,
    # activations): they sum to ``device_peak_bytes``; ``breakdown`` gives each kind's own peak instead
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    alltoall_bytes: int = 0  # sent by each rank in the step's MoE all-to-alls ([Note: expert parallel pricing])
    # sent by each rank in the split layers' all-reduces / all-gathers ([Note: tensor parallel pricing])
    tensor_parallel_bytes: int = 0
    disk: object = None  # the disk tier's DiskSpill, where it holds what the host does not ([Note: disk tier pricing])
