"""Cost model: predicted step time and device/host memory of one configuration.

[Note: memory accounting] (per rank; ``b`` = compute-dtype bytes, ``n_c`` = chunk ``c``'s numel,
``s_c = n_c / world_size`` its shard numel; this is what the chunk manager's pool must count for the
prediction to hold):

* resident chunk: ``n_c * b`` (its shard is a slice of the unsharded buffer, not counted again);
* non-resident chunk whose shard stays on the device (``device_shard_chunks``): ``s_c * b``;
* cache blocks: ``cache_blocks * chunk_size_numel * b`` (non-resident chunks borrow them while gathered);
* gradient buffers: ``chunk_size_numel * 4`` (fp32) per chunk receiving gradients at the same time;
  the peak count is read from the profiled trace (first backward use to last gradient ready);
* device optimizer state: ``s_c * 16`` (fp32 master 4 + Adam moments 4 + 4 + fp32 grad shard 4) for
  bf16/fp16; ``s_c * 12`` for fp32 (the master *is* the compute shard);
* activations are outside the pool; they count toward the device only when ``activations_on_device``
  (a real GPU), scaled from the profiled dtype to the compute dtype.

Optimizer-state chunks on the device must be resident or device-shard chunks. With ``world_size == 1``
a shard is the whole chunk, so only resident chunks keep parameters on the device.

[Note: time model]: one compute stream (per-event compute measured by the profiler, or FLOPs divided by
the measured matmul throughput), one host->device copy stream, one collective stream and one
device->host stream. A chunk that misses in the cache (Belady's MIN over the non-resident chunks, with
``cache_blocks - prefetch_depth`` blocks) costs an onload of its shard (unless the shard is on the
device) and, with ``world_size > 1``, an all-gather; with prefetch depth ``p`` the copy may start when
the compute reaches the access ``p`` events earlier. Each trained chunk's gradient is reduce-scattered
when its last gradient is ready and, if its optimizer state is on the host, its fp32 gradient shard is
copied to the host. The optimizer step follows the backward: host and device updates at the measured
AdamW throughputs, then the updated host shards of device-held chunks are copied up and resident chunks
re-gathered. Without overlap (``hardware.can_overlap`` is ``False``: the CPU simulated pool) all of it
is serial.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_elixir.chunk import pack_chunks
from hf_elixir.profiler import HardwareProfile, StepProfile
from hf_elixir.search._belady import belady_schedule
from hf_elixir.search._chunk_size import chunk_groups

__all__ = ["ChunkedStep", "Knobs", "Prediction", "build_chunked_step", "predict"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Knobs:
    """One point of the search space (chunk ids are positions in the packing)."""

    resident: frozenset[int] = frozenset()
    device_shard: frozenset[int] = frozenset()
    device_optim: frozenset[int] = frozenset()
    cache_blocks: int = 0
    prefetch_depth: int = 0


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
    timeline: list[tuple[float, int, str]] = field(default_factory=list)  # (time s, device bytes, label)


@dataclass
class ChunkedStep:
    """The profiled step seen at one chunk size (everything the cost model needs, precomputed)."""

    chunk_size_numel: int
    world_size: int
    precision: str
    chunk_numels: list[int]
    trained_numels: list[int]
    groups: list[tuple[int, ...]]  # per event, chunk ids needed at once
    event_compute_s: list[float]
    event_phase: list[str]
    grad_ready: dict[int, int]  # chunk -> event index after which its gradient is complete
    grad_peak_chunks: int
    accesses: list[int]  # per chunk, how many events use it
    activation_bytes: int
    activation_checkpointing: bool
    _misses: dict = field(default_factory=dict, repr=False)

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_numels)

    def misses(self, resident: frozenset[int], capacity: int) -> list[list[int]] | None:
        """Per event, chunks onloaded (Belady) when ``resident`` stay and ``capacity`` blocks cache the rest;
        ``None`` if the cache cannot serve one event."""
        key = (resident, capacity)
        if key not in self._misses:
            groups = [tuple(c for c in g if c not in resident) for g in self.groups]
            need = max((len(g) for g in groups), default=0)
            if need == 0:
                self._misses[key] = [[] for _ in groups]
            elif capacity < need:
                self._misses[key] = None
            else:
                self._misses[key] = belady_schedule(groups, capacity)
        return self._misses[key]

    def min_cache_blocks(self, resident: frozenset[int]) -> int:
        return max((sum(1 for c in g if c not in resident) for g in self.groups), default=0)


def _checkpointed_events(profile: StepProfile) -> list:
    """Insert each block's forward accesses again before its backward (what HF gradient checkpointing
    re-runs), for the outermost repeated blocks."""
    blocks = sorted(profile.block_activation_bytes)
    outer = [b for b in blocks if not any(b != o and b.startswith(o + ".") for o in blocks)]

    def block_of(module: str) -> str | None:
        for b in outer:
            if module == b or module.startswith(b + "."):
                return b
        return None

    fwd_by_block: dict[str, list] = {}
    for e in profile.events:
        if e.phase == "fwd":
            b = block_of(e.module)
            if b is not None:
                fwd_by_block.setdefault(b, []).append(e)
    out = []
    recomputed: set[str] = set()
    for e in profile.events:
        b = block_of(e.module) if e.phase == "bwd" else None
        if b is not None and b not in recomputed:
            recomputed.add(b)
            out += [type(x)(phase="bwd", module=x.module, params=x.params, compute_s=x.compute_s, flops=x.flops)
                    for x in fwd_by_block.get(b, [])]
        out.append(e)
    return out


def activation_bytes(profile: StepProfile, precision: str, checkpointing: bool) -> int:
    """Activation peak (bytes) at ``precision``; with checkpointing only block inputs stay saved, plus one
    block's activations while it is recomputed."""
    scale = DTYPE_BYTES[precision] / max(1, profile.activation_dtype_bytes)
    peak = profile.activation_peak_bytes
    if checkpointing and profile.block_activation_bytes:
        blocks = sorted(profile.block_activation_bytes)
        outer = [b for b in blocks if not any(b != o and b.startswith(o + ".") for o in blocks)]
        inside = sum(profile.block_activation_bytes[b] for b in outer)
        kept = sum(profile.block_input_bytes.get(b, 0) for b in outer)
        peak = peak - inside + kept + max(profile.block_activation_bytes[b] for b in outer)
    return int(peak * scale)


