"""Memory accounting of the cost model (``_cost.py``): the device and host bytes a configuration holds
whatever the step does (:func:`fixed_memory`), optimizer-state bytes per element, the host copies the
runtime forces, and the replay of the pool's kept gradient buffers (:func:`_kept_peak`).

[Note: memory accounting] Per rank; ``b`` = compute-dtype bytes, ``n_c`` = chunk ``c``'s numel,
``s_c = n_c / world_size`` its shard numel, ``k`` = optimizer states per element (Adam: 2). This is what
the chunk manager's pool charges (``Chunk.materialize``, ``ElixirOptimizer._build_shard_state``):

* ``world_size == 1``: a chunk in ``resident_chunks`` or ``device_shard_chunks`` keeps its full buffer,
  which *is* its shard (``Chunk.full_alias``): ``n_c * b``, never evicted. Other chunks' shards live on
  the host and are copied into a freshly charged full buffer (``n_c * b``) when used;
* ``world_size > 1``: a resident chunk holds its full buffer, ``n_c * b``, with its shard a view into it
  (``Chunk.shard_in_full``: the all-gather runs in place); a device-shard chunk ``s_c * b``; every other
  chunk is gathered into a charged full buffer when used (plus an ``s_c * b`` onload staging buffer while
  its host shard is gathered);
* optimizer state of a trained chunk on the device (``device_optim_chunks``): fp32 gradient shard
  ``4 s_c`` + ``4 k s_c`` states + an fp32 master ``4 s_c`` unless the precision is fp32 and the shard
  is on the device too (then the shard is the master);
* gradient buffers: one fp32 full chunk (``4 n_c``) from the chunk's first gradient until its
  reduce-scatter, which runs in the manager's fixed order (descending first forward use), each as soon
  as it and all before it are complete;
* unsharded non-resident chunks stay on the device until the pool needs room; the manager then evicts
  the unpinned one whose next use is farthest (Belady over the previous step's order). So the cache is
  *whatever the budget leaves*, and ``Knobs.cache_blocks`` only reports it;
* with one rank and no replica group, a cached trained chunk is freed right after its last backward event
  (no later use in the step's order), after that event's gradient buffers are charged: the manager reshards
  such a chunk when that access is released ([Note: dead chunks] in ``hf_elixir/chunk/_eviction.py``) instead of
  holding it until a make-room evicts it;
* activations are outside the pool; they count toward the device only when ``activations_on_device``;
* off CUDA the manager issues gradient collectives asynchronously and finishes each one two reduces
  later (or when the pool needs the room, or at the end of backward): its gradient buffer (and
  reduce-scatter output) stays charged until then;
* off CUDA the buffers a finished reduce frees are kept for the next backward, still charged, and dropped
  first when the pool needs room ([Note: buffer reuse] in hf_elixir/chunk/_grad_buffers.py): they never cause an
  eviction or a finished reduce, only fill the pool. :func:`_kept_peak` replays them over the step's pool
  events (buffers taken and freed, room made, peaks), from none kept and then from what one step left (the
  steady state), and the model-data peak is the replay's.
"""

from __future__ import annotations

from dataclasses import replace

from hf_elixir.chunk.chunk import refresh_staging_numel
from hf_elixir.search._activation_cost import DTYPE_BYTES
from hf_elixir.search._chunked_step import _INF, ChunkedStep, Knobs
from hf_elixir.search._rates import _uploaded_chunks, casts_on_device

__all__ = ["fixed_memory", "host_copies_forced", "optim_bytes_per_numel", "refresh_staging_bytes",
           "resolve_host_copies"]


def optim_bytes_per_numel(precision: str, master: bool = False, optim_states: int = 2) -> int:
    """Device bytes per shard element of one chunk's optimizer state: fp32 gradient shard + ``optim_states``
    fp32 states (+ fp32 master when ``master`` or the precision is not fp32)."""
    return 4 + 4 * optim_states + (4 if (master or precision != "fp32") else 0)


def host_copies_forced(step: ChunkedStep, activations_on_device: bool) -> bool:
    """Whether the runtime keeps a rank-local host copy of every offloadable chunk whatever the plan says
    (``hf_elixir.placement.choose_host_copies``): several ranks, sharded, and either a pool that charges
    activations (``activations_on_device``: each rank's batch decides what its activations evict, so a chunk
    evicted on one rank only must refill locally) or MoE experts (``ChunkedStep.gather_prefetch`` off). The
    cost model then prices the copies (their host bytes, the copy at eviction, local refills instead of
    re-gathers) for every point, as the runtime runs it; see :func:`resolve_host_copies` for where they do not
    fit the host."""
    return step.world_size > 1 and not step.replicated and (activations_on_device or not step.gather_prefetch)


def resolve_host_copies(step: ChunkedStep, knobs: Knobs, activations_on_device: bool,
                        host_budget_bytes: int | None) -> Knobs:
    """``knobs`` with the rank-local host copies the runtime keeps (``hf_elixir.placement.choose_host_copies``):
    forced ones (:func:`host_copies_forced`) where the pool charging activations is the reason only while they
    fit ``host_budget_bytes`` (this rank's host memory; ``None``: no bound) beside the other host bytes, as the
    runtime decides; where they do not, it keeps none (and warns that batches must have the same shapes on every
    rank), and so is the point priced: the cheaper variant, not a point that no host fits. MoE experts in
    subtree units force them whatever the host holds."""
    if knobs.host_copies or not host_copies_forced(step, activations_on_device):
        return knobs
    copies = replace(knobs, host_copies=True)
    if host_budget_bytes is None or not step.gather_prefetch:
        return copies
    return copies if fixed_memory(step, copies)[1] <= host_budget_bytes else knobs


