"""The replay behind :func:`~hf_elixir.search._cost.predict`: one step's events through the chunk manager's rules,
priced on the timelines of [Note: time model] and [Note: overlap] (both in ``_cost.py``).

:class:`StepReplay` holds the replay's state (the pool, the cached chunks, the clocks of the compute, copy, gather,
reduce, offload and activation streams and of the host lane, the traffic counters) and takes the step's events one by
one (:meth:`StepReplay.event`): the accesses and their fills (:meth:`~StepReplay._fill`), the compute, the gradient
buffers that arrive and the reduces they allow (:meth:`~StepReplay._grads`), the chunks backward uses no more; then
prices the optimizer step (:meth:`~StepReplay._optimizer_s`) and builds the :class:`Prediction`. Every fill, eviction
and reduce it prices is also an event of the step's description ([Note: one step description] in
``hf_elixir/chunk/schedule.py``), given to ``recorder`` where one is passed.

[Note: gradients within an event] The runtime reduces a chunk as soon as its last gradient lands and every chunk
before it in the reduce order is reduced ([Note: reduce order] in ``hf_elixir/chunk/_reduce.py``), which may be in
the middle of one unit's backward, between the gradients of two chunks. Autograd computes a unit's gradients
roughly from its last parameters to its first, so within one event the replay takes the arriving gradient buffers
from the highest chunk id down, and reduces a chunk that completes in that event (in the reduce order) before the
buffer of a chunk with a lower id is charged. Charging every buffer of the event first (as before) kept a buffer too
many at the event's peak: on a tiny Mixtral under 0.9x its parameter bytes the experts' unit then evicted a chunk
the runtime kept (9 onloads priced, 8 run; now 8, and the same events in the same order, tests/
test_step_description.py), and checkpointed tiny GPT-2 steps priced one to two refills more than they ran.
"""

from __future__ import annotations

from hf_elixir.chunk.schedule import EventRecorder
from hf_elixir.profiler import HardwareProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES
from hf_elixir.search._chunked_step import _INF, ChunkedStep, Knobs
from hf_elixir.search._memory_cost import _backward_room, _kept_peak, fixed_memory, resolve_host_copies
from hf_elixir.search._prediction import Prediction
from hf_elixir.search._quiet_spans import ordered_groups, quiet_events, take_span
from hf_elixir.search._rates import (_device_cast_s, _early_refresh, _host_cast_s, _host_copy_rate, _local_copy_rate,
                                     _refresh_times, _uploaded_chunks, casts_on_device, refresh_upload_bytes_per_numel)

__all__ = ["FORWARD_PASSES", "Prediction", "StepReplay"]

_MAX_PENDING_REDUCES = 2  # ChunkManager.max_pending_reduces
#: forward-only steps: at most this many replays of the forward to reach the steady cache ([Note: forward-only
#: pricing]); least-recently-used eviction over one fixed order settles after one or two
FORWARD_PASSES = 4


class _NoRoom(Exception):
    """The step cannot run in the pool (the manager would raise): :func:`predict` returns ``None``."""