def build_chunked_step(profile: StepProfile, chunk_size_numel: int, *, world_size: int, precision: str,
                       hardware: HardwareProfile, activation_checkpointing: bool = False) -> ChunkedStep:
    """Pack the profile's parameters at ``chunk_size_numel`` and precompute the chunk trace."""
    layout = pack_chunks(profile.param_numels, chunk_size_numel, world_size)
    events = _checkpointed_events(profile) if activation_checkpointing else list(profile.events)
    groups = chunk_groups(layout, [e.params for e in events])
    kept = [e for e in events if e.params]
    use_measured = all(e.compute_s is not None for e in kept) and profile.device == hardware.device_kind
    flops_rate = hardware.device_flops_per_s or 1e12
    compute = [(e.compute_s if use_measured else e.flops / flops_rate) for e in kept]
    trained = [sum(profile.param_numels[i] for i in members if profile.param_requires_grad[i])
               for members in layout.members]
    # map profile event indices to kept-event indices (grad readiness); with checkpointing the
    # original backward events moved, so recompute readiness from the last backward use
    grad_ready: dict[int, int] = {}
    first_bwd: dict[int, int] = {}
    for k, (e, g) in enumerate(zip(kept, groups)):
        if e.phase == "bwd":
            for c in g:
                first_bwd.setdefault(c, k)
                if trained[c]:
                    grad_ready[c] = k
    for c in range(layout.num_chunks):
        if trained[c] and c not in grad_ready:
            grad_ready[c] = len(kept) - 1  # unused this step: reduced (zeros) at the end
            first_bwd.setdefault(c, len(kept) - 1)
    peak = 0
    for k in range(len(kept)):
        live = sum(1 for c in grad_ready if first_bwd[c] <= k <= grad_ready[c])
        peak = max(peak, live)
    accesses = [0] * layout.num_chunks
    for g in groups:
        for c in g:
            accesses[c] += 1
    return ChunkedStep(
        chunk_size_numel=chunk_size_numel, world_size=world_size, precision=precision,
        chunk_numels=list(layout.chunk_numels), trained_numels=trained, groups=groups,
        event_compute_s=compute, event_phase=[e.phase for e in kept], grad_ready=grad_ready,
        grad_peak_chunks=peak, accesses=accesses,
        activation_bytes=activation_bytes(profile, precision, activation_checkpointing),
        activation_checkpointing=activation_checkpointing,
    )


