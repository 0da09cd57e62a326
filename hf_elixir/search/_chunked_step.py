"""The profiled step seen at one chunk size (:class:`ChunkedStep`, built by :func:`build_chunked_step`) and
the point of the search space priced on it (:class:`Knobs`): what the cost model (``_cost.py``) replays.

[Note: replicated data parallelism] (Elixir section 5: partition parameters only when memory requires
it.) A replicated step (``ChunkedStep.replicate_world_size > 1``, :func:`build_chunked_step` with
``replicated=True``) packs chunks for world size 1: every rank holds every chunk whole and resident
(``n_c * b`` each, as ``Chunk.full_alias``), never all-gathers, and all-reduces each chunk's full
gradient buffer (``4 n_c`` bytes at ``HardwareProfile.allreduce_rate``) in the same fixed order the
sharded reduce-scatters use. Its optimizer state covers the whole chunk on every rank: on the device
``4 n_c (1 + k)`` (no master in fp32), on the host ``4 n_c (2 + k)`` per rank (gradient, states,
master), i.e. ``world_size`` times the host memory of a sharded plan; host-optimizer chunks pay the D2H
of their full reduced gradient and the H2D of their full updated parameters every step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy

from hf_elixir.chunk import pack_chunks
from hf_elixir.chunk._frozen_apart import frozen_apart
from hf_elixir.chunk._frozen_whole import frozen_bucket_numel
from hf_elixir.chunk.packing import ChunkLayout
from hf_elixir.chunk.schedule import StepOrder
from hf_elixir.profiler import HardwareProfile, StepProfile
from hf_elixir.search._activation_cost import (DTYPE_BYTES, activation_bytes, checkpointed_events, offload_events,
                                               resolve_policy)
from hf_elixir.search._event_seconds import event_seconds
from hf_elixir.search._expert_parallel import (alltoall_seconds, expert_param_indices, expert_parallel_profile,
                                               group_rate, tokens_split_over_tp)
from hf_elixir.search._tensor_parallel import tensor_parallel_collectives, tensor_parallel_profile

__all__ = ["ChunkedStep", "Knobs", "build_chunked_step"]

_INF = float("inf")


@dataclass(frozen=True)
class Knobs:
    """One point of the search space (chunk ids are positions in the packing).

    ``cache_blocks`` is derived, not chosen: the budget left after the fixed parts is the cache (see
    [Note: memory accounting] in ``_memory_cost.py``); :func:`predict` uses it only when no pool size is given.
    """

    resident: frozenset[int] = frozenset()
    device_shard: frozenset[int] = frozenset()
    device_optim: frozenset[int] = frozenset()
    cache_blocks: int = 0
    prefetch_depth: int = 0
    # ws > 1: keep a rank-local host copy of each evicted gathered chunk (host RAM for the all-gather a
    # re-unshard in the same step would cost; [Note: rank-local refill] in hf_elixir/chunk/chunk.py)
    host_copies: bool = False
    # where uploaded chunks' masters are cast to the compute dtype: "host" or "device" ([Note: refresh cast] in
    # optim/optimizer.py; ElixirPlan.refresh_cast)
    refresh_cast: str = "host"


@dataclass
class ChunkedStep:
    """The profiled step seen at one chunk size (everything the cost model needs, precomputed)."""

    chunk_size_numel: int
    world_size: int
    precision: str
    chunk_numels: list[int]
    trained_numels: list[int]
    groups: list[tuple[int, ...]]  # per event, chunk ids accessed at once (may be empty)
    event_compute_s: list[float]
    event_phase: list[str]
    grad_arrive: dict[int, int]  # trained chunk -> event after which its gradient buffer exists
    grad_reduce: dict[int, int]  # trained chunk -> event after which it is reduce-scattered
    grad_peak_bytes: int
    accesses: list[int]  # per chunk, how many events use it
    views: list[int]  # per chunk, trainable parameter pieces in rank 0's shard (optimizer tensors)
    activation_bytes: int
    activation_checkpointing: bool
    optim_states: int = 2
    # the host lane's rollbacks restore snapshots (AMSGrad, optimizers other than Adam/AdamW); False: Adam/AdamW,
    # rolled back by the inverse update, no snapshot ([Note: inverse rollback] in optim/_inverse_adam.py)
    snapshot_rollback: bool = False
    grad_elem_bytes: int = 4
    replicate_world_size: int = 1  # > 1: chunks whole on that many ranks, gradients all-reduced
    activation_policy: dict[str, str] = field(default_factory=dict)  # block -> keep / recompute / offload
    offload_after: dict[int, int] = field(default_factory=dict)  # event -> activation bytes copied to the host
    offload_before: dict[int, int] = field(default_factory=dict)  # event -> activation bytes copied back
    # forward all-gathers may be issued ahead (False: the model has subtree units such as MoE experts,
    # [Note: overlap])
    gather_prefetch: bool = True
    # [Note: dead chunks] in chunk/_eviction.py: backward events whose release reshards no chunk (recomputed
    # forwards, released with their parameters still in COMPUTE), and per backward event of a unit without a
    # grad input the chunks of its frozen parameters, left in COMPUTE (so never resharded) until backward ends
    no_dead_release: frozenset[int] = frozenset()
    compute_held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # an inference step: forward events only, nothing trained ([Note: forward-only pricing])
    forward_only: bool = False
    # [Note: expert parallel pricing] in _expert_parallel.py: the ranks each chunk is sharded over (empty: all
    # ``world_size``), the all-to-all bytes a rank sends per step, and the collective rate of groups other than
    # ``world_size`` ranks (group size -> gathered bytes per second)
    expert_parallel_size: int = 1
    chunk_world_sizes: list[int] = field(default_factory=list)
    alltoall_bytes: int = 0
    collective_rates: dict[int, float] = field(default_factory=dict)
    # [Note: tensor parallel pricing] in _tensor_parallel.py: the degree, and the bytes a rank sends per step in the
    # split layers' all-reduces and all-gathers
    tensor_parallel_size: int = 1
    tensor_parallel_bytes: int = 0

    @property
    def replicated(self) -> bool:
        """Replicated data parallelism (see [Note: replicated data parallelism])."""
        return self.replicate_world_size > 1

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_numels)

    @property
    def grad_peak_chunks(self) -> int:
        return -(-self.grad_peak_bytes // max(1, self.chunk_size_numel * self.grad_elem_bytes))

    def full_bytes(self, c: int) -> int:
        return self.chunk_numels[c] * DTYPE_BYTES[self.precision]

    def group_size(self, c: int) -> int:
        """Ranks chunk ``c`` is sharded over (``world_size``, or the expert-data-parallel group's size)."""
        return self.chunk_world_sizes[c] if self.chunk_world_sizes else self.world_size

    def shard_numel(self, c: int) -> int:
        return self.chunk_numels[c] // self.group_size(c)

    def never_filled(self, knobs: Knobs) -> frozenset[int]:
        """Chunks the step never fills: the resident ones, and device shards of chunks whole on their rank (one
        rank, or an expert chunk at ``ep = world_size``: the shard is the chunk, ``Chunk.full_alias``)."""
        return knobs.resident | frozenset(c for c in knobs.device_shard if self.group_size(c) == 1)

    # what :func:`predict` derives from the events alone, computed once per step (the search prices thousands of
    # knobs on one step; a ChunkedStep is not changed after it is built: ``dataclasses.replace`` makes a new one)
    @functools.cached_property
    def next_places(self) -> tuple[list[dict[int, float]], list[dict[int, tuple[float, int]]],
                                   dict[int, tuple[float, int]]]:
        """Per event, each of its chunks' next event (``inf``: none), Belady's victim choice as the manager's; the
        same with the chunk's place in that event, the manager's trace position (a unit's chunks are accessed by
        id, ``ModuleHandle.chunks``); and where the step first uses each chunk (the next use as a step starts)."""
        next_use: list[dict[int, float]] = [dict() for _ in self.groups]
        next_place: list[dict[int, tuple[float, int]]] = [dict() for _ in self.groups]
        upcoming: dict[int, tuple[float, int]] = {}
        for k in range(len(self.groups) - 1, -1, -1):
            for c in self.groups[k]:
                next_place[k][c] = upcoming.get(c, (_INF, 0))
                next_use[k][c] = next_place[k][c][0]
            for i, c in enumerate(sorted(self.groups[k])):
                upcoming[c] = (k, i)
        return next_use, next_place, dict(upcoming)

    @functools.cached_property
    def order(self) -> StepOrder:
        """The step's chunk order: the description the runtime's prefetch scheduler executes (``ChunkManager.
        prev_order`` in a steady step), [Note: one step description] in ``hf_elixir/chunk/schedule.py``."""
        return StepOrder.from_events(self.groups, self.event_phase)

    @functools.cached_property
    def last_access(self) -> dict[int, int]:
        """Chunk -> the last event that accesses it."""
        return {c: k for k, group in enumerate(self.groups) for c in group}

    @functools.cached_property
    def first_access(self) -> dict[int, int]:
        """Chunk -> the first event that accesses it (the forward's first use order)."""
        first: dict[int, int] = {}
        for k, group in enumerate(self.groups):
            for c in group:
                first.setdefault(c, k)
        return first

    @functools.cached_property
    def reduce_at(self) -> dict[int, list[int]]:
        """Event -> the chunks reduced after it (``grad_reduce`` inverted)."""
        out: dict[int, list[int]] = {}
        for c, k in self.grad_reduce.items():
            out.setdefault(k, []).append(c)
        return out

    @functools.cached_property
    def arrive_at(self) -> dict[int, list[int]]:
        """Event -> the chunks whose gradient buffer exists after it (``grad_arrive`` inverted)."""
        out: dict[int, list[int]] = {}
        for c, k in self.grad_arrive.items():
            out.setdefault(k, []).append(c)
        return out

    def working_set_bytes(self, held: frozenset[int] = frozenset()) -> int:
        """Device bytes the step needs beyond the fixed parts: the largest event's unsharded non-held
        chunks (plus the previous event's, which backward may still pin), the gradient-buffer peak and,
        with several ranks, an onload staging shard (memoised per ``held``: the search asks for the same sets
        thousands of times)."""
        memo = self.__dict__.setdefault("_working_set_memo", {})
        if held not in memo:
            memo[held] = self._working_set_bytes(held)
        return memo[held]

    def _working_set_bytes(self, held: frozenset[int]) -> int:
        # per event, the bytes of its chunks less those held: every chunk's bytes, less the held chunks' at their uses
        everything, uses = self._event_bytes
        per_event = everything.copy()
        for c in held:
            if c in uses:
                numpy.subtract.at(per_event, uses[c], self.full_bytes(c))
        if len(per_event) == 0:
            per_event = numpy.zeros(1, dtype=numpy.int64)
        pairs = per_event[:-1] + per_event[1:] if len(per_event) > 1 else per_event
        staging = max((self.shard_numel(c) * DTYPE_BYTES[self.precision] for c in range(self.num_chunks)
                       if self.group_size(c) > 1), default=0)
        return int(pairs.max()) + self.grad_peak_bytes + staging

    @functools.cached_property
    def _event_bytes(self) -> tuple[numpy.ndarray, dict[int, numpy.ndarray]]:
        """Per event the bytes of its chunks (int64: a few TB at most), and per chunk the events that use it (an event
        listed once per use)."""
        uses: dict[int, list[int]] = {}
        for k, g in enumerate(self.groups):
            for c in g:
                uses.setdefault(c, []).append(k)
        everything = numpy.array([sum(self.full_bytes(c) for c in g) for g in self.groups], dtype=numpy.int64)
        return everything, {c: numpy.array(ks, dtype=numpy.int64) for c, ks in uses.items()}


def build_chunked_step(profile: StepProfile, chunk_size_numel: int, *, world_size: int, precision: str,
                       hardware: HardwareProfile, activation_checkpointing: bool = False,
                       optim_states: int = 2, grad_elem_bytes: int = 4, replicated: bool = False,
                       activation_policy: dict[str, str] | None = None, snapshot_rollback: bool = False,
                       expert_parallel_size: int = 1, gpus_per_node: int = 8, tensor_parallel_size: int = 1,
                       tensor_parallel_placements: dict[str, str] | None = None,
                       parallelized: bool = False, frozen_whole: bool = False) -> ChunkedStep:
    """Pack the profile's parameters at ``chunk_size_numel`` and precompute the chunk trace, the
    gradient-buffer lifetimes (reduce order as in ``ChunkManager.start_backward``) and the optimizer's
    parameter views.

    Args:
        world_size: data-parallel ranks.
        replicated: replicated data parallelism over ``world_size`` ranks (chunks packed for world size 1,
            gradients all-reduced; see [Note: replicated data parallelism]) instead of sharded chunks.
        activation_policy: block -> ``"keep" | "recompute" | "offload"`` ([Note: activation policy]); blocks
            it does not name keep. ``None``: ``activation_checkpointing`` for every block.
        expert_parallel_size: the step of one rank of that expert-parallel degree ([Note: expert parallel
            pricing] in ``_expert_parallel.py``: its experts, chunks sharded per group, all-to-alls priced);
            ``gpus_per_node``: ranks per machine (an expert- or tensor-parallel group beyond it talks over the
            network).
        tensor_parallel_size, tensor_parallel_placements: the step of one rank of that tensor-parallel degree, the
            modules placed as given (``ElixirPlan.placements``; [Note: tensor parallel pricing] in
            ``_tensor_parallel.py``: split modules' ``1 / tp``, every chunk sharded over ``world_size / tp``
            ranks, the split layers' collectives priced).
        frozen_whole: frozen parameters' chunks whole on every rank, packed as buckets ([Note: whole frozen chunks] in
            ``hf_elixir/chunk/_frozen_whole.py``; ``ElixirConfig.frozen_placement``): world size 1 each, so an onload
            copies the whole chunk and nothing gathers it. Plain data parallelism only.
        parallelized: ``profile`` is already one rank's step (a model rewritten by ``hf_elixir.parallel.parallelize``
            at these degrees): nothing is divided again; chunk groups and collectives are priced.

    Raises:
        ValueError: ``expert_parallel_size`` / ``tensor_parallel_size`` does not divide ``world_size`` (or an expert
            count), is > 1 with ``replicated`` or a dense profile; ``tensor_parallel_size > 1``
            without ``tensor_parallel_placements``.
    """
    ep, tp = expert_parallel_size, tensor_parallel_size
    for name, size in (("expert_parallel_size", ep), ("tensor_parallel_size", tp)):
        if size > 1 and (replicated or world_size % size):
            raise ValueError(f"{name}={size} must divide world_size={world_size} and needs sharded data "
                             f"parallelism (replicated={replicated})")
    if tp > 1 and tensor_parallel_placements is None:
        raise ValueError(f"tensor_parallel_size={tp} needs tensor_parallel_placements= (module FQN -> placement, "
                         "resolve_placements(model, ElixirConfig(tensor_parallel_size=...)))")
    if parallelized:
        experts = expert_param_indices(profile)
    else:
        profile, experts = expert_parallel_profile(profile, ep)
        profile = tensor_parallel_profile(profile, tp, tensor_parallel_placements or {})
    profile = tokens_split_over_tp(profile, ep, tp, events_too=not parallelized)  # [Note: tp x ep pricing]
    replicate_world_size = world_size if replicated else 1
    if replicated:
        world_size = 1
    if tp > 1 and ep == 1:  # every chunk over the data-parallel group, ranks r, r + tp, ... (parallel/_groups.py)
        layout, _ = _pack(profile, chunk_size_numel, world_size // tp, False, None, 1)
        chunk_world_sizes = [world_size // tp] * layout.num_chunks
    else:  # under tp x ep: the dense chunks over world / tp ranks, the experts' over world / ep
        layout, chunk_world_sizes = _pack(profile, chunk_size_numel, world_size // tp, replicated,
                                          experts if ep > 1 else None, world_size // ep,
                                          frozen_whole=frozen_whole and tp == 1 and ep == 1,
                                          element_bytes=DTYPE_BYTES[precision])
    chunk_of = {m: c for c, members in enumerate(layout.members) for m in members}
    policy = resolve_policy(profile, activation_policy if activation_policy is not None else activation_checkpointing)
    recompute = {b for b, kind in policy.items() if kind == "recompute"}
    events = checkpointed_events(profile, recompute) if recompute else list(profile.events)
    groups: list[tuple[int, ...]] = []
    for e in events:
        ids: list[int] = []
        for i in e.params:
            if chunk_of[i] not in ids:
                ids.append(chunk_of[i])
        groups.append(tuple(ids))
    num_chunks = layout.num_chunks
    original = {id(e) for e in profile.events}
    no_dead_release = frozenset(k for k, e in enumerate(events) if e.phase == "bwd" and id(e) not in original)
    compute_held = {k: held for k, e in enumerate(events) if e.phase == "bwd" and not e.grad_inputs
                    and (held := tuple(sorted({chunk_of[i] for i in e.params if not profile.param_requires_grad[i]})))}
    trained = [sum(profile.param_numels[i] for i in members if profile.param_requires_grad[i])
               for members in layout.members]
    last = len(events) - 1
    # gradient arrival per parameter: the profiled hook position, or the last backward use when
    # checkpointing moved the events
    arrive_p: dict[int, int] = {}
    if not recompute:
        for i, k in enumerate(profile.grad_ready_event):
            if profile.param_requires_grad[i]:
                arrive_p[i] = k if k >= 0 else -1
    else:
        for k, e in enumerate(events):
            if e.phase == "bwd":
                for i in e.params:
                    if profile.param_requires_grad[i]:
                        arrive_p[i] = k
    grad_arrive: dict[int, int] = {}
    ready: dict[int, float] = {}
    for c, members in enumerate(layout.members):
        ks = [arrive_p.get(i, -1) for i in members if profile.param_requires_grad[i]]
        if not ks:
            continue
        got = [k for k in ks if k >= 0]
        grad_arrive[c] = min(got) if got else last
        ready[c] = max(got) if got else _INF  # a chunk with no gradient blocks the order until the end
    first_fwd: dict[int, int] = {}
    for k, (e, g) in enumerate(zip(events, groups)):
        if e.phase == "fwd":
            for c in g:
                first_fwd.setdefault(c, k)
    order = sorted(grad_arrive, key=lambda c: (-first_fwd.get(c, -1), -c))
    grad_reduce: dict[int, int] = {}
    prefix = -1.0
    for c in order:
        prefix = max(prefix, ready[c])
        grad_reduce[c] = last if prefix == _INF else int(prefix)
    # the most gradient-buffer bytes live at one event (a chunk's buffer from its arrival to its reduce, inclusive),
    # swept over the events once
    change = [0] * (len(events) + 1)
    for c, arrive in grad_arrive.items():
        if arrive <= grad_reduce[c]:
            change[arrive] += layout.chunk_numels[c] * grad_elem_bytes
            change[grad_reduce[c] + 1] -= layout.chunk_numels[c] * grad_elem_bytes
    peak = live = 0
    for delta in change[:len(events)]:
        live += delta
        peak = max(peak, live)
    accesses = [0] * num_chunks
    for g in groups:
        for c in g:
            accesses[c] += 1
    views = []
    for c, (members, offsets) in enumerate(zip(layout.members, layout.offsets)):
        shard = layout.chunk_numels[c] // (chunk_world_sizes[c] if chunk_world_sizes else world_size)
        views.append(sum(1 for i, off in zip(members, offsets)
                         if profile.param_requires_grad[i] and off < shard and profile.param_numels[i] > 0))
    compute_s = event_seconds(profile, events, hardware, precision)
    a2a_s, a2a_bytes = alltoall_seconds(profile, events, ep, precision, hardware, gpus_per_node)
    tp_s, tp_bytes = tensor_parallel_collectives(profile, events, tp, tensor_parallel_placements or {}, precision,
                                                 hardware, gpus_per_node)
    if parallelized and all(e.compute_s is not None for e in events) and profile.device == hardware.device_kind:
        # measured on the rank: its event times already waited for its collectives
        tp_s = a2a_s = [0.0] * len(events)
    rates = {}
    for mp in {size for size in (ep, tp) if size > 1}:  # the (expert-)data groups (parallel/_mesh.py)
        if world_size // mp > 1:
            rates[world_size // mp] = group_rate(hardware, world_size // mp, across_nodes=world_size > gpus_per_node)
    return ChunkedStep(
        chunk_size_numel=chunk_size_numel, world_size=world_size, precision=precision,
        chunk_numels=list(layout.chunk_numels), trained_numels=trained, groups=groups,
        event_compute_s=[t + a + c for t, a, c in zip(compute_s, a2a_s, tp_s)],
        event_phase=[e.phase for e in events],
        grad_arrive=grad_arrive, grad_reduce=grad_reduce, grad_peak_bytes=peak, accesses=accesses,
        views=views, activation_bytes=activation_bytes(profile, precision, policy),
        activation_checkpointing=len(recompute) == len(policy) if policy else activation_checkpointing,
        optim_states=optim_states, snapshot_rollback=snapshot_rollback,
        grad_elem_bytes=grad_elem_bytes, replicate_world_size=replicate_world_size, activation_policy=policy,
        **dict(zip(("offload_after", "offload_before"), offload_events(profile, events, policy, precision))),
        gather_prefetch=not profile.subtree_units, no_dead_release=no_dead_release, compute_held=compute_held,
        forward_only=profile.forward_only, expert_parallel_size=ep, chunk_world_sizes=chunk_world_sizes,
        alltoall_bytes=a2a_bytes, collective_rates=rates, tensor_parallel_size=tp, tensor_parallel_bytes=tp_bytes,
    )


def _pack(profile: StepProfile, chunk_size_numel: int, world_size: int, replicated: bool,
          experts: frozenset[int] | None, expert_world_size: int, frozen_whole: bool = False,
          element_bytes: int = 4) -> tuple[ChunkLayout, list[int]]:
    """The chunk layout (member indices into ``profile.param_numels``) and, under expert parallelism (``experts``:
    the expert parameters) or with whole frozen chunks, each chunk's group size: as
    ``hf_elixir.chunk._build.build_chunks``, the parameters split into buckets by group and by whether they are trained
    (order kept; the bucket of the first parameter first: ``frozen_apart``, [Note: frozen chunks apart] in
    ``hf_elixir/chunk/_frozen_apart.py``), each packed for its group ([Note: expert parallel pricing] in
    ``_expert_parallel.py``); with ``frozen_whole`` a frozen bucket is packed for world size 1 in buckets of
    ``frozen_bucket_numel`` (``element_bytes`` per element; [Note: whole frozen chunks] in
    ``hf_elixir/chunk/_frozen_whole.py``). Without experts or whole frozen chunks, no group sizes."""
    numels = profile.param_numels
    trained = profile.param_requires_grad or [True] * len(numels)
    buckets = frozen_apart([experts is not None and i in experts for i in range(len(numels))], trained)
    wholes = [frozen_whole and not replicated and not any(trained[i] for i in indices) for _, indices in buckets]
    if experts is None and len(buckets) <= 1 and not any(wholes):
        return pack_chunks(numels, chunk_size_numel, world_size, bucket_packing=replicated), []
    members: list[list[int]] = []
    offsets: list[list[int]] = []
    chunk_numels: list[int] = []
    used: list[int] = []
    sizes: list[int] = []
    for (is_expert, indices), whole in zip(buckets, wholes):
        ws = 1 if whole else expert_world_size if is_expert else world_size
        size = frozen_bucket_numel(chunk_size_numel, element_bytes) if whole else chunk_size_numel
        part = pack_chunks([numels[i] for i in indices], size, ws,
                           bucket_packing=whole or (replicated and experts is None))
        members += [[indices[m] for m in chunk] for chunk in part.members]
        offsets += part.offsets
        chunk_numels += part.chunk_numels
        used += part.used_numels
        sizes += [ws] * part.num_chunks
    return ChunkLayout(members=members, offsets=offsets, chunk_numels=chunk_numels, used_numels=used), \
        (sizes if experts is not None or any(wholes) else [])
