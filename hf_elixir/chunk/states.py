"""Per-parameter tensor states and per-chunk storage states, each with one declared transition table.

[Note: tensor states] A parameter's state says where its data is and who may touch it:

* ``FREE``: its chunk is resharded; the parameter's storage is empty (only the shard exists).
* ``HOLD``: its chunk is unsharded (data valid on the compute device) and nobody uses it.
* ``COMPUTE``: a module's forward or backward is using it; its chunk is pinned (never evicted).
* ``HOLD_AFTER_FWD``: used by a forward in this step; data still valid; evictable.
* ``HOLD_AFTER_BWD``: its gradient of this backward has been reduced; data valid; evictable.
* ``READY_FOR_REDUCE``: its gradient sits in the chunk's gradient buffer, waiting for the chunk's
  reduce-scatter.

Source: PatrickStar (arXiv 2108.05818) section 4.2 and ColossalAI Gemini's ``TensorState``.

[Note: chunk states] What a chunk's gathered buffer ``full`` holds (FSDP2's ``ShardedState``, with the in-flight
gather made explicit):

* ``SHARDED``: ``full``'s storage is freed; only this rank's shard exists (before ``materialize`` too).
* ``GATHERING``: ``full`` is allocated and an all-gather issued ahead (``async_op``) is still filling it; the
  parameters are stale placeholders until ``wait_ready``.
* ``GATHERED``: ``full`` holds the gathered values (current, or stale after a step until the next unshard
  refills it: ``full_version``).
* ``ALIAS``: one rank with the shard on the device: ``full`` *is* the shard, never freed.

:class:`~hf_elixir.chunk.chunk.Chunk` derives its state from its fields (``state``) and asserts every move of its
verbs (``materialize``, ``unshard``, ``wait_ready``, ``reshard``) against :data:`CHUNK_TRANSITIONS`.
"""

from __future__ import annotations

import enum

__all__ = ["CHUNK_TRANSITIONS", "ChunkState", "TensorState", "TRANSITIONS", "check_chunk_transition",
           "check_transition"]


class TensorState(enum.Enum):
    # [Note: identity hash of states] members are singletons compared by identity, so the C-level identity hash
    # serves the transition tables' lookups; ``Enum.__hash__`` is Python code hashing the name, run on every state
    # move (thousands a step on the hooks' path)
    __hash__ = object.__hash__

    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"
    READY_FOR_REDUCE = "ready_for_reduce"


_S = TensorState
_HOLDS = (_S.HOLD, _S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD)

#: allowed ``old -> {new}`` moves. COMPUTE -> COMPUTE is a nested or repeated use (a module called
#: twice, a tied parameter used by two modules, recomputation under activation checkpointing).
#: FREE -> READY_FOR_REDUCE and back: a gradient can arrive after its chunk was evicted (gradients
#: live in the chunk's own buffer, not in its data): e.g. a tied embedding weight, whose last
#: contribution comes from ``nn.Embedding``'s backward, which never unshards (see runtime/hooks.py).
TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    _S.FREE: frozenset({_S.HOLD, _S.READY_FOR_REDUCE}),
    _S.HOLD: frozenset({_S.FREE, _S.COMPUTE, _S.HOLD, _S.READY_FOR_REDUCE}),
    _S.COMPUTE: frozenset({_S.COMPUTE, _S.HOLD, _S.HOLD_AFTER_FWD, _S.HOLD_AFTER_BWD, _S.READY_FOR_REDUCE}),
    _S.HOLD_AFTER_FWD: frozenset({_S.FREE, _S.COMPUTE, _S.HOLD, _S.HOLD_AFTER_FWD, _S.READY_FOR_REDUCE}),
    _S.HOLD_AFTER_BWD: frozenset({_S.FREE, _S.COMPUTE, _S.HOLD, _S.HOLD_AFTER_BWD, _S.READY_FOR_REDUCE}),
    _S.READY_FOR_REDUCE: frozenset({_S.READY_FOR_REDUCE, _S.HOLD_AFTER_BWD, _S.COMPUTE, _S.FREE}),
}


def check_transition(old: TensorState, new: TensorState, what: str = "") -> None:
    """Assert ``old -> new`` is in :data:`TRANSITIONS` (an internal invariant, not a user error)."""
    assert new in TRANSITIONS[old], f"illegal tensor-state transition {old.name} -> {new.name} {what}"


class ChunkState(enum.Enum):
    """What a chunk's gathered buffer holds ([Note: chunk states])."""

    __hash__ = object.__hash__  # [Note: identity hash of states]

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    ALIAS = "alias"


_C = ChunkState

#: allowed ``old -> {new}`` moves of a chunk's verbs. GATHERED -> GATHERED / GATHERING: a stale gathered copy
#: refilled in place (after a step bumped the shard's version); SHARDED -> SHARDED: a reshard of a chunk already
#: resharded, or an unshard that did not need a fill; ALIAS -> ALIAS: every verb of a one-rank device chunk;
#: ALIAS -> GATHERED: its shard offloaded to the host between steps, the buffer kept as the gathered copy (a frozen
#: chunk re-placed to make room for another model: [Note: re-placing for a newcomer] in ``_shared_budget.py``).
CHUNK_TRANSITIONS: dict[ChunkState, frozenset[ChunkState]] = {
    _C.SHARDED: frozenset({_C.SHARDED, _C.GATHERING, _C.GATHERED, _C.ALIAS}),
    _C.GATHERING: frozenset({_C.GATHERING, _C.GATHERED}),
    _C.GATHERED: frozenset({_C.GATHERED, _C.GATHERING, _C.SHARDED}),
    _C.ALIAS: frozenset({_C.ALIAS, _C.GATHERED}),
}


def check_chunk_transition(old: ChunkState, new: ChunkState, what: str = "") -> None:
    """Assert ``old -> new`` is in :data:`CHUNK_TRANSITIONS` (an internal invariant, not a user error)."""
    assert new in CHUNK_TRANSITIONS[old], f"illegal chunk-state transition {old.name} -> {new.name} {what}"