def optim_bytes_per_numel(precision: str) -> int:
    return 12 if precision == "fp32" else 16


def memory(step: ChunkedStep, knobs: Knobs, activations_on_device: bool) -> tuple[int, int, dict[str, int]]:
    """(device model-data bytes, host bytes, breakdown) per rank; see [Note: memory accounting]."""
    b = DTYPE_BYTES[step.precision]
    ws = step.world_size
    k_opt = optim_bytes_per_numel(step.precision)
    resident = sum(step.chunk_numels[c] for c in knobs.resident) * b
    shards = sum(step.chunk_numels[c] // ws for c in knobs.device_shard - knobs.resident) * b
    cache = knobs.cache_blocks * step.chunk_size_numel * b
    grads = step.grad_peak_chunks * step.chunk_size_numel * 4
    optim = sum(step.trained_numels[c] and step.chunk_numels[c] // ws for c in knobs.device_optim) * k_opt
    breakdown = {"resident_chunks": resident, "device_shards": shards, "cache_blocks": cache,
                 "grad_buffers": grads, "device_optimizer": optim,
                 "activations": step.activation_bytes if activations_on_device else 0}
    held = knobs.resident | knobs.device_shard
    host_params = sum(step.chunk_numels[c] // ws for c in range(step.num_chunks) if c not in held) * b
    host_optim = sum(step.chunk_numels[c] // ws for c in range(step.num_chunks)
                     if c not in knobs.device_optim and step.trained_numels[c]) * 16
    model = resident + shards + cache + grads + optim
    return model, host_params + host_optim, breakdown


def predict(step: ChunkedStep, knobs: Knobs, hardware: HardwareProfile, *,
            activations_on_device: bool = False, timeline: bool = False) -> Prediction | None:
    """Predicted time and memory of ``knobs``; ``None`` if the cache cannot serve the step.

    See [Note: time model] and [Note: memory accounting] in this module's docstring.
    """
    ws = step.world_size
    b = DTYPE_BYTES[step.precision]
    capacity = knobs.cache_blocks - knobs.prefetch_depth
    misses = step.misses(knobs.resident, capacity)
    if misses is None:
        return None
    h2d_rate = hardware.h2d_bytes_per_s or 1e10
    d2h_rate = hardware.d2h_bytes_per_s or 1e10
    ag_rate = hardware.allgather_bytes_per_s or h2d_rate
    rs_rate = hardware.reduce_scatter_bytes_per_s or d2h_rate
    overlap = hardware.can_overlap
    model_bytes, host_bytes, breakdown = memory(step, knobs, activations_on_device)
    held = knobs.resident | knobs.device_shard
    grad_at: dict[int, list[int]] = {}
    for c, k in step.grad_ready.items():
        grad_at.setdefault(k, []).append(c)
    t_compute = t_h2d = t_comm = t_d2h = 0.0
    starts: list[float] = []
    h2d_bytes = d2h_bytes = ag_bytes = rs_bytes = 0
    onloads = 0
    points: list[tuple[float, int, str]] = []
    base = model_bytes - knobs.cache_blocks * step.chunk_size_numel * b - breakdown["grad_buffers"]
    cached = 0
    grads_live = 0
    for k, loaded in enumerate(misses):
        issue = starts[k - knobs.prefetch_depth] if (overlap and knobs.prefetch_depth and k >= knobs.prefetch_depth) else t_compute
        ready = t_compute
        for c in loaded:
            onloads += 1
            copy_s = comm_s = 0.0
            if c not in held:
                size = step.chunk_numels[c] // ws * b
                h2d_bytes += size
                copy_s = size / h2d_rate
            if ws > 1:
                size = step.chunk_numels[c] * b
                ag_bytes += size
                comm_s = size / ag_rate
            if overlap:
                t_h2d = max(t_h2d, issue) + copy_s
                t_comm = max(t_comm, t_h2d) + comm_s
                ready = max(ready, t_comm)
            else:
                t_compute += copy_s + comm_s
                ready = t_compute
            cached = min(knobs.cache_blocks, cached + 1)
        start = max(t_compute, ready)
        starts.append(start)
        if step.event_phase[k] == "bwd" and any(c in step.grad_ready for c in step.groups[k]):
            grads_live = min(step.grad_peak_chunks, max(grads_live, 1))
        t_compute = start + step.event_compute_s[k]
        for c in grad_at.get(k, []):
            rs_s = d2h_s = 0.0
            if ws > 1:
                rs_bytes += step.chunk_numels[c] * 4
                rs_s = step.chunk_numels[c] * 4 / rs_rate
            if c not in knobs.device_optim:
                size = step.chunk_numels[c] // ws * 4
                d2h_bytes += size
                d2h_s = size / d2h_rate
            if overlap:
                t_comm = max(t_comm, t_compute) + rs_s
                t_d2h = max(t_d2h, t_comm) + d2h_s
            else:
                t_compute += rs_s + d2h_s
        if timeline:
            used = base + cached * step.chunk_size_numel * b + grads_live * step.chunk_size_numel * 4
            points.append((t_compute, used, f"{step.event_phase[k]}:{len(loaded)} onloads"))
    fwd_bwd = max(t_compute, t_comm, t_d2h)
    compute_s = sum(step.event_compute_s)
    host_numel = sum(step.trained_numels[c] and step.chunk_numels[c] // ws
                     for c in range(step.num_chunks) if c not in knobs.device_optim)
    dev_numel = sum(step.trained_numels[c] and step.chunk_numels[c] // ws for c in knobs.device_optim)
    host_s = host_numel / (hardware.host_adam_numel_per_s or 1e9)
    dev_s = dev_numel / (hardware.device_adam_numel_per_s or 1e9)
    up_bytes = sum(step.chunk_numels[c] // ws * b for c in held
                   if c not in knobs.device_optim and step.trained_numels[c])
    regather = sum(step.chunk_numels[c] * b for c in knobs.resident if step.trained_numels[c]) if ws > 1 else 0
    h2d_bytes += up_bytes
    ag_bytes += regather
    tail_s = up_bytes / h2d_rate + regather / ag_rate
    optim_s = max(host_s + tail_s, dev_s) if overlap else host_s + dev_s + tail_s
    device_peak = model_bytes + (step.activation_bytes if activations_on_device else 0)
    if timeline:
        points.append((fwd_bwd + optim_s, base, "optimizer step"))
    return Prediction(
        step_s=fwd_bwd + optim_s, forward_backward_s=fwd_bwd, optimizer_s=optim_s, compute_s=compute_s,
        onloads=onloads, h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes, allgather_bytes=ag_bytes,
        reduce_scatter_bytes=rs_bytes, device_model_bytes=model_bytes, device_peak_bytes=device_peak,
        host_bytes=host_bytes, breakdown=breakdown, timeline=points,
    )
