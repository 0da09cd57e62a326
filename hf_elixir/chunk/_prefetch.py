"""Gathers and onloads issued ahead of their use by the chunk manager (FSDP2's prefetch), in forward and backward:
the :class:`PrefetchScheduler`, one object per manager, executing the previous step's :class:`~hf_elixir.chunk.schedule.
StepOrder` ([Note: one step description] in ``schedule.py``: the cost model builds the same order from the profile
and prices the fills, evictions and reduces the runtime executes, which a test compares).

[Note: gather prefetch] (FSDP2's all-gather prefetch.) During forward, :meth:`PrefetchScheduler.issue`
issues the all-gathers of the next ``prefetch_depth`` chunks of the previous step's order ahead of their
use: on CUDA on the copy stream (the compute stream waits for its event), elsewhere with ``async_op=True``
(gloo runs it on its own threads while this thread computes). The chunk's pre-forward access waits for it
(:meth:`Chunk.wait_ready`, timed into ``gather_wait_s``). Collectives on one group must be issued in the same
order on every rank, so a rank may issue a gather ahead only where every rank does the same:

* the decision reads only the previous step's trace, the agreed plan and the agreed budget, through the
  pool's accounting and Belady's victim choice. That state is identical on every rank when the pool
  charges model data only (an explicit ``device_memory_budget_bytes``; a whole-device budget also charges
  activations, which are rank-local) and every rank accesses the same chunks in the same order, which holds
  for dense models. A model with MoE-expert chunks (``subtree_only`` / ``host_copy_required``: backward
  touches them only where experts got tokens, so pool states drift apart) gets no gather prefetch: its
  gathers stay in the hooks, where they already agree. A pool that charges activations (a whole-device
  budget) follows [Note: agreed gathers ahead] (``_agreed_gathers.py``) instead. Never free memory, timing,
  or whether a collective has finished (waits happen at fixed points: the chunk's access, its eviction, the
  start of backward, the optimizer step);
* a gather ahead evicts only what the hook of its chunk would evict anyway ([Note: Belady-consistent gather
  ahead] in :meth:`PrefetchScheduler._kept_until`), so prefetching issues the same gathers as the hooks alone, only earlier
  (what the cost model assumes);
* within one phase: in forward the window stops where the previous step's forward (micro-batch) ended, so
  no rank issues a gather ahead of the backward's reduce-scatters; in backward it stops where that step's
  backward ended, under the stricter room rule of [Note: backward gather prefetch];
* nothing reads an unfilled buffer: the parameters stay stale placeholders until the wait, eviction and
  ``unshard`` wait first, and the start of backward and the optimizer step drain every pending gather.

[Note: backward gather prefetch] In backward the re-gathers of evicted chunks without a host copy are issued
ahead too (FSDP2's backward prefetch), on the same terms as in forward (previous trace, agreed plan and
budget; off for MoE and for a pool that charges activations; pending gathers drained at eviction, unshard,
the end of backward and the step). Backward also charges and frees gradient buffers and reduce-scatter
outputs between two accesses (and finishes reduces when the pool is short), so Belady's argument above does
not carry over: a gather ahead could evict a chunk the hooks alone would have kept, or be evicted itself
before its use. A backward gather ahead is therefore issued only when its bytes, plus those of the chunks
of the window that the hooks will still fill, plus the rise of gradient-buffer and reduce-output bytes the
previous step saw up to the chunk's access (``prev_grad_at``: bytes at each access and the peak since the
one before), fit in the free budget plus the chunks this step no longer uses (``ChunkManager._dead``: trainable,
no later use in the previous trace, so the step makes their gathered copy stale anyway); it evicts only
those. Every later make-room in the window then finds its room among free and dead bytes, which Belady
evicts first, so no chunk the step still uses leaves the device earlier than without the prefetch: the
same all-gathers, only issued ahead. All of this is the same on every rank for dense models with a
model-data budget (the gradient charges follow the autograd graph, identical on every rank). At the
tightest budgets there is no such room and backward gathers stay in the hooks.

``num_prefetched_gathers`` counts gathers issued ahead, ``num_blocking_gathers`` those issued inside an
access for the chunk it needs (the compute waits for the whole collective).
"""

from __future__ import annotations

from hf_elixir.chunk.chunk import Chunk

__all__ = ["PrefetchScheduler"]

_INF = float("inf")


