"""Cost model: predicted step time and device/host memory of one configuration (:func:`predict`), by
replaying the profiled access order through the same rules the chunk manager (``hf_elixir/chunk``) follows.

Its parts: the step at one chunk size and the knobs priced on it (``_chunked_step.py``, [Note: replicated
data parallelism]), the bytes a configuration holds (``_memory_cost.py``, [Note: memory accounting]), the
compute and copy rates and the refresh of compute copies (``_rates.py``), and the activations per block
(``_activation_cost.py``, [Note: activation policy]). The replay is ``_replay.py`` (:class:`StepReplay`); this module
keeps :func:`predict` and the notes of the replay.

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

from hf_elixir.chunk.schedule import EventRecorder
from hf_elixir.profiler import HardwareProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES, activation_bytes, profile_blocks, resolve_policy  # noqa: F401
from hf_elixir.search._chunked_step import _INF, ChunkedStep, Knobs, build_chunked_step  # noqa: F401
from hf_elixir.search._memory_cost import _backward_room, _kept_peak, fixed_memory, resolve_host_copies  # noqa: F401
from hf_elixir.search._rates import (_device_cast_s, _early_refresh, _host_cast_s, _host_copy_rate,  # noqa: F401
                                     _local_copy_rate, _refresh_times, _uploaded_chunks, casts_on_device,
                                     refresh_upload_bytes_per_numel)
from hf_elixir.search._replay import FORWARD_PASSES, Prediction, StepReplay, _NoRoom  # noqa: F401
# importable from here, as before the cost model was split: the search, the CLI, tests and benchmarks use them
from hf_elixir.search._memory_cost import host_copies_forced, optim_bytes_per_numel  # noqa: F401
from hf_elixir.search._memory_cost import refresh_staging_bytes  # noqa: F401
from hf_elixir.search._rates import SAME_PASS_CAST_FRACTION  # noqa: F401
from hf_elixir.search._rates import event_seconds as _event_seconds  # noqa: F401

__all__ = ["ChunkedStep", "Knobs", "Prediction", "activation_bytes", "build_chunked_step", "predict", "profile_blocks",
           "resolve_policy"]


def predict(step: ChunkedStep, knobs: Knobs, hardware: HardwareProfile, *, pool_bytes: int | None = None,
            activations_on_device: bool = False, timeline: bool = False,
            overlap_host_optimizer: bool | None = None, host_budget_bytes: int | None = None,
            recorder: EventRecorder | None = None,
            _refresh_prev: dict[int, float] | None = None, _spans: bool = True) -> Prediction | None:
    """Predicted time and memory of ``knobs`` with a model-data pool of ``pool_bytes`` (the
    ``device_memory_budget_bytes`` given to ``prepare``); ``None`` if the step cannot run in it (the
    manager would raise). Without ``pool_bytes`` the pool is the fixed parts plus
    ``knobs.cache_blocks`` chunks plus the gradient-buffer peak. ``overlap_host_optimizer``: as
    ``ElixirConfig.overlap_host_optimizer``, ``None`` resolved as the runtime does (on for a CUDA device,
    off on CPU: :func:`hf_elixir.optim._overlap.speculates`), see [Note: overlap];
    ``host_budget_bytes``: this rank's host memory, which bounds the host lane's snapshots (``None``: no bound).
    ``recorder``: receives the events the replay prices (fills, evictions, reduces of the priced replay, at their
    places in the step's order), the list the runtime executes ([Note: one step description] in
    ``hf_elixir/chunk/schedule.py``).
    ``_refresh_prev`` (internal): when each upload of the previous step is done, seconds from this step's start
    (the second pass of [Note: early refresh pricing]). ``_spans`` (internal): take quiet events a span at a time
    ([Note: quiet spans] in ``_quiet_spans.py``; ``False``: event by event, the same result, for the tests).

    The replay itself is :class:`~hf_elixir.search._replay.StepReplay`. See [Note: time model] in this module's
    docstring and [Note: memory accounting] in ``_memory_cost.py``.
    """
    replay = StepReplay(step, knobs, hardware, pool_bytes=pool_bytes, activations_on_device=activations_on_device,
                        timeline=timeline, overlap_host_optimizer=overlap_host_optimizer,
                        host_budget_bytes=host_budget_bytes, recorder=recorder, refresh_prev=_refresh_prev,
                        spans=_spans)
    try:
        replay.run()
    except _NoRoom:
        return None
    prediction, end = replay.prediction()
    if replay.early_done and _refresh_prev is None:
        # [Note: early refresh pricing] steady state: the next forward waits for the uploads issued in this
        # backward that are not done when the step ends, then for the others, issued by the step in first-use
        # order behind them; priced again with those waits
        prev = {c: max(0.0, t - end) for c, t in replay.early_done.items()}
        rest = {c: t for c, t in replay.upload_s.items() if c not in replay.early_done}
        queued = max(prev.values(), default=0.0)
        prev.update({c: queued + t for c, t in _refresh_times(step, rest).items()})
        return predict(step, knobs, hardware, pool_bytes=pool_bytes, activations_on_device=activations_on_device,
                       timeline=timeline, overlap_host_optimizer=overlap_host_optimizer,
                       host_budget_bytes=host_budget_bytes, recorder=recorder, _refresh_prev=prev, _spans=_spans)
    return prediction