class StepReplay:
    """One replay of ``step`` under ``knobs`` (the arguments are :func:`~hf_elixir.search._cost.predict`'s)."""

    def __init__(self, step: ChunkedStep, knobs: Knobs, hardware: HardwareProfile, *, pool_bytes: int | None,
                 activations_on_device: bool, timeline: bool, overlap_host_optimizer: bool | None,
                 host_budget_bytes: int | None, recorder: EventRecorder | None,
                 refresh_prev: dict[int, float] | None, spans: bool = True) -> None:
        self.step, self.hardware, self.recorder, self.spans = step, hardware, recorder, spans
        self.activations_on_device, self.timeline = activations_on_device, timeline
        if recorder is not None:
            recorder.clear()
        if overlap_host_optimizer is None:  # as hf_elixir.optim._overlap.speculates resolves it
            overlap_host_optimizer = hardware.device_kind == "cuda"
        self.overlap_host_optimizer = overlap_host_optimizer
        self.held = knobs.resident | knobs.device_shard
        self.on_device = step.never_filled(knobs)  # chunks that never need a fill
        # the copies the runtime keeps whatever the plan says, where they fit the host ([Note: memory accounting])
        self.knobs = knobs = resolve_host_copies(step, knobs, activations_on_device, host_budget_bytes)
        self.fixed, self.host_bytes, self.breakdown = fixed_memory(step, knobs)
        self.b = DTYPE_BYTES[step.precision]
        self.chunk_bytes = step.chunk_size_numel * self.b
        if pool_bytes is None:
            pool_bytes = self.fixed + knobs.cache_blocks * self.chunk_bytes + step.grad_peak_bytes
        self.pool_bytes = pool_bytes
        self._init_rates()
        self._init_host_lane(host_budget_bytes)
        self._init_pool()
        self._init_refresh(refresh_prev)
        self._init_places()

    # -- set-up --------------------------------------------------------------------------------------------------
    def _init_rates(self) -> None:
        step, hardware = self.step, self.hardware
        self.host_rate = hardware.host_adam_numel_per_s or 1e9
        self.host_copy_rate = _host_copy_rate(hardware)
        self.h2d_rate = h2d_rate = hardware.h2d_bytes_per_s or 1e10
        self.d2h_rate = d2h_rate = hardware.d2h_bytes_per_s or 1e10
        ag_rate = hardware.allgather_bytes_per_s or h2d_rate
        rs_rate = hardware.reduce_scatter_bytes_per_s or d2h_rate
        self.local_rate = _local_copy_rate(hardware)
        self.ar_rate = hardware.allreduce_rate() or 1.0 / (1.0 / rs_rate + 1.0 / ag_rate)
        # an expert chunk's group (the expert-data-parallel ranks) has its own rate ([Note: expert parallel pricing])
        group_rates = step.collective_rates
        self.gather_rate = {c: group_rates.get(step.group_size(c), ag_rate) for c in range(step.num_chunks)}
        self.reduce_rate = {c: group_rates.get(step.group_size(c), rs_rate) for c in range(step.num_chunks)}

    def _init_host_lane(self, host_budget_bytes: int | None) -> None:
        step = self.step
        # the host lane's rollback snapshots (master + states, + the fp16 gradient) while they fit the host
        # (none for Adam/AdamW: rolled back by the inverse update, [Note: inverse rollback] in optim/_inverse_adam.py)
        self.snapshot_numel_bytes = (4 * (1 + step.optim_states + (step.precision == "fp16"))
                                     if step.snapshot_rollback else 0)
        self.snapshot_room = (_INF if host_budget_bytes is None
                              else max(0, host_budget_bytes - self.host_bytes))  # as HostLane
        self.snapshot_bytes = 0
        self.snapshot_serial_s = 0.0  # snapshot copies off CUDA: on the compute's own cores (serial)
        self.lane_chunks: set[int] = set()  # host chunks stepped on the lane during backward
        self.lane_done: dict[int, float] = {}  # lane chunk -> when the lane finished it (step + cast)

    def _init_pool(self) -> None:
        step, hardware, knobs = self.step, self.hardware, self.knobs
        # off CUDA a gradient collective finishes (frees its buffers) when the pool is short or backward's readers
        # wait for it, as in ChunkManager._reduce / make_room
        self.async_reduce = hardware.device_kind != "cuda" and (step.world_size > 1 or step.replicated)
        self.pending: list[tuple[int, int, int]] = []  # (bytes charged, gradient buffer, reduce output) in flight
        # off CUDA finished buffers are kept ([Note: memory accounting] in ``_memory_cost.py``): the pool events
        # _kept_peak replays
        self.buffers_kept = hardware.device_kind != "cuda"
        self.pool_log: list[tuple] = []
        # ChunkManager.reduce_window: no limit but the budget when every chunk stays on the device ([Note: reduce
        # window])
        lane_in_backward = self.overlap_host_optimizer and any(
            step.trained_numels[c] and c not in knobs.device_optim for c in range(step.num_chunks))
        self.window = (None if not lane_in_backward and all(c in self.on_device for c in range(step.num_chunks))
                       else _MAX_PENDING_REDUCES)
        self.used = self.peak = self.fixed
        self.peak_parts = (0, 0)  # (cached chunk bytes, onload staging bytes) when the peak was reached
        self.cached: dict[int, int] = {}  # chunk -> bytes held
        self.cache_peak = self.grad_live = self.grad_peak = 0
        self._reset_counters()
        self.points: list[tuple[float, int, str]] = []
        self.gathered: set[int] = set()  # ws > 1: gathered this step (with host copies later refills are local)
        self.host_copied: set[int] = set()
        self.onload_issue: float | None = None  # when the copy back of the next offloaded block may start
        self.computing: set[int] = set()  # chunks with a parameter left in COMPUTE until the end of backward
        # the manager reshards a chunk backward uses no more at its last backward access (whole on one rank, no
        # replica group), not at the next make-room ([Note: dead chunks] in chunk/_eviction.py)
        self.reshard_dead = not step.replicated

    def _reset_counters(self) -> None:
        self.onloads = self.evictions = 0
        self.h2d_bytes = self.d2h_bytes = self.ag_bytes = self.rs_bytes = 0
        self.chunk_onloads: dict[int, int] = {}
        self.gathers_ahead: dict[str, int] = {}
        self.starts: list[float] = []
        # compute, copy, reduce, activation, gather streams; the offload stream (CUDA) and the host lane's thread
        self.t_compute = self.t_copy = self.t_reduce = self.t_act = self.t_gather = 0.0
        self.t_offload = self.t_lane = 0.0

    def _init_refresh(self, refresh_prev: dict[int, float] | None) -> None:
        step, hardware, knobs = self.step, self.hardware, self.knobs
        # [Note: overlapped refresh] uploads of host masters into device shards: on CUDA on the copy stream from the
        # start of the step (the previous step's end), in first forward use order, each event waiting for its own
        # [Note: refresh cast] cast on the host (in the lane) or on the device (fp32 bytes over PCIe, then the cast)
        self.upload_b = refresh_upload_bytes_per_numel(step, knobs)
        self.device_cast = device_cast = casts_on_device(step, knobs)
        self.upload_s = {c: step.shard_numel(c) * self.upload_b / self.h2d_rate
                         + (_device_cast_s(step.shard_numel(c), step, hardware) if device_cast else 0.0)
                         for c in _uploaded_chunks(step, knobs)}
        self.cast_s = {c: _host_cast_s(step.shard_numel(c), hardware) for c in self.upload_s
                       if step.precision != "fp32" and not device_cast}
        self.refresh_done = _refresh_times(step, self.upload_s) if hardware.can_overlap else {}
        if refresh_prev is not None:
            self.refresh_done = refresh_prev
        # [Note: early refresh pricing] the host lane's uploads go out during backward (on CUDA, not under fp16 loss
        # scaling: [Note: early refresh] in optim/_refresh.py): a chunk the lane stepped is uploaded on the copy
        # stream at the first backward event after the lane finished it and after the chunk's last access
        self.early_refresh = _early_refresh(step, hardware)
        self.early_done: dict[int, float] = {}  # lane chunk -> when its upload issued in backward is done
        self.early_queue: dict[int, float] = {}  # lane chunks with an upload not issued yet -> when the lane did them
        self.upload_end = max(self.refresh_done.values(), default=0.0)
        self.t_copy = self.upload_end  # onloads prefetched on the copy stream queue behind the uploads
        self.backward_waited = False

    def _init_places(self) -> None:
        step = self.step
        # a forward-only step's first replay has no previous forward to prefetch by ([Note: forward-only pricing])
        self.prefetching = self.knobs.prefetch_depth > 0
        self.overlap = self.hardware.can_overlap and self.prefetching
        # forward all-gathers issued ahead, on CUDA and off it ([Note: overlap]); under a pool that charges
        # activations only in training with rank-local host copies (the ranks agree on them at each optimizer step)
        self.gather_ahead = step.world_size > 1 and self.prefetching and step.gather_prefetch and (
            not self.activations_on_device or (self.knobs.host_copies and not step.forward_only))
        # next use of each chunk after each event; also its place in that event, the manager's trace position, which
        # Belady's victim choice ranks by, as the manager's
        self.next_use, self.next_place, self.first_place = step.next_places
        self.last_seen: dict[int, float] = {}
        self.recency: dict[int, int] = {}  # chunk -> when last accessed (ties, and forward-only's first replay)
        self.place: dict[int, tuple[float, int]] = {}  # chunk -> its next use (event, place in it)
        self.evicted: list[int] = []  # the victims of the last make_room calls (forward-only gathers ahead)
        self.first_pass = True  # forward-only: the first replay, the first forward after prepare
        self.clock = 0
        # where each event's accesses start in the step's order (a unit's chunks by id, [Note: one step description])
        self.event_at = step.__dict__.get("_event_at")  # memoised on the step (not changed once built)
        if self.event_at is None:
            self.event_at = step.__dict__["_event_at"] = [0]
            for group in step.groups:
                self.event_at.append(self.event_at[-1] + len(set(group)))
        self.serving = (0, 0)  # (event, position) the replay serves: where an eviction is recorded
        self.by_id = ordered_groups(step)  # each event's chunks by id (the manager records them in that order)


    # -- the pool ------------------------------------------------------------------------------------------------
    def _note(self, kind: str, c: int, at: int) -> None:
        self.recorder.record(self.step.event_phase[self.serving[0]], kind, c, at)

    def _raise_peak(self, value: int, staging: int = 0) -> None:
        if value > self.peak:
            self.peak, self.peak_parts = value, (sum(self.cached.values()), staging)

    def _finish_reduce(self) -> None:
        nbytes, grad, out = self.pending.pop(0)
        self.used -= nbytes
        self.grad_live -= grad
        self.pool_log.extend(("free", size) for size in (grad, out) if size)

    def _victim(self, pinned: tuple[int, ...]) -> int | None:
        victims = [c for c in self.cached if c not in pinned]
        if not victims:
            return None
        if self.step.forward_only and self.first_pass:  # least recently used ([Note: forward-only pricing])
            return min(victims, key=self.recency.__getitem__)
        # Belady over the step's order, ties to the least recently used, as ChunkManager._belady_key
        return max(victims, key=lambda c: (*self.place[c], -self.recency[c]))

    def _make_room(self, nbytes: int, pinned: tuple[int, ...]) -> None:
        """Room for ``nbytes`` more (ChunkManager.make_room: in-flight reduces finish first, then Belady's victims);
        raises :class:`_NoRoom` where none is left."""
        self.pool_log.append(("room", nbytes, self.used))
        while self.used + nbytes > self.pool_bytes and self.pending:
            self._finish_reduce()  # finishing an in-flight reduce frees its buffers first (ChunkManager.make_room)
            self.pool_log.append(("room", nbytes, self.used))
        while self.used + nbytes > self.pool_bytes:
            victim = self._victim(pinned)
            if victim is None:
                raise _NoRoom
            self.evicted.append(victim)
            if self.recorder is not None:
                self._note("evict", victim, self.serving[1])
            self.used -= self.cached.pop(victim)
            self.evictions += 1
            if (self.step.world_size > 1 and self.knobs.host_copies and victim in self.gathered
                    and victim not in self.host_copied):
                self.host_copied.add(victim)
                self.d2h_bytes += self.step.full_bytes(victim)

    def _take(self, nbytes: int, group: tuple[int, ...]) -> None:
        """Charge ``nbytes`` of gradient buffer or reduce output (room made first), logged for :func:`_kept_peak`."""
        self.pool_log.append(("take", nbytes))
        self._make_room(nbytes, group)
        self.used += nbytes
        self._raise_peak(self.used)
        self.pool_log.append(("peak", self.used))

    # -- the replays -------------------------------------------------------------------------------------------
    def passes(self):
        """The replays of the step's events: once, or for a forward-only step until a replay starts from the cache
        the one before it started from (at most ``FORWARD_PASSES``), the counters and clocks reset before each replay
        so that the last one is what is priced ([Note: forward-only pricing]); yields before each replay."""
        step, knobs = self.step, self.knobs
        starts_from = None
        for replay in range(FORWARD_PASSES if step.forward_only else 1):
            state = (tuple(sorted(self.cached, key=self.recency.__getitem__)), frozenset(self.gathered),
                     frozenset(self.host_copied))
            if state == starts_from:
                return  # the replay just priced started where this one would: it is the steady state
            # the first forward has no previous one: LRU, nothing prefetched; the later ones follow the one before
            self.first_pass = step.forward_only and replay == 0
            self.prefetching = knobs.prefetch_depth > 0 and not self.first_pass
            starts_from = state if not self.first_pass else None
            self.place.update({c: self.first_place.get(c, (_INF, 0)) for c in self.cached})
            if replay:
                self._reset_counters()
                self.peak, self.cache_peak = self.used, sum(self.cached.values())
                self.peak_parts = (self.cache_peak, 0)
                self.points.clear()
                self.pool_log.clear()
                if self.recorder is not None:
                    self.recorder.clear()
            yield replay

    def run(self) -> None:
        """Replay every event (raises :class:`_NoRoom` where the step does not fit), then drain the reduces. Spans
        of quiet events are taken at once (:func:`~hf_elixir.search._quiet_spans.take_span`) unless ``spans`` is off
        or a timeline is drawn (it has a point per event)."""
        groups = self.step.groups
        quiet = quiet_events(self.step) if self.spans and not self.timeline else [False] * len(groups)
        for _ in self.passes():
            k = 0
            while k < len(groups):
                if quiet[k]:
                    done = take_span(self, k)
                    if done > k:
                        k = done
                        continue
                self.event(k, groups[k])
                k += 1
        while self.pending:  # the end of backward drains every in-flight reduce
            self._finish_reduce()

    # -- one event ----------------------------------------------------------------------------------------------
    def event(self, k: int, group: tuple[int, ...]) -> None:
        step = self.step
        next_use, next_place = self.next_use[k], self.next_place[k]
        for c in self.by_id[k]:
            self.last_seen[c] = next_use[c]
            self.place[c] = next_place[c]
            self.recency[c] = self.clock  # as ChunkManager._record, chunk by chunk (by id) before any room is made
            self.clock += 1
        if k in step.offload_before:  # an offloaded block's activations come back; its backward waits for them
            self._activations_back(step.offload_before[k])
        ready = self._ready(k, group)
        loaded, ready = self._fills(k, group, ready)
        if loaded:  # only a fill grows the cache (so without one it is not above cache_peak)
            self.cache_peak = max(self.cache_peak, sum(self.cached.values()))
        start = max(self.t_compute, ready)
        self.starts.append(start)
        self.t_compute = start + step.event_compute_s[k] + self.hardware.hook_event_s
        if self.early_queue and step.event_phase[k] == "bwd":
            self._early_uploads(k)
        if k in step.offload_after:  # an offloaded block's activations go to the host (CUDA: on a side stream)
            self._activations_out(step.offload_after[k], start)
        self._grads(k, group)
        self.computing.update(step.compute_held.get(k, ()))
        if self.reshard_dead and step.event_phase[k] == "bwd" and k not in step.no_dead_release:
            self._reshard_dead(k, group)
        if self.timeline:
            self.points.append((self.t_compute, self.used, f"{step.event_phase[k]}:{loaded} onloads"))

    def _activations_back(self, nbytes: int) -> None:
        self.h2d_bytes += nbytes
        if self.hardware.can_overlap:  # issued when the previous offloaded block's backward started, if any
            self.t_act = (max(self.t_act, self.t_compute if self.onload_issue is None else self.onload_issue)
                          + nbytes / self.h2d_rate)
            self.t_compute = max(self.t_compute, self.t_act)
            self.onload_issue = self.t_compute  # [Note: activation onload ahead]: the next block's copies start now
        else:
            self.t_compute += nbytes / self.h2d_rate

    def _activations_out(self, nbytes: int, start: float) -> None:
        self.d2h_bytes += nbytes
        if self.hardware.can_overlap:
            self.t_act = max(self.t_act, start) + nbytes / self.d2h_rate
        else:
            self.t_compute += nbytes / self.d2h_rate

    def _ready(self, k: int, group: tuple[int, ...]) -> float:
        """When event ``k`` may start as far as the refresh uploads go (each chunk's own; the start of backward
        drains every upload)."""
        t_compute = self.t_compute
        ready = (max(t_compute, max([self.refresh_done.get(c, 0.0) for c in group], default=0.0))
                 if self.refresh_done else t_compute)
        if self.step.event_phase[k] == "bwd" and not self.backward_waited:
            ready, self.backward_waited = max(ready, self.upload_end), True
        return ready

    def _fills(self, k: int, group: tuple[int, ...], ready: float) -> tuple[int, float]:
        """Fill the chunks of event ``k`` that are not on the device; returns (how many, when they are ready)."""
        loaded = 0
        issue = (self.starts[k - self.knobs.prefetch_depth] if self.overlap and k >= self.knobs.prefetch_depth
                 else self.t_compute)
        for c in group:
            if c in self.on_device or c in self.cached:
                continue
            self.serving = (k, self.event_at[k] + sorted(set(group)).index(c) + 1)
            loaded += 1
            ready = self._fill(k, c, group, issue, ready)
        return loaded, ready

    def _is_ahead(self, k: int, c: int, collective: bool, full: int, staging: int) -> bool:
        """Whether the all-gather of ``c`` for event ``k`` is priced as issued ahead ([Note: overlap])."""
        step, knobs = self.step, self.knobs
        return collective and self.gather_ahead and self.prefetching and k >= (
            1 if step.forward_only else knobs.prefetch_depth) and (
            step.event_phase[k] == "fwd" or not self.activations_on_device and _backward_room(
                step, k, knobs.prefetch_depth, self.cached, self.last_seen,
                self.pool_bytes - self.used - full - staging))

    def _fill(self, k: int, c: int, group: tuple[int, ...], issue: float, ready: float) -> float:
        """Make room for chunk ``c``, charge it and price its onload or all-gather; returns when it is ready."""
        step = self.step
        full = step.full_bytes(c)
        collective = step.group_size(c) > 1 and (c not in self.gathered or not self.knobs.host_copies)
        staging = step.shard_numel(c) * self.b if collective and c not in self.knobs.device_shard else 0
        ahead = self._is_ahead(k, c, collective, full, staging)
        self.evicted.clear()
        self._make_room(full + staging, group)
        if ahead and step.forward_only:  # [Note: forward-only pricing]: not where its room is a chunk just used
            ahead = not set(self.evicted) & (set(step.groups[k - 1]) - set(group))
        if self.recorder is not None:
            self._note("fill", c, self.serving[1])
        self.used += full
        self.cached[c] = full
        self._raise_peak(self.used + staging, staging)
        self.pool_log.append(("peak", self.used + staging))
        self.onloads += 1
        self.chunk_onloads[c] = self.chunk_onloads.get(c, 0) + 1
        return self._time_fill(k, c, collective, ahead, full, staging, issue, ready)

    def _copy_s(self, c: int, collective: bool, full: int, staging: int) -> float:
        """The fill's seconds (fixed cost, then the copy or the gather and its staging onload); counts its bytes."""
        copy_s = self.hardware.onload_fixed_s
        if self.step.group_size(c) == 1:
            self.h2d_bytes += full
            copy_s += full / self.h2d_rate
        elif collective:
            self.gathered.add(c)
            self.ag_bytes += full
            copy_s += full / self.gather_rate[c] + staging / self.h2d_rate
            self.h2d_bytes += staging
        else:
            self.h2d_bytes += full
            copy_s += full / self.h2d_rate
        return copy_s

    def _time_fill(self, k: int, c: int, collective: bool, ahead: bool, full: int, staging: int, issue: float,
                   ready: float) -> float:
        """Place the fill on its stream ([Note: overlap]); returns when event ``k``'s chunks are ready."""
        copy_s = self._copy_s(c, collective, full, staging)
        if self.overlap and self.prefetching and not collective:  # side-stream prefetch of a local copy
            self.t_copy = max(self.t_copy, issue) + copy_s
            return max(ready, self.t_copy)
        if ahead:
            phase = self.step.event_phase[k]
            self.gathers_ahead[phase] = self.gathers_ahead.get(phase, 0) + 1
            gather_s = full / self.gather_rate[c]  # issued ahead, waited by this event ([Note: overlap])
            if not self.hardware.can_overlap:  # off CUDA the staging onload runs on the compute thread
                self.t_compute += copy_s - gather_s
                copy_s = gather_s
            # on CUDA on the copy stream, behind the uploads
            self.t_gather = max(self.t_gather, self.starts[k - self.knobs.prefetch_depth], self.upload_end) + copy_s
            return max(ready, self.t_gather)
        # in the hook: the compute waits for it (and for gathers queued before it)
        self.t_compute = max(self.t_compute, ready, self.t_gather if collective else 0.0) + copy_s
        if collective:
            self.t_gather = self.t_compute
        return self.t_compute

    def _early_uploads(self, k: int) -> None:
        """[Note: early refresh pricing] the uploads of lane chunks done by now and used no more, on the copy stream."""
        for c in sorted(c for c, t in self.early_queue.items() if t <= self.t_compute and self.step.last_access[c] < k):
            self.t_copy = max(self.t_copy, self.lane_done[c]) + self.upload_s[c]
            self.early_done[c] = self.t_copy
            del self.early_queue[c]

    def _reshard_dead(self, k: int, group: tuple[int, ...]) -> None:
        step = self.step
        for c in group:  # [Note: dead chunks] in chunk/_eviction.py
            if c in self.cached and step.trained_numels[c] and self.next_use[k][c] == _INF \
                    and c not in self.computing and step.group_size(c) == 1:
                if self.recorder is not None:
                    self._note("evict", c, self.event_at[k + 1])
                self.used -= self.cached.pop(c)
                self.evictions += 1

    # -- gradients ------------------------------------------------------------------------------------------------
    def _grads(self, k: int, group: tuple[int, ...]) -> None:
        """The gradient buffers that arrive after event ``k``, then the reduces that event allows."""
        step = self.step
        self.serving = (k, self.event_at[k + 1])
        if k not in step.reduce_at and k not in step.arrive_at:
            return
        reduces = list(step.reduce_at.get(k, []))
        for c in sorted(step.arrive_at.get(k, []), reverse=True):
            # [Note: gradients within an event] a chunk that completes here and holds later parameters than ``c``
            # is reduced before ``c``'s first gradient arrives
            while reduces and reduces[0] > c:
                self._reduce_now(k, reduces.pop(0), group)
            self._take(step.chunk_numels[c] * step.grad_elem_bytes, group)
            self.grad_live += step.chunk_numels[c] * step.grad_elem_bytes
            self.grad_peak = max(self.grad_peak, self.grad_live)
            self.t_compute += step.trained_numels[c] * 4 / self.local_rate  # gradients copied into the buffer
        for c in reduces:
            self._reduce_now(k, c, group)

    def _reduce_now(self, k: int, c: int, group: tuple[int, ...]) -> None:
        if self.recorder is not None:
            self._note("reduce", c, self.event_at[k + 1])
        self._reduce(c, group)

    def _reduce(self, c: int, group: tuple[int, ...]) -> None:
        """Price chunk ``c``'s reduce and its gradient's way to the optimizer ([Note: overlap])."""
        step, knobs, hardware = self.step, self.knobs, self.hardware
        g = step.chunk_numels[c] * step.grad_elem_bytes
        shard_g = step.shard_numel(c) * 4
        out = 0
        reduce_s = 0.0
        if step.group_size(c) > 1:  # reduce-scatter into a charged output shard
            out = g // step.group_size(c)
            self._take(out, group)
            self.rs_bytes += g
            reduce_s += g / self.reduce_rate[c]
        elif step.replicated:  # all-reduce in place
            self.rs_bytes += g
            reduce_s += g / self.ar_rate
        if c not in knobs.device_optim:
            self.d2h_bytes += shard_g
        # reduced gradient added into the fp32 gradient shard (on the host unless its optimizer is on the device)
        copy_s = shard_g / (self.local_rate if c in knobs.device_optim else self.d2h_rate)
        host_ready = None
        if hardware.can_overlap and c in knobs.device_optim:  # the reduce stream ([Note: reduce overlap])
            self.t_reduce = max(self.t_reduce, self.t_compute) + reduce_s + copy_s
        elif hardware.can_overlap:  # the collective on the compute stream, the copy on the offload stream
            self.t_compute += reduce_s
            self.t_offload = max(self.t_offload, self.t_compute) + copy_s
            host_ready = self.t_offload
        else:
            self.t_compute += reduce_s + copy_s
            host_ready = self.t_compute
        self._host_lane(c, host_ready)
        self.pending.append((g + out, g, out))
        while self.pending and (not self.async_reduce or (self.window is not None and len(self.pending) > self.window)):
            self._finish_reduce()

    def _host_lane(self, c: int, host_ready: float | None) -> None:
        """The host lane snapshots and steps a host chunk as soon as its gradient is on the host ([Note: host
        lane]), while its snapshot fits the host."""
        step = self.step
        snapshot = step.shard_numel(c) * self.snapshot_numel_bytes
        if c not in self.knobs.device_optim and self.overlap_host_optimizer and step.trained_numels[c] \
                and snapshot <= self.snapshot_room:
            self.snapshot_room -= snapshot
            self.snapshot_bytes += snapshot
        else:
            host_ready = None
        if host_ready is not None and self.hardware.can_overlap:
            self.t_lane = (max(self.t_lane, host_ready) + snapshot / self.host_copy_rate
                           + step.shard_numel(c) / self.host_rate + step.views[c] * self.hardware.optim_tensor_s)
            self.t_lane += self.cast_s.get(c, 0.0)  # the upload's host cast, right after the chunk's step
            self.lane_chunks.add(c)
            self.lane_done[c] = self.t_lane
            if self.early_refresh and c in self.upload_s and c not in self.early_done:
                self.early_queue[c] = self.t_lane
        elif host_ready is not None:  # off CUDA: the lane shares the compute's cores, its copies add up
            self.snapshot_serial_s += snapshot / self.host_copy_rate

    # -- the optimizer step and the result ----------------------------------------------------------------------
    def _optimizer_s(self, fwd_bwd: float) -> float:
        """The optimizer step's seconds after backward: what the lane has left, the host and device updates, the
        refreshes and re-gathers of compute copies ([Note: overlap])."""
        step, knobs, b = self.step, self.knobs, self.b
        host_numel = dev_numel = views = 0
        refresh_bytes = device_refresh_bytes = 0  # casts refreshing compute copies; of which within the device
        refresh_tail_s = 0.0  # uploads cast on the device and done in the step (off CUDA)
        for c in range(step.num_chunks):
            if not step.trained_numels[c]:
                continue
            if c in self.lane_chunks:  # stepped (and its upload cast) on the host lane, priced in its timeline
                pass
            elif c in knobs.device_optim:
                views += step.views[c]
                dev_numel += step.shard_numel(c)
            else:
                views += step.views[c]
                host_numel += step.shard_numel(c)
            master_is_shard = step.precision == "fp32" and ((c in knobs.device_optim) == (c in self.held))
            if c in self.upload_s and self.device_cast:  # [Note: refresh cast] fp32 over PCIe, cast on the device
                self.h2d_bytes += step.shard_numel(c) * self.upload_b
                if c not in self.refresh_done:
                    refresh_tail_s += self.upload_s[c]
            elif not master_is_shard:
                refresh_bytes += step.shard_numel(c) * b
                if (c in knobs.device_optim) != (c in self.held):
                    self.h2d_bytes += step.shard_numel(c) * b
                elif c in self.held:
                    device_refresh_bytes += step.shard_numel(c) * b
        # what the lane has left when backward ends, then the host chunks it did not step (none unless off)
        host_s = max(0.0, self.t_lane - fwd_bwd) + host_numel / self.host_rate + self.snapshot_serial_s
        host_s += sum(t for c, t in self.cast_s.items() if c not in self.lane_chunks)  # upload casts in the step
        if self.refresh_done and not self.device_cast:  # uploads overlap the next forward (priced in its timeline)
            refresh_bytes -= sum(step.shard_numel(c) * b for c in self.refresh_done)
        dev_s = dev_numel / (self.hardware.device_adam_numel_per_s or 1e9)
        return host_s + dev_s + self._tail_s(refresh_bytes, device_refresh_bytes, views, refresh_tail_s)

    def _tail_s(self, refresh_bytes: int, device_refresh_bytes: int, views: int, refresh_tail_s: float) -> float:
        """The step's refresh copies, re-gathers of trained resident chunks and per-view costs."""
        step = self.step
        regathered = [c for c in self.knobs.resident if step.trained_numels[c] and step.group_size(c) > 1]
        self.ag_bytes += sum(step.full_bytes(c) for c in regathered)
        return ((refresh_bytes - device_refresh_bytes) / self.h2d_rate + device_refresh_bytes / self.local_rate
                + sum(step.full_bytes(c) / self.gather_rate[c] for c in regathered)
                + views * self.hardware.optim_tensor_s + refresh_tail_s)

    def _peaks(self) -> tuple[int, int, dict[str, int], dict[str, int]]:
        """(model-data peak, device peak, breakdown, the peak by kind) after the replay."""
        replayed_peak = peak = self.peak
        if self.buffers_kept:  # [Note: memory accounting]: the kept buffers fill the pool, the steady state's peak
            _, kept = _kept_peak(self.pool_log, self.pool_bytes, {})
            peak = max(peak, _kept_peak(self.pool_log, self.pool_bytes, kept)[0])
        breakdown = dict(self.breakdown, cache=self.cache_peak, grad_buffers=self.grad_peak)
        breakdown["activations"] = self.step.activation_bytes if self.activations_on_device else 0
        cached_at, staging_at = self.peak_parts  # what the device holds at the peak, by kind (sums to device_peak)
        at_peak = {key: breakdown[key] for key in ("resident_chunks", "device_shards", "device_optimizer",
                                                    "refresh_staging")}
        at_peak.update(cache=cached_at, grad_buffers=replayed_peak - self.fixed - cached_at - staging_at,
                       onload_staging=staging_at, kept_grad_buffers=peak - replayed_peak,
                       activations=breakdown["activations"])
        return peak, peak + breakdown["activations"], breakdown, at_peak

    def prediction(self) -> tuple[Prediction, float]:
        """The :class:`Prediction` of the replay, and when the step ends (seconds)."""
        step = self.step
        peak, device_peak, breakdown, at_peak = self._peaks()
        fwd_bwd = max(self.t_compute, self.t_copy, self.t_reduce, self.t_act, self.t_gather, self.t_offload)
        optim_s = self._optimizer_s(fwd_bwd)  # host update, then the device kernels (see [Note: overlap])
        if self.timeline:
            self.points.append((fwd_bwd + optim_s, self.fixed,
                                "end of forward" if step.forward_only else "optimizer step"))
        # offloaded activations, on the host from forward to backward
        host_bytes = self.host_bytes + sum(step.offload_after.values())
        return Prediction(
            step_s=fwd_bwd + optim_s, forward_backward_s=fwd_bwd, optimizer_s=optim_s,
            compute_s=sum(step.event_compute_s), onloads=self.onloads, h2d_bytes=self.h2d_bytes,
            d2h_bytes=self.d2h_bytes, allgather_bytes=self.ag_bytes, reduce_scatter_bytes=self.rs_bytes,
            device_model_bytes=peak, device_peak_bytes=device_peak, host_bytes=host_bytes,
            host_snapshot_bytes=self.snapshot_bytes, breakdown=breakdown, peak_breakdown=at_peak,
            alltoall_bytes=step.alltoall_bytes, tensor_parallel_bytes=step.tensor_parallel_bytes,
            timeline=self.points, chunk_onloads=self.chunk_onloads, gathers_ahead=self.gathers_ahead,
            cache_blocks=max(0, (self.pool_bytes - self.fixed - step.grad_peak_bytes) // max(1, self.chunk_bytes)),
        ), fwd_bwd + optim_s
