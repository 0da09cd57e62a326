"""Cost model: predicted step time and device/host memory of one configuration (:func:`predict`), by
replaying the profiled access order through the same rules the chunk manager (``hf_elixir/chunk``) follows.

Its parts: the step at one chunk size and the knobs priced on it (``_chunked_step.py``, [Note: replicated
data parallelism]), the bytes a configuration holds (``_memory_cost.py``, [Note: memory accounting]), the
compute and copy rates and the refresh of compute copies (``_rates.py``), and the activations per block
(``_activation_cost.py``, [Note: activation policy]). This module keeps the replay and its notes.

[Note: time model] The compute of each profiled event (rescaled from the traced to the untraced
step time), plus, all measured by :func:`~hf_elixir.profiler.probe_hardware`: hf_elixir's hook cost per
module call (``hook_event_s``), per onload a fixed cost (``onload_fixed_s``) and the bytes at the
copy/all-gather bandwidth, per trained chunk its gradient copies and reduce-scatter, then the optimizer
step (per parameter view ``optim_tensor_s`` plus elements at the host/device AdamW rate) and the
copies refreshing compute copies whose master lives elsewhere (copies within a CUDA device at its memory
rate, :func:`_local_copy_rate`; across PCIe at the copy bandwidth, overlapping the next forward on CUDA). Where copies overlap compute
(``hardware.can_overlap``, CUDA) a local onload may start ``prefetch_depth`` events early on its own stream;
with several ranks an all-gather may, on any device; everything else on CPU is serial. See
[Note: overlap] for exactly what overlaps.

[Note: overlap] The model overlaps exactly what the runtime overlaps:

* a **local** onload (world size 1: the host shard; more ranks: the rank-local refill copy of an evicted
  gathered chunk) is prefetched ``prefetch_depth`` events ahead on the manager's copy stream
  (``ChunkManager._prefetch`` -> ``Chunk.unshard(side_stream=...)``), on CUDA only (``hardware.can_overlap``);
* a **forward all-gather** (world size > 1, ``prefetch_depth > 0``) is issued ``prefetch_depth`` events ahead
  ([Note: gather prefetch] in ``hf_elixir/chunk/_prefetch.py``), on CUDA and off it (gloo runs async
  collectives on its own threads), so it overlaps the compute of the events before its own. Gathers run one
  after another on the group (``t_gather``); the event waits for its own. On CUDA the staging onload rides
  the side stream too; off CUDA it and the fixed cost stay on the compute thread. With
  ``activations_on_device`` (the whole-device budget, whose activation charges are rank-local) the runtime
  issues them ahead in training only, where every offloadable chunk keeps a rank-local host copy (which it
  forces then: :func:`host_copies_forced`): the ranks agree at each optimizer step on which chunks each of
  them had room for in the previous step ([Note: agreed gathers ahead] in ``hf_elixir/chunk/_agreed_gathers.py``), so
  from the third step on (the steady state priced here) the forward gathers run ahead as with a model-data
  pool, the same gathers and evictions (only the timing changes). Like the model-data case, this does not
  check the runtime's room rule (a rank votes no where the gather would evict a chunk used before it), so at
  the tightest budgets the runtime may keep a gather in the hook that this prices as ahead. Not where the
  runtime keeps gathers in the hooks: a model with subtree units (``ChunkedStep.gather_prefetch``, MoE
  experts), an inference step (``ChunkedStep.forward_only``) under ``activations_on_device``, nor for the
  first ``prefetch_depth`` events (nothing runs ahead of them);
* a **backward all-gather** (the re-gather of an evicted chunk without a host copy) is issued ahead the same
  way, with a model-data pool only (under ``activations_on_device`` a backward refill is a local onload of the
  forced host copy), where the runtime finds room for it without evicting a chunk the step still uses ([Note:
  backward gather prefetch] in ``hf_elixir/chunk/manager.py``): priced as ahead when, at its event, the free
  pool plus the cached trained chunks with no later use cover it. The runtime decides ``prefetch_depth`` events
  earlier and also reserves the gradient buffers charged in between, so at the tightest budgets it may keep a
  gather in the hook that this prices as ahead. Other backward gathers run inside the pre-backward hook and the compute
  waits for them (and for gathers queued before them);
* the reduce-scatter (or replicated all-reduce) of a chunk whose optimizer state is on the device runs on the
  manager's reduce stream, overlapping the rest of backward ([Note: reduce overlap] in ``chunk/_chunk_grads.py``);
  a host-optimizer chunk's reduce stays on the compute stream, its device->host gradient copy runs on the
  offload stream on CUDA ([Note: gradient offload] in ``chunk/_grad_shards.py``; on CPU it is a plain copy on the
  compute timeline);
* with ``overlap_host_optimizer`` (the runtime's default on CUDA; ``None`` resolves as
  :func:`hf_elixir.optim._overlap.speculates` does, [Note: lane off the CPU device]) each host-optimizer chunk
  is stepped (after a snapshot where the optimizer has no inverse update) on the host lane's one worker thread
  as soon as its gradient is on the host
  ([Note: host lane] in ``optim/_overlap.py``): a serial lane timeline ``t_lane`` beside backward when the
  compute is not on the host (``hardware.can_overlap``, CUDA), each chunk paying its snapshot copy (at the
  host copy rate, :func:`_host_copy_rate`) and its update; the step then waits only for what the lane has
  left, ``max(0, t_lane - end of backward)``. Off CUDA (``overlap_host_optimizer=True`` on CPU) the "device"
  is the host's own cores, which the lane's thread shares with the compute: priced as the serial host step
  plus the snapshot copies. Rollbacks (clipping triggered, fp16 overflow) are priced as rare, i.e. not at all.
  Snapshots are taken only where ``ChunkedStep.snapshot_rollback`` (AMSGrad, optimizers other than Adam/AdamW;
  Adam/AdamW roll back by the inverse update and copy nothing, [Note: inverse rollback] in
  ``optim/_inverse_adam.py``): ``(1 + k) * 4`` bytes per host shard element, fp16 ``(2 + k) * 4``, taken in
  reduce order while they fit the host budget, as the runtime does; ``Prediction.host_snapshot_bytes`` reports them
  apart from ``host_bytes``. Without the lane the optimizer step starts after backward ends and updates the
  host shards (``ElixirOptimizer._inner_step``);
* the device shards (``_fused_step``) follow the host part: ``host + device``, never ``max(host, device)``;
* the refresh of a compute copy whose shard is on the device and whose master is on the host is an upload
  ([Note: overlapped refresh] in ``optim/_refresh.py``): the master is cast on the host into a staging buffer
  of the compute dtype (in the same pass as the chunk's AdamW update, :func:`_host_cast_s`, on the lane's timeline
  with the chunk's step when the lane stepped it, else in the step), and ``shard_numel * b`` bytes go over PCIe. On
  CUDA the uploads run back to back on the copy stream from the start of the step (the previous step ended
  with them), in the order the forward first uses the chunks; each event waits for its own chunks' uploads,
  the first backward event for all of them, and onloads and gathers prefetched on the copy stream queue behind
  them. The step is priced in steady state: every step refreshes what the next forward waits for. Off CUDA
  the copy is done at the chunk's first access on the compute thread: priced in the serial step as before.
  (With several ranks a resident chunk's all-gather after the refresh stays priced in the step, as before.)
  With ``Knobs.refresh_cast="device"`` ([Note: refresh cast] in ``optim/_refresh.py``, bf16/fp16 only) no host
  cast is priced and no host staging buffer counted; the upload moves ``4 * shard_numel`` bytes and casts on the
  device on the same copy stream (:func:`_device_cast_s`), and the fixed device bytes gain the one fp32 staging
  buffer the runtime charges (:func:`refresh_staging_bytes`).
  [Note: early refresh pricing] With the host lane on CUDA (not fp16: [Note: early refresh] in
  ``optim/optimizer.py``) a chunk the lane stepped is uploaded during backward instead: on the copy stream at the
  first backward event after the lane finished it (:func:`_early_refresh`) and after the chunk's last access,
  queued with the backward's onloads. In steady state the next forward then waits for those not done when the
  step ends and for the lane's last chunks, which the step uploads in first-use order behind them: predict runs
  a second pass with those waits (``_refresh_prev``). The device cast then costs the lane nothing and its
  doubled bytes ride the host-to-device direction backward leaves idle.

[Note: activation policy] in ``_activation_cost.py``: what keep / recompute / offload per block cost in
memory and time; :func:`predict` adds the offload copies it lists (``ChunkedStep.offload_after`` /
``offload_before``).

[Note: forward-only pricing] An inference step (a :class:`StepProfile` with ``forward_only``, [Note: forward-only
step] in ``hf_elixir/profiler/_step.py``; ``ChunkedStep.forward_only``) has forward events only and trains no
chunk, so the rules above leave no gradient buffer, reduce, optimizer state (device or host), refresh or
rollback snapshot to price, and its activations are the forward's transient alone. The runtime of a model
prepared without an optimizer differs from a training step in two ways the model follows:

* no optimizer step ends a step: each top-level forward is one ([Note: forward steps] in
  ``hf_elixir/chunk/manager.py``). The first forward after ``prepare`` has no previous order: the manager evicts the
  least recently used unpinned chunk (``ChunkManager._victim`` without ``prev_trace``) and prefetches nothing. Every
  later forward evicts by Belady over the forward before it (ties, chunks that forward does not use again, to the
  least recently used: ``ChunkManager._belady_key``) and prefetches ``prefetch_depth`` chunks ahead of it, local
  onloads on CUDA and all-gathers at several ranks, as a training forward does ([Note: overlap]; not the all-gathers
  under ``activations_on_device``: without an optimizer step the ranks have no point at which to agree on them, so
  they stay in the hooks). :func:`predict` replays the first forward with recency and no prefetch, the later ones with
  Belady over the profiled order (next uses by event and place in it, the manager's trace positions) and prefetch. A
  forward all-gather (after the forward's first event) is priced as ahead unless the room for it is made by evicting a
  chunk of the event before it: the runtime issues it at the latest at that event's access, when that chunk is pinned
  and its gather ahead may not evict it ([Note: Belady-consistent gather ahead]); in a forward whose pool is full the
  chunk Belady evicts is often the one just used (not used again in the forward), and the gather then stays in the
  hook. The count is the runtime's (``Prediction.gathers_ahead``; its timing, issued ``prefetch_depth`` events ahead,
  is the approximation training's gathers get too). No dead chunk is resharded early (there is no backward);
* nothing makes a cached chunk stale between forwards (no optimizer updates its shard), so a forward starts
  with what the previous one left cached. :func:`predict` replays the forward from an empty cache, then again
  from what each replay left (at most :data:`FORWARD_PASSES` replays) until a replay starts from the cache the
  one before it started from (or the last), and prices that replay: the steady state of repeated forwards
  (evaluation batches of one shape, ``generate``'s steps with a fixed-size input). The first forward after
  ``prepare`` may onload more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_elixir.profiler import HardwareProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES, activation_bytes, profile_blocks, resolve_policy
from hf_elixir.search._chunked_step import _INF, ChunkedStep, Knobs, build_chunked_step
from hf_elixir.search._memory_cost import _backward_room, _kept_peak, fixed_memory, resolve_host_copies
from hf_elixir.search._rates import (_device_cast_s, _early_refresh, _host_cast_s, _host_copy_rate, _local_copy_rate,
                                     _refresh_times, _uploaded_chunks, casts_on_device, refresh_upload_bytes_per_numel)
# importable from here, as before the cost model was split: the search, the CLI, tests and benchmarks use them
from hf_elixir.search._memory_cost import host_copies_forced, optim_bytes_per_numel  # noqa: F401
from hf_elixir.search._memory_cost import refresh_staging_bytes  # noqa: F401
from hf_elixir.search._rates import SAME_PASS_CAST_FRACTION  # noqa: F401
from hf_elixir.search._rates import event_seconds as _event_seconds  # noqa: F401

__all__ = ["ChunkedStep", "Knobs", "Prediction", "activation_bytes", "build_chunked_step", "predict", "profile_blocks",
           "resolve_policy"]


_MAX_PENDING_REDUCES = 2  # ChunkManager.max_pending_reduces
#: forward-only steps: at most this many replays of the forward to reach the steady cache ([Note: forward-only
#: pricing]); least-recently-used eviction over one fixed order settles after one or two
FORWARD_PASSES = 4


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


def predict(step: ChunkedStep, knobs: Knobs, hardware: HardwareProfile, *, pool_bytes: int | None = None,
            activations_on_device: bool = False, timeline: bool = False,
            overlap_host_optimizer: bool | None = None, host_budget_bytes: int | None = None,
            _refresh_prev: dict[int, float] | None = None) -> Prediction | None:
    """Predicted time and memory of ``knobs`` with a model-data pool of ``pool_bytes`` (the
    ``device_memory_budget_bytes`` given to ``prepare``); ``None`` if the step cannot run in it (the
    manager would raise). Without ``pool_bytes`` the pool is the fixed parts plus
    ``knobs.cache_blocks`` chunks plus the gradient-buffer peak. ``overlap_host_optimizer``: as
    ``ElixirConfig.overlap_host_optimizer``, ``None`` resolved as the runtime does (on for a CUDA device,
    off on CPU: :func:`hf_elixir.optim._overlap.speculates`), see [Note: overlap];
    ``host_budget_bytes``: this rank's host memory, which bounds the host lane's snapshots (``None``: no bound).
    ``_refresh_prev`` (internal): when each upload of the previous step is done, seconds from this step's start
    (the second pass of [Note: early refresh pricing]).

    See [Note: time model] in this module's docstring and [Note: memory accounting] in ``_memory_cost.py``.
    """
    ws = step.world_size
    b = DTYPE_BYTES[step.precision]
    if overlap_host_optimizer is None:  # as hf_elixir.optim._overlap.speculates resolves it
        overlap_host_optimizer = hardware.device_kind == "cuda"
    held = knobs.resident | knobs.device_shard
    on_device = step.never_filled(knobs)  # chunks that never need a fill
    # the copies the runtime keeps whatever the plan says, where they fit the host ([Note: memory accounting])
    knobs = resolve_host_copies(step, knobs, activations_on_device, host_budget_bytes)
    fixed, host_bytes, breakdown = fixed_memory(step, knobs)
    # the host lane's rollback snapshots (master + states, + the fp16 gradient) while they fit the host
    # (none for Adam/AdamW: rolled back by the inverse update, [Note: inverse rollback] in optim/_inverse_adam.py)
    snapshot_numel_bytes = 4 * (1 + step.optim_states + (step.precision == "fp16")) if step.snapshot_rollback else 0
    snapshot_room = _INF if host_budget_bytes is None else max(0, host_budget_bytes - host_bytes)  # as HostLane
    snapshot_bytes = 0
    snapshot_serial_s = 0.0  # snapshot copies off CUDA: on the compute's own cores (serial)
    host_rate = hardware.host_adam_numel_per_s or 1e9
    host_copy_rate = _host_copy_rate(hardware)
    chunk_bytes = step.chunk_size_numel * b
    if pool_bytes is None:
        pool_bytes = fixed + knobs.cache_blocks * chunk_bytes + step.grad_peak_bytes
    h2d_rate = hardware.h2d_bytes_per_s or 1e10
    d2h_rate = hardware.d2h_bytes_per_s or 1e10
    ag_rate = hardware.allgather_bytes_per_s or h2d_rate
    rs_rate = hardware.reduce_scatter_bytes_per_s or d2h_rate
    local_rate = _local_copy_rate(hardware)
    ar_rate = hardware.allreduce_rate() or 1.0 / (1.0 / rs_rate + 1.0 / ag_rate)
    # an expert chunk's group (the expert-data-parallel ranks) has its own rate ([Note: expert parallel pricing])
    group_rates = step.collective_rates
    gather_rate = {c: group_rates.get(step.group_size(c), ag_rate) for c in range(step.num_chunks)}
    reduce_rate = {c: group_rates.get(step.group_size(c), rs_rate) for c in range(step.num_chunks)}
    # off CUDA a gradient collective finishes (frees its buffers) when the pool is short or backward's readers
    # wait for it, as in ChunkManager._reduce / make_room
    async_reduce = hardware.device_kind != "cuda" and (ws > 1 or step.replicated)
    pending: list[tuple[int, int, int]] = []  # (bytes charged, gradient buffer, reduce output) of unfinished reduces
    # off CUDA finished buffers are kept ([Note: memory accounting] in ``_memory_cost.py``): the pool events
    # _kept_peak replays
    buffers_kept = hardware.device_kind != "cuda"
    pool_log: list[tuple] = []
    # ChunkManager.reduce_window: no limit but the budget when every chunk stays on the device ([Note: reduce window])
    lane_in_backward = overlap_host_optimizer and any(
        step.trained_numels[c] and c not in knobs.device_optim for c in range(step.num_chunks))
    window = (None if not lane_in_backward and all(c in on_device for c in range(step.num_chunks))
              else _MAX_PENDING_REDUCES)
    # a forward-only step's first replay has no previous forward to prefetch by ([Note: forward-only pricing])
    prefetching = knobs.prefetch_depth > 0
    overlap = hardware.can_overlap and prefetching
    # forward all-gathers issued ahead, on CUDA and off it ([Note: overlap]); under a pool that charges
    # activations only in training with rank-local host copies (the ranks agree on them at each optimizer step)
    gather_ahead = ws > 1 and prefetching and step.gather_prefetch and (
        not activations_on_device or (knobs.host_copies and not step.forward_only))
    # next use of each chunk after each event (Belady's victim choice, as the manager's); for a forward-only
    # step also its place in that event, the manager's trace position ([Note: forward-only pricing])
    next_use, next_place, first_place = step.next_places
    last_seen: dict[int, float] = {}
    reduce_at, arrive_at = step.reduce_at, step.arrive_at
    used = fixed
    peak = fixed
    peak_parts = (0, 0)  # (cached chunk bytes, onload staging bytes) when the peak was reached
    cached: dict[int, int] = {}  # chunk -> bytes held
    cache_peak = grad_live = grad_peak = 0
    onloads = evictions = 0
    chunk_onloads: dict[int, int] = {}
    h2d_bytes = d2h_bytes = ag_bytes = rs_bytes = 0
    t_compute = t_copy = t_reduce = t_act = t_gather = 0.0  # compute, copy, reduce, activation, gather streams
    t_offload = t_lane = 0.0  # the offload stream (CUDA) and the host lane's worker thread
    # [Note: overlapped refresh] uploads of host masters into device shards: on CUDA on the copy stream from the
    # start of the step (the previous step's end), in first forward use order, each event waiting for its own
    # [Note: refresh cast] cast on the host (in the lane) or on the device (fp32 bytes over PCIe, then the cast)
    upload_b = refresh_upload_bytes_per_numel(step, knobs)
    device_cast = casts_on_device(step, knobs)
    upload_s = {c: step.shard_numel(c) * upload_b / h2d_rate
                + (_device_cast_s(step.shard_numel(c), step, hardware) if device_cast else 0.0)
                for c in _uploaded_chunks(step, knobs)}
    cast_s = {c: _host_cast_s(step.shard_numel(c), hardware) for c in upload_s
              if step.precision != "fp32" and not device_cast}
    refresh_done = _refresh_times(step, upload_s) if hardware.can_overlap else {}
    if _refresh_prev is not None:
        refresh_done = _refresh_prev
    # [Note: early refresh pricing] the host lane's uploads go out during backward (on CUDA, not under fp16 loss
    # scaling: [Note: early refresh] in optim/_refresh.py): a chunk the lane stepped is uploaded on the copy
    # stream at the first backward event after the lane finished it and after the chunk's last access
    early_refresh = _early_refresh(step, hardware)
    last_access = step.last_access
    lane_done: dict[int, float] = {}  # lane chunk -> when the lane finished it (step + cast)
    early_done: dict[int, float] = {}  # lane chunk -> when its upload issued in backward is done
    early_queue: dict[int, float] = {}  # lane chunks with an upload not issued yet -> when the lane finished them
    upload_end = max(refresh_done.values(), default=0.0)
    t_copy = upload_end  # onloads prefetched on the copy stream queue behind the uploads
    backward_waited = False
    lane_chunks: set[int] = set()  # host chunks stepped on the lane during backward
    starts: list[float] = []
    points: list[tuple[float, int, str]] = []
    gathered: set[int] = set()  # ws > 1: gathered this step (with host copies later refills are local copies)
    gathers_ahead: dict[str, int] = {}
    onload_issue: float | None = None  # when the copy back of the next offloaded block may start

    def raise_peak(value: int, staging: int = 0) -> None:
        nonlocal peak, peak_parts
        if value > peak:
            peak, peak_parts = value, (sum(cached.values()), staging)

    def finish_reduce() -> None:
        nonlocal used, grad_live
        nbytes, grad, out = pending.pop(0)
        used -= nbytes
        grad_live -= grad
        pool_log.extend(("free", size) for size in (grad, out) if size)

    def make_room(nbytes: int, pinned: tuple[int, ...], k: int) -> bool:
        nonlocal used, evictions, d2h_bytes
        pool_log.append(("room", nbytes, used))
        while used + nbytes > pool_bytes and pending:
            finish_reduce()  # finishing an in-flight reduce frees its buffers first (ChunkManager.make_room)
            pool_log.append(("room", nbytes, used))
        while used + nbytes > pool_bytes:
            victims = [c for c in cached if c not in pinned]
            if not victims:
                return False
            if step.forward_only and first_pass:  # least recently used ([Note: forward-only pricing])
                victim = min(victims, key=recency.__getitem__)
            elif step.forward_only:  # Belady over the previous forward, as ChunkManager._belady_key
                victim = max(victims, key=lambda c: (*place[c], -recency[c]))
            else:
                victim = max(victims, key=lambda c: (last_seen.get(c, _INF), -c))
            evicted.append(victim)
            used -= cached.pop(victim)
            evictions += 1
            if ws > 1 and knobs.host_copies and victim in gathered and victim not in host_copied:
                host_copied.add(victim)
                d2h_bytes += step.full_bytes(victim)
        return True

    host_copied: set[int] = set()
    recency: dict[int, int] = {}  # chunk -> when last accessed (forward-only steps evict the least recent)
    place: dict[int, tuple[float, int]] = {}  # forward-only: chunk -> its next use (event, place in it)
    evicted: list[int] = []  # the victims of the last make_room calls (forward-only gathers ahead)
    first_pass = True  # forward-only: the first replay, the first forward after prepare

    def forward_passes():
        """The events to replay: once, or for a forward-only step until a replay starts from the cache the one
        before it started from (at most ``FORWARD_PASSES``), the counters and clocks reset before each replay
        so that the last one is what is priced ([Note: forward-only pricing])."""
        nonlocal onloads, evictions, h2d_bytes, d2h_bytes, ag_bytes, rs_bytes, peak, cache_peak, peak_parts
        nonlocal t_compute, t_copy, t_reduce, t_act, t_gather, t_offload, t_lane, first_pass, prefetching
        starts_from = None
        for replay in range(FORWARD_PASSES if step.forward_only else 1):
            state = (tuple(sorted(cached, key=recency.__getitem__)), frozenset(gathered), frozenset(host_copied))
            if state == starts_from:
                return  # the replay just priced started where this one would: it is the steady state
            # the first forward has no previous one: LRU, nothing prefetched; the later ones follow the one before
            first_pass = step.forward_only and replay == 0
            prefetching = knobs.prefetch_depth > 0 and not first_pass
            starts_from = state if not first_pass else None
            place.update({c: first_place.get(c, (_INF, 0)) for c in cached})
            if replay:
                onloads = evictions = h2d_bytes = d2h_bytes = ag_bytes = rs_bytes = 0
                t_compute = t_copy = t_reduce = t_act = t_gather = t_offload = t_lane = 0.0
                peak, cache_peak = used, sum(cached.values())
                peak_parts = (cache_peak, 0)
                for log in (starts, points, pool_log):
                    log.clear()
                chunk_onloads.clear()
                gathers_ahead.clear()
            yield from enumerate(step.groups)

    clock = 0
    # the manager reshards a chunk backward uses no more at its last backward access (whole on one rank, no
    # replica group), not at the next make-room ([Note: dead chunks] in chunk/_eviction.py)
    reshard_dead = not step.replicated  # for chunks whole on their rank
    computing: set[int] = set()  # chunks with a parameter left in COMPUTE until the end of backward
    for k, group in forward_passes():
        for c in sorted(group):
            last_seen[c] = next_use[k][c]
            place[c] = next_place[k][c]
            recency[c] = clock  # as ChunkManager._record, chunk by chunk (by id) before any room is made
            clock += 1
        if k in step.offload_before:  # an offloaded block's activations come back; its backward waits for them
            nbytes = step.offload_before[k]
            h2d_bytes += nbytes
            if hardware.can_overlap:  # issued when the previous offloaded block's backward started, if any
                t_act = max(t_act, t_compute if onload_issue is None else onload_issue) + nbytes / h2d_rate
                t_compute = max(t_compute, t_act)
                onload_issue = t_compute  # [Note: activation onload ahead]: the next block's copies start now
            else:
                t_compute += nbytes / h2d_rate
        issue = starts[k - knobs.prefetch_depth] if overlap and k >= knobs.prefetch_depth else t_compute
        ready = max(t_compute, max([refresh_done.get(c, 0.0) for c in group], default=0.0)) if refresh_done \
            else t_compute  # each chunk's upload event
        if step.event_phase[k] == "bwd" and not backward_waited:  # the start of backward drains every upload
            ready, backward_waited = max(ready, upload_end), True
        loaded = 0
        for c in group:
            if c in on_device or c in cached:
                continue
            loaded += 1
            full = step.full_bytes(c)
            collective = step.group_size(c) > 1 and (c not in gathered or not knobs.host_copies)
            staging = step.shard_numel(c) * b if collective and c not in knobs.device_shard else 0
            ahead = collective and gather_ahead and prefetching and k >= (
                1 if step.forward_only else knobs.prefetch_depth) and (
                step.event_phase[k] == "fwd" or not activations_on_device and _backward_room(
                    step, k, knobs.prefetch_depth, cached, last_seen, pool_bytes - used - full - staging))
            evicted.clear()
            if not make_room(full + staging, group, k):
                return None
            if ahead and step.forward_only:  # [Note: forward-only pricing]: not where its room is a chunk just used
                ahead = not set(evicted) & (set(step.groups[k - 1]) - set(group))
            used += full
            cached[c] = full
            raise_peak(used + staging, staging)
            pool_log.append(("peak", used + staging))
            onloads += 1
            chunk_onloads[c] = chunk_onloads.get(c, 0) + 1
            copy_s = hardware.onload_fixed_s
            if step.group_size(c) == 1:
                h2d_bytes += full
                copy_s += full / h2d_rate
            elif collective:
                gathered.add(c)
                ag_bytes += full
                copy_s += full / gather_rate[c] + staging / h2d_rate
                h2d_bytes += staging
            else:
                h2d_bytes += full
                copy_s += full / h2d_rate
            if overlap and prefetching and not collective:  # side-stream prefetch of a local copy (_prefetch)
                t_copy = max(t_copy, issue) + copy_s
                ready = max(ready, t_copy)
            elif ahead:
                gathers_ahead[step.event_phase[k]] = gathers_ahead.get(step.event_phase[k], 0) + 1
                gather_s = full / gather_rate[c]  # issued ahead, waited by this event ([Note: overlap])
                if not hardware.can_overlap:  # off CUDA the staging onload runs on the compute thread
                    t_compute += copy_s - gather_s
                    copy_s = gather_s
                # on CUDA on the copy stream, behind the uploads
                t_gather = max(t_gather, starts[k - knobs.prefetch_depth], upload_end) + copy_s
                ready = max(ready, t_gather)
            else:  # in the hook: the compute waits for it (and for gathers queued before it)
                t_compute = max(t_compute, ready, t_gather if collective else 0.0) + copy_s
                ready = t_compute
                if collective:
                    t_gather = t_compute
        cache_peak = max(cache_peak, sum(cached.values()))
        start = max(t_compute, ready)
        starts.append(start)
        t_compute = start + step.event_compute_s[k] + hardware.hook_event_s
        if early_queue and step.event_phase[k] == "bwd":
            for c in sorted(c for c, t in early_queue.items() if t <= t_compute and last_access[c] < k):
                t_copy = max(t_copy, lane_done[c]) + upload_s[c]
                early_done[c] = t_copy
                del early_queue[c]
        if k in step.offload_after:  # an offloaded block's activations go to the host (CUDA: on a side stream)
            nbytes = step.offload_after[k]
            d2h_bytes += nbytes
            if hardware.can_overlap:
                t_act = max(t_act, start) + nbytes / d2h_rate
            else:
                t_compute += nbytes / d2h_rate
        for c in arrive_at.get(k, []):
            g = step.chunk_numels[c] * step.grad_elem_bytes
            pool_log.append(("take", g))
            if not make_room(g, group, k):
                return None
            used += g
            grad_live += g
            raise_peak(used)
            pool_log.append(("peak", used))
            t_compute += step.trained_numels[c] * 4 / local_rate  # gradients copied into the buffer
        grad_peak = max(grad_peak, grad_live)
        for c in reduce_at.get(k, []):
            g = step.chunk_numels[c] * step.grad_elem_bytes
            shard_g = step.shard_numel(c) * 4
            out = 0
            reduce_s = 0.0
            if step.group_size(c) > 1:  # reduce-scatter into a charged output shard
                out = g // step.group_size(c)
                pool_log.append(("take", out))
                if not make_room(out, group, k):
                    return None
                used += out
                raise_peak(used)
                pool_log.append(("peak", used))
                rs_bytes += g
                reduce_s += g / reduce_rate[c]
            elif step.replicated:  # all-reduce in place
                rs_bytes += g
                reduce_s += g / ar_rate
            if c not in knobs.device_optim:
                d2h_bytes += shard_g
            # reduced gradient added into the fp32 gradient shard (on the host unless its optimizer is on the device)
            copy_s = shard_g / (local_rate if c in knobs.device_optim else d2h_rate)
            host_ready = None
            if hardware.can_overlap and c in knobs.device_optim:  # the reduce stream ([Note: reduce overlap])
                t_reduce = max(t_reduce, t_compute) + reduce_s + copy_s
            elif hardware.can_overlap:  # the collective on the compute stream, the copy on the offload stream
                t_compute += reduce_s
                t_offload = max(t_offload, t_compute) + copy_s
                host_ready = t_offload
            else:
                t_compute += reduce_s + copy_s
                host_ready = t_compute
            snapshot = step.shard_numel(c) * snapshot_numel_bytes
            if c not in knobs.device_optim and overlap_host_optimizer and step.trained_numels[c] \
                    and snapshot <= snapshot_room:
                snapshot_room -= snapshot
                snapshot_bytes += snapshot
            else:
                host_ready = None
            if host_ready is not None and hardware.can_overlap:
                # the host lane snapshots and steps the chunk as soon as its gradient is on the host
                # ([Note: host lane])
                t_lane = (max(t_lane, host_ready) + snapshot / host_copy_rate + step.shard_numel(c) / host_rate
                          + step.views[c] * hardware.optim_tensor_s)
                t_lane += cast_s.get(c, 0.0)  # the upload's host cast, right after the chunk's step
                lane_chunks.add(c)
                lane_done[c] = t_lane
                if early_refresh and c in upload_s and c not in early_done:
                    early_queue[c] = t_lane
            elif host_ready is not None:  # off CUDA: the lane shares the compute's cores, its copies add up
                snapshot_serial_s += snapshot / host_copy_rate
            pending.append((g + out, g, out))
            while pending and (not async_reduce or (window is not None and len(pending) > window)):
                finish_reduce()
        computing.update(step.compute_held.get(k, ()))
        if reshard_dead and step.event_phase[k] == "bwd" and k not in step.no_dead_release:
            for c in group:  # [Note: dead chunks] in chunk/_eviction.py
                if c in cached and step.trained_numels[c] and next_use[k][c] == _INF and c not in computing \
                        and step.group_size(c) == 1:
                    used -= cached.pop(c)
                    evictions += 1
        if timeline:
            points.append((t_compute, used, f"{step.event_phase[k]}:{loaded} onloads"))
    while pending:  # the end of backward drains every in-flight reduce
        finish_reduce()
    replayed_peak = peak
    if buffers_kept:  # [Note: memory accounting]: the kept buffers fill the pool, the steady state's peak
        _, kept = _kept_peak(pool_log, pool_bytes, {})
        peak = max(peak, _kept_peak(pool_log, pool_bytes, kept)[0])
    fwd_bwd = max(t_compute, t_copy, t_reduce, t_act, t_gather, t_offload)  # backward joins the other streams
    compute_s = sum(step.event_compute_s)
    host_numel = dev_numel = 0
    refresh_bytes = device_refresh_bytes = 0  # casts refreshing compute copies; of which within the device
    refresh_tail_s = 0.0  # uploads cast on the device and done in the step (off CUDA)
    views = 0
    for c in range(step.num_chunks):
        if not step.trained_numels[c]:
            continue
        if c in lane_chunks:  # stepped (and its upload cast) on the host lane, priced in its timeline (t_lane)
            pass
        elif c in knobs.device_optim:
            views += step.views[c]
            dev_numel += step.shard_numel(c)
        else:
            views += step.views[c]
            host_numel += step.shard_numel(c)
        master_is_shard = step.precision == "fp32" and ((c in knobs.device_optim) == (c in held))
        if c in upload_s and device_cast:  # [Note: refresh cast] fp32 over PCIe, cast on the device
            h2d_bytes += step.shard_numel(c) * upload_b
            if c not in refresh_done:
                refresh_tail_s += upload_s[c]
        elif not master_is_shard:
            refresh_bytes += step.shard_numel(c) * b
            if (c in knobs.device_optim) != (c in held):
                h2d_bytes += step.shard_numel(c) * b
            elif c in held:
                device_refresh_bytes += step.shard_numel(c) * b
    # what the lane has left when backward ends, then the host chunks it did not step (none unless off)
    host_s = max(0.0, t_lane - fwd_bwd) + host_numel / host_rate + snapshot_serial_s
    host_s += sum(t for c, t in cast_s.items() if c not in lane_chunks)  # upload casts in the step
    if refresh_done and not device_cast:  # uploads overlap the next forward (priced in its timeline above)
        refresh_bytes -= sum(step.shard_numel(c) * b for c in refresh_done)
    dev_s = dev_numel / (hardware.device_adam_numel_per_s or 1e9)
    regathered = [c for c in knobs.resident if step.trained_numels[c] and step.group_size(c) > 1]
    ag_bytes += sum(step.full_bytes(c) for c in regathered)
    tail_s = ((refresh_bytes - device_refresh_bytes) / h2d_rate + device_refresh_bytes / local_rate
              + sum(step.full_bytes(c) / gather_rate[c] for c in regathered) + views * hardware.optim_tensor_s
              + refresh_tail_s)
    optim_s = host_s + dev_s + tail_s  # host update, then the device kernels (see [Note: overlap])
    breakdown = dict(breakdown, cache=cache_peak, grad_buffers=grad_peak)
    host_bytes += sum(step.offload_after.values())  # offloaded activations, on the host from forward to backward
    breakdown["activations"] = step.activation_bytes if activations_on_device else 0
    device_peak = peak + breakdown["activations"]
    cached_at, staging_at = peak_parts  # what the device holds at the peak, by kind (sums to device_peak)
    at_peak = {key: breakdown[key] for key in ("resident_chunks", "device_shards", "device_optimizer",
                                                "refresh_staging")}
    at_peak.update(cache=cached_at, grad_buffers=replayed_peak - fixed - cached_at - staging_at,
                   onload_staging=staging_at, kept_grad_buffers=peak - replayed_peak,
                   activations=breakdown["activations"])
    if timeline:
        points.append((fwd_bwd + optim_s, fixed, "end of forward" if step.forward_only else "optimizer step"))
    if early_done and _refresh_prev is None:
        # [Note: early refresh pricing] steady state: the next forward waits for the uploads issued in this
        # backward that are not done when the step ends, then for the others, issued by the step in first-use
        # order behind them; priced again with those waits
        end = fwd_bwd + optim_s
        prev = {c: max(0.0, t - end) for c, t in early_done.items()}
        rest = {c: t for c, t in upload_s.items() if c not in early_done}
        queued = max(prev.values(), default=0.0)
        prev.update({c: queued + t for c, t in _refresh_times(step, rest).items()})
        return predict(step, knobs, hardware, pool_bytes=pool_bytes, activations_on_device=activations_on_device,
                       timeline=timeline, overlap_host_optimizer=overlap_host_optimizer,
                       host_budget_bytes=host_budget_bytes, _refresh_prev=prev)
    return Prediction(
        step_s=fwd_bwd + optim_s, forward_backward_s=fwd_bwd, optimizer_s=optim_s, compute_s=compute_s,
        onloads=onloads, h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes, allgather_bytes=ag_bytes,
        reduce_scatter_bytes=rs_bytes, device_model_bytes=peak, device_peak_bytes=device_peak,
        host_bytes=host_bytes, host_snapshot_bytes=snapshot_bytes, breakdown=breakdown, peak_breakdown=at_peak,
        alltoall_bytes=step.alltoall_bytes, tensor_parallel_bytes=step.tensor_parallel_bytes, timeline=points,
        chunk_onloads=chunk_onloads, gathers_ahead=gathers_ahead,
        cache_blocks=max(0, (pool_bytes - fixed - step.grad_peak_bytes) // max(1, chunk_bytes)),
    )