class PrefetchScheduler:
    """The chunk manager's gathers and onloads ahead of their use (FSDP2's prefetch), as an object.

    It executes the previous step's order (``manager.prev_order``, a :class:`~hf_elixir.chunk.schedule.StepOrder`):
    at each access it fills the next ``prefetch_depth`` chunks of :meth:`StepOrder.window` that the rules above
    allow. Every decision reads only the manager's trace, agreed plan, pool accounting and eviction ranking
    (``_victim``, ``_belady_key``, ``_next_use``, ``_dead``), which is what makes it the same on every rank; it owns
    the all-gathers it issued asynchronously (``pending``) until :meth:`drain`.

    Args:
        manager: the :class:`~hf_elixir.chunk.manager.ChunkManager` whose chunks it fills.
    """

    def __init__(self, manager) -> None:
        self.manager = manager
        # off CUDA, all-gathers issued ahead are async collectives waited at the chunk's access
        self.async_gather = manager.compute_device.type != "cuda"
        self.pending: list[Chunk] = []

    def issue(self, pinned: set[int]) -> None:
        """Unshard the next ``prefetch_depth`` chunks of the previous step's order, when that does not
        evict a chunk needed sooner than the prefetched one; all-gathers only where
        [Note: gather prefetch] allows (in backward: [Note: backward gather prefetch])."""
        m = self.manager
        pos = len(m.trace)
        upcoming = m.prev_order.window(pos, pinned, m.prefetch_depth)  # (position in prev_trace, chunk id)
        # all resident (or already filled): nothing below acts on a chunk that needs no fill (a collective implies a
        # fill), so the window's rules are not evaluated at every module's access
        if not any(m.chunks[cid].needs_fill() for _, cid in upcoming):
            return
        gather_end = self._gather_window_end(pos)
        keep = pinned | {cid for _, cid in upcoming}
        if self.mode() == "agreed":
            m._agreed_gathers_ahead(pos, pinned, upcoming, keep)  # the loop below then onloads only
        fills_before = 0  # bytes the hooks will charge for upcoming chunks not filled here ([Note: backward ...])
        for index, cid in upcoming:
            chunk = m.chunks[cid]
            if not chunk.needs_fill():
                continue
            collective = chunk.needs_collective()
            if not collective and m.forward_steps and m.copy_stream is None:
                # [Note: forward steps] in _steps.py: a local onload ahead off CUDA overlaps nothing, it only evicts
                return
            need = chunk.fill_bytes_needed()
            if collective and (index >= gather_end or (m.backward_pending
                                                       and not self._backward_room(need + fills_before, pos, index))):
                fills_before += need
                continue  # not this phase's, not allowed, or no room (see [Note: gather prefetch])
            if not self._make_room(chunk, need, collective, pinned, upcoming, index, keep):
                return  # prefetching would evict something needed sooner: stop
            self._fill(chunk, collective)

    def _make_room(self, chunk: Chunk, need: int, collective: bool, pinned: set[int],
                   upcoming: list[tuple[int, int]], index: int, keep: set[int]) -> bool:
        """Evict for a fill ahead of ``chunk`` (used at ``index``) only what the rules above allow; ``False`` where
        that would evict a chunk needed sooner (nothing more is prefetched then)."""
        m = self.manager
        dead_only = collective and m.backward_pending  # [Note: backward gather prefetch]
        if m.kept_buffer_bytes and not m.pool.fits(need):
            # what the hook's make_room drops first too ([Note: buffer reuse] in _grad_buffers.py)
            m.drop_kept_buffers(need)
        beyond = (self._kept_until(pinned, upcoming, index, chunk.chunk_id)
                  if collective and not dead_only and not m.pool.fits(need) else None)
        while not m.pool.fits(need):
            victim = m._dead_victim() if dead_only else m._victim(keep, beyond=beyond)
            if victim is None or m._next_use(victim) <= m._next_use(chunk):
                return False
            victim.reshard()
        return True

    def _fill(self, chunk: Chunk, collective: bool) -> None:
        m = self.manager
        if m.recorder is not None:
            m.record_event("fill", chunk)
        chunk.unshard(side_stream=m.copy_stream, async_op=collective and self.async_gather)
        m.counters.num_prefetches += 1
        if collective:
            m.counters.num_prefetched_gathers += 1
        if chunk.pending_gather is not None:
            self.pending.append(chunk)

    def _kept_until(self, pinned: set[int], upcoming: list[tuple[int, int]], index: int,
                    target: int) -> tuple[float, int]:
        """[Note: Belady-consistent gather ahead] A gather issued ahead for chunk ``target``, used at position
        ``index`` of the previous step's order, may evict only a chunk Belady ranks above every rival: a chunk
        the hook at ``index`` could evict instead, i.e. one of ``pinned`` (pinned now) or of ``upcoming`` (the
        prefetch window, ``(position, chunk id)``) that will be on the device and unpinned then (on it now, or
        used before ``index``; not ``target``, which its hook pins, nor a resident chunk), as that hook will rank
        them: used after every rival is next used after ``index``, or, where a rival is not used again either,
        less recently than it (the accesses up to ``index`` are of rivals, which only makes them more recent).
        When that hook makes room, such a chunk is Belady's first victim anyway (nothing in forward frees memory
        in between), so issuing the gather early evicts what the hook would, and adds no all-gather. The tie
        matters where the chunk just used is never used again (a forward without backward, [Note: forward
        steps]): the hook would evict an older such chunk, not it. Returns that Belady key
        (``ChunkManager._belady_key``), ``(-inf, 0)`` without a rival."""
        m = self.manager
        before = {cid for position, cid in upcoming if position < index}
        rivals = [m.chunks[cid] for cid in pinned | {cid for _, cid in upcoming}
                  if cid != target and (cid in before or m.chunks[cid].unsharded)]
        return max((m._belady_key(c, after=index) for c in rivals if not (c.resident or c.full_alias)),
                   default=(-_INF, 0))

    def _backward_room(self, need: int, pos: int, index: int) -> bool:
        """[Note: backward gather prefetch] Whether ``need`` bytes, plus the gradient buffers and reduce
        outputs the previous step charged between positions ``pos - 1`` and ``index`` of its trace, fit in
        the free budget plus the chunks this step uses no more (``ChunkManager._dead``)."""
        m = self.manager
        if m.pool.budget_bytes is None:
            return True
        if not 0 < pos <= index < len(m.prev_grad_at):
            return False
        at = m.prev_grad_at
        reserve = max(0, max(peak for _, peak in at[pos:index + 1]) - m._grad_live_bytes)
        dead = sum(c.full_bytes for c in m.chunks if m._dead(c))
        # kept gradient buffers ([Note: buffer reuse] in _grad_buffers.py) are room: the rise reuses them, make_room
        # drops the rest
        used = m.pool.used_bytes - m.kept_buffer_bytes
        return used + need + reserve <= m.pool.budget_bytes + dead

    def mode(self) -> str | None:
        """How all-gathers may be issued ahead: ``"fixed"`` (a pool that charges model data only: every rank
        computes the same decisions, [Note: gather prefetch]), ``"agreed"`` (a pool that charges activations,
        in training, every offloadable chunk with a rank-local host copy: [Note: agreed gathers ahead] in
        ``_agreed_gathers.py``), or ``None`` (in the hooks only: MoE-expert chunks, or such a pool without the copies
        or an optimizer)."""
        m = self.manager
        if any(c.subtree_only or c.host_copy_required for c in m.chunks):
            return None
        if not m.pool.charges_activations:
            return "fixed"
        if m.forward_steps:
            return None
        if all(c.keep_host_copy for c in m.chunks if c.world_size > 1 and not c.resident):
            return "agreed"
        return None

    def allowed(self) -> bool:
        """Whether any all-gather may be issued ahead (:meth:`mode` is not ``None``)."""
        return self.mode() is not None

    def _gather_window_end(self, pos: int) -> int:
        """The first position of the previous step's trace, at or after ``pos``, whose chunk may not be
        all-gathered ahead by the rule every rank computes alike: where the forward or backward running now
        ended in that step (``pos`` itself unless :meth:`mode` is ``"fixed"``; the agreed mode issues its gathers
        in ``ChunkManager._agreed_gathers_ahead``), :meth:`StepOrder.window_end`."""
        if self.mode() != "fixed":
            return pos
        # without such a phase in the previous step (a backward after forward steps) its order says nothing: ``pos``
        return self.manager.prev_order.window_end(pos, backward=self.manager.backward_pending)

    def drain(self) -> None:
        """Wait for every all-gather issued ahead (at the start of backward and at the optimizer step: a
        prefetched chunk that forward did not use)."""
        for chunk in self.pending:
            chunk.wait_ready()
        self.pending = []