def refresh_staging_bytes(step: ChunkedStep, knobs: Knobs) -> int:
    """Device bytes of the fp32 staging buffer the uploads cast on the device share (``ElixirOptimizer`` charges
    them for the whole run: :func:`hf_elixir.chunk.chunk.refresh_staging_numel`); 0 with the cast on the host."""
    if not casts_on_device(step, knobs):
        return 0
    return 4 * refresh_staging_numel([step.shard_numel(c) for c in _uploaded_chunks(step, knobs)])


def fixed_memory(step: ChunkedStep, knobs: Knobs) -> tuple[int, int, dict[str, int]]:
    """(fixed device bytes, host bytes, breakdown) per rank; see [Note: memory accounting]. Memoised per knobs on
    the step (the search asks for the same knobs many times; a ``ChunkedStep`` is not changed once built)."""
    memo = step.__dict__.setdefault("_fixed_memory_memo", {})
    if knobs not in memo:
        memo[knobs] = _fixed_memory(step, knobs)
    fixed, host, breakdown = memo[knobs]
    return fixed, host, dict(breakdown)


def _fixed_memory(step: ChunkedStep, knobs: Knobs) -> tuple[int, int, dict[str, int]]:
    b = DTYPE_BYTES[step.precision]
    ws = step.world_size
    held = knobs.resident | knobs.device_shard
    if ws == 1:
        resident = sum(step.full_bytes(c) for c in held)
        shards = 0
    else:  # a resident chunk's shard is a view into its full buffer (Chunk.shard_in_full); a chunk whole on its
        # rank (an expert chunk at ep = world size) has its shard as its full buffer
        resident = sum(step.full_bytes(c) for c in knobs.resident)
        shards = sum(step.shard_numel(c) * b for c in knobs.device_shard - knobs.resident)
    optim = host_optim = 0
    for c in range(step.num_chunks):
        if not step.trained_numels[c]:
            continue
        if c in knobs.device_optim:
            optim += step.shard_numel(c) * optim_bytes_per_numel(step.precision, c not in held, step.optim_states)
        else:
            host_optim += step.shard_numel(c) * optim_bytes_per_numel(step.precision, c in held, step.optim_states)
            if c in held and step.precision != "fp32" and not casts_on_device(step, knobs):
                host_optim += step.shard_numel(c) * b  # the upload's host staging buffer ([Note: overlapped refresh])
    host_params = sum(step.shard_numel(c) * b for c in range(step.num_chunks) if c not in held)
    if ws > 1 and knobs.host_copies:  # rank-local refill copies of evicted unsharded chunks (sharded ones only)
        host_params += sum(step.full_bytes(c) for c in range(step.num_chunks)
                           if c not in knobs.resident and step.group_size(c) > 1)
    staging = refresh_staging_bytes(step, knobs)  # [Note: refresh cast]
    breakdown = {"resident_chunks": resident, "device_shards": shards, "device_optimizer": optim,
                 "refresh_staging": staging}
    return resident + shards + optim + staging, host_params + host_optim, breakdown


def _backward_room(step: ChunkedStep, k: int, depth: int, cached: dict[int, int], last_seen: dict[int, float],
                   free: int) -> bool:
    """Whether the backward all-gather of event ``k`` goes ahead ([Note: overlap]): ``free`` pool bytes (after
    it) plus the cached trained chunks with no later use, other than those the events since the runtime's
    decision (``depth`` events earlier, when they were pinned or in its window) access, are not negative; and
    that decision was made in backward too."""
    if step.event_phase[k - depth] != "bwd":
        return False
    window = {c for j in range(k - depth, k + 1) for c in step.groups[j]}
    dead = sum(n for c, n in cached.items() if c not in window and last_seen.get(c, _INF) == _INF
               and step.trained_numels[c])
    return free + dead >= 0


def _kept_peak(log: list[tuple], pool_bytes: int, kept: dict[int, int]) -> tuple[int, dict[int, int]]:
    """Replay ``predict``'s pool events with the gradient buffers kept off CUDA ([Note: buffer reuse] in
    hf_elixir/chunk/manager.py), starting from ``kept`` (buffer bytes -> how many): a buffer taken reuses a
    kept one of its size (no room made), a freed one is kept, making room drops kept buffers (largest first)
    before anything else. Returns the peak of the model's bytes plus the kept ones, and what is kept at the end."""
    kept = dict(kept)
    held = sum(size * count for size, count in kept.items())
    peak = 0
    reused = False
    for event in log:
        if event[0] == "take":
            reused = kept.get(event[1], 0) > 0
            if reused:
                kept[event[1]] -= 1
                held -= event[1]
        elif event[0] == "free":
            kept[event[1]] = kept.get(event[1], 0) + 1
            held += event[1]
        elif event[0] == "room":
            if reused:  # the manager made no room for a reused buffer
                continue
            _, nbytes, used = event
            for size in sorted(kept, reverse=True):
                while kept[size] and used + held + nbytes > pool_bytes:
                    kept[size] -= 1
                    held -= size
        else:
            peak = max(peak, event[1] + held)
            reused = False
    return peak, kept
