"""All-gathers issued ahead as every rank agreed, for a device pool that charges activations (a whole-device
budget): the rule of [Note: gather prefetch] (``_prefetch.py``) does not hold there.

[Note: agreed gathers ahead] (gathers ahead on a real GPU, whose budget covers activations.) A pool that charges
activations is rank-local: each rank's batch decides how much room its forward leaves, so the rule of [Note: gather
prefetch] (a decision every rank computes alike) does not hold. The runtime then keeps a rank-local host copy of every
offloadable chunk (``keep_host_copy``, ``hf_elixir/placement/_device_placement.py``): after a chunk's first all-gather
of a step, every refill is a local onload, so the step's all-gathers are exactly the first unshards in forward order,
the same on every rank; only *when* each is issued can differ. Collectives on one group must still be issued in one
order on every rank (and on NCCL, interleaved alike with the collectives of other groups), so which gathers run ahead is
agreed, one step late:

* in forward, where a chunk that still needs its all-gather first enters the prefetch window
  (``prefetch_depth`` chunks of the previous step's order, within the forward), each rank records whether its
  pool has room for it without evicting a chunk used before it (free bytes, kept gradient buffers, and
  evictable chunks not in the window whose next use comes later): ``_ahead_room``. Evaluation forwards
  between steps do not vote;
* the votes ride the has-gradient flags' all-reduce (MAX of 1 "no room", 0 "room", -1 "no vote") and the
  step's one host read brings them back (``ElixirOptimizer._read_step_state`` -> :meth:`agree_gathers_ahead`):
  the chunks every rank had room for, the same set on every rank. A chunk no rank voted on keeps the last
  agreement: an evaluation forward between steps issues the agreed gathers (its chunks then need none in the
  training forward, so nothing votes), and dropping them would leave every step after an evaluation without
  gathers ahead (``Trainer`` with ``eval_steps``); a vote of "room" from some ranks and none from others
  agrees (whether a chunk needs its all-gather is the same on every rank);
* in the next step each rank issues exactly those gathers ahead, at the same window positions, in the same
  order (whatever its local onloads ahead do), making room rank-locally with Belady's victims (safe: with the
  copies an eviction costs a local refill, never a collective). Where this batch left less room than the
  previous one, that may evict a chunk used before the gathered one (counted,
  ``num_agreed_gather_evictions``; its vote then says no room); where no eviction makes room at all the
  access raises :class:`DeviceBudgetExceededError` (the hook would need that room moments later too).

So prefetch starts with the third step (the first has no order, the second votes), backward keeps its
refills local (no gather ahead there), and a model prepared without an optimizer (no step to agree at)
keeps its gathers in the hooks under such a pool. Test: ``tests/test_activation_budget_ranks.py`` (ranks
with different batch shapes: no hang, the same gathers issued ahead, parity with PyTorch).
"""

from __future__ import annotations

import bisect

import torch

from hf_elixir.chunk.chunk import Chunk

__all__ = ["AgreedGathersMixin"]


class AgreedGathersMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s agreed gathers ahead (a mixin: the votes are cast inside
    the manager's prefetch and ride the has-gradient flags' all-reduce, ``_rank_checks.py``)."""

    def _init_agreed_gathers(self) -> None:
        # [Note: agreed gathers ahead] this step's votes (chunk id -> room for its gather ahead), the chunks every
        # rank voted for at the last step (issued ahead now), and the merged "no room" votes (on the compute
        # device, [num_chunks], read by the step's host read)
        self._ahead_room: dict[int, bool] = {}
        self._ahead_agreed: frozenset[int] = frozenset()
        self.ahead_veto = torch.zeros(0, device=self.compute_device)
        self._voter_indices: dict[int, torch.Tensor] = {}

    def _agreed_gathers_ahead(self, pos: int, pinned: set[int], upcoming: list[tuple[int, int]],
                              keep: set[int]) -> None:
        """[Note: agreed gathers ahead] In forward, for each chunk of the prefetch window ``upcoming``
        (``(position in the previous step's order, chunk id)``) that still needs its all-gather: record this
        rank's vote (room without evicting a chunk used sooner) the first time, and issue the gather now when
        every rank voted for it at the last step, making room by Belady's victims (never one of ``pinned``).

        Raises:
            DeviceBudgetExceededError: no eviction makes room for an agreed gather (this rank's activations
                leave less than the batch it voted with).
        """
        if self.backward_pending or not self.prev_forward_ends:
            return
        i = bisect.bisect_right(self.prev_forward_ends, pos)
        end = self.prev_forward_ends[i] if i < len(self.prev_forward_ends) else len(self.prev_trace)
        for index, cid in upcoming:
            chunk = self.chunks[cid]
            if index >= end or not chunk.needs_collective():
                continue
            if cid in self._ahead_room and cid not in self._ahead_agreed:
                continue  # voted at its first window position; its gather waits for its hook
            need = chunk.fill_bytes_needed()
            room = self._room_ahead(chunk, need, keep)
            if self._outer_trace is None:  # an evaluation forward between steps does not vote
                self._ahead_room.setdefault(cid, room)
            if cid not in self._ahead_agreed:
                continue
            evictions = self.counters.num_evictions
            self.make_room(need, f"chunk {cid}, all-gathered ahead of its use as every rank agreed at the last "
                           "optimizer step ([Note: agreed gathers ahead] in hf_elixir/chunk/_agreed_gathers.py; this "
                           "rank's "
                           "batch saved more activations than the one it voted with)", exclude=pinned)
            if not room:
                self.counters.num_agreed_gather_evictions += self.counters.num_evictions - evictions
            if self.recorder is not None:
                self.record_event("fill", chunk)
            chunk.unshard(side_stream=self.copy_stream, async_op=self.prefetcher.async_gather)
            self.counters.num_prefetches += 1
            self.counters.num_prefetched_gathers += 1
            if chunk.pending_gather is not None:
                self.prefetcher.pending.append(chunk)

    def _room_ahead(self, chunk: Chunk, need: int, keep: set[int]) -> bool:
        """Whether ``need`` more bytes for ``chunk`` fit the pool after dropping kept gradient buffers and
        evicting only chunks outside ``keep`` whose next use comes after ``chunk``'s ([Note: agreed gathers
        ahead])."""
        if self.pool.fits(need):
            return True
        self.sync_activation_bytes()  # activations freed since the last count give their room back
        target = self._next_use(chunk)
        spare = self.kept_buffer_bytes + sum(c.full_bytes for c in self.chunks if c.evictable and c.chunk_id not in keep
                                             and self._next_use(c) > target)
        return self.pool.used_bytes + need <= self.pool.budget_bytes + spare

    def agree_gathers_ahead(self, veto: list[float]) -> None:
        """The step's host read of the merged votes (``ahead_veto``, one per chunk: > 0 where some rank had no
        room, 0 where every voting rank had room, < 0 where no rank voted: the last agreement stands): the
        chunks whose all-gathers the next step issues ahead ([Note: agreed gathers ahead]). The same list and
        the same last agreement, so the same set, on every rank."""
        self._ahead_agreed = frozenset(cid for cid, v in enumerate(veto)
                                       if v == 0 or (v < 0 and cid in self._ahead_agreed))
        self._ahead_room = {}

    def _ahead_votes(self, group) -> list[float]:
        """This rank's votes for the chunks gathered over ``group``, by chunk id: 1.0 no room, 0.0 room, -1.0 no
        vote this step (none outside the agreed mode): [Note: agreed gathers ahead]."""
        if self.gather_prefetch_mode() != "agreed":
            return []
        return [-1.0 if c.chunk_id not in self._ahead_room else 0.0 if self._ahead_room[c.chunk_id] else 1.0
                for c in self._voters(group)]

    def _voters(self, group) -> list[Chunk]:
        return [c for c in self.chunks if c.world_size > 1 and c.group is group]

    def _voter_index(self, group) -> torch.Tensor:
        """The chunk ids of :meth:`_voters` as an int64 tensor on the compute device (uploaded once per group)."""
        index = self._voter_indices.get(id(group))
        if index is None:
            ids = torch.tensor([c.chunk_id for c in self._voters(group)], dtype=torch.int64)
            index = self._voter_indices[id(group)] = ids.to(self.compute_device, non_blocking=True)
        return index
