"""One device budget for several models of one run (policy + reference, policy + value, student + teacher).

[Note: one device budget for several models]

``ElixirConfig.device_memory_budget_bytes`` is the whole card (docs/design/rules.md: the budget is the whole card). Two
models prepared one after the other, each with its own chunk manager and pool, used to get the whole budget each:
two pools of ``B`` bytes on a card of ``B`` bytes, which the CPU simulation let pass and a GPU would not. Models
prepared inside one :class:`SharedDeviceBudget` (``with hf_elixir.shared_device_budget() as budget:``; the
accelerate binding keeps one per ``Accelerator``, so ``accelerator.prepare``, ``ElixirPlugin`` and the Trainer
callback share it without a word from the user) divide one budget:

* the first model is placed in the whole budget ``B`` (the agreed one: the smallest over the ranks);
* placement records what each model *commits*: the bytes it cannot give back (resident chunks, shards and
  optimizer states kept on the device, the working set of two adjacent units, the activations it reserves),
  not its cache of gathered chunks (``placement/_device_placement.py: committed_bytes``);
* a later model is placed beside the earlier ones, which are re-placed to make room for it where they must be
  ([Note: re-placing for a newcomer] below); once it is placed, what no model commits is divided equally among
  all of them (room for activations, which the budget covers, and for caches), and every pool's budget becomes its
  committed bytes plus its share, an earlier model's cache beyond that evicted at once. The pools' budgets then add
  up to at most ``B``, and each one is enforced as before (a charge over it evicts, or raises
  ``DeviceBudgetExceededError``).
* a later model that does not fit even with the earlier ones re-placed raises ``ValueError`` naming every model's
  need, their sum and the budget.

[Note: re-placing for a newcomer] Placed one after the other, the first model took what it wanted of the whole
budget (everything resident, when that fit) and the next one got what was left: it was refused, or trained from a
sliver of cache, though the two fitted together. So the group counts the models together when one joins: each model
has a *floor* (an earlier model's: what it commits once its movable chunks are re-placed off the device; the
newcomer's: its placement floor) and a *want* (an earlier model's: what it commits now; the newcomer's: what it
commits with every chunk resident, ``wanted_bytes``), activations reserved included in both. When the wants fit,
nothing moves and the newcomer is placed in what the others leave, as before. Else, when the floors fit, the room
above the floors is split in proportion to each model's want above its floor: the newcomer is placed in its floor
plus its part, and each earlier model gives back chunks until it commits at most its floor plus its part. Else the
newcomer is refused, naming each model's floor and want. The movable chunks are an earlier model's *frozen* chunks
(no gradient, optimizer state or fp32 master refers to their buffers: every chunk of a model prepared without an
optimizer, such as a reference or a teacher, and a LoRA model's base), not replicated, not in use: each one
re-placed goes from resident (or its shard on the device) to its shard on the host, its gathered buffer left as
cache that the pool evicts when its budget says so (:func:`offload_frozen_chunk`; the copy counts in ``d2h_bytes``).
The last chunks in the model's order go first. Trainable chunks are not moved (their placement is woven into the
optimizer's states and masters); a model whose chunks cannot give enough back keeps its room, and the newcomer gets
less or is refused. This happens only inside ``prepare`` of the newcomer, between steps: an earlier model in the
middle of a step (its step trace begun, or gradients not yet stepped) is not re-placed at all.

A frozen model (``prepare(model, None)``) commits its compute-dtype shards and working set only: no gradient
buffers, optimizer states or fp32 masters exist for it (``chunk/_build.py``, [Note: fp32 masters at prepare]).
Without a budget (``None`` off CUDA: unlimited) there is nothing to divide. A model that is garbage-collected
leaves the group (weak references); the room it committed goes to the next model prepared.
"""

from __future__ import annotations

import contextvars
import logging
import weakref

import torch.distributed as dist

__all__ = ["SharedDeviceBudget", "current_shared_budget", "offload_frozen_chunk"]

logger = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar["SharedDeviceBudget | None"] = contextvars.ContextVar("hf_elixir_shared_budget",
                                                                                       default=None)


class SharedDeviceBudget:
    """Models prepared while this object is entered (``with budget:``) share one device budget ([Note: one device
    budget for several models]). Re-enterable: enter it again around each later ``prepare``.

    Attributes:
        budget_bytes: the device budget the group divides (the first model's agreed budget), ``None`` before the
            first model joins or when it has none.
    """

    def __init__(self) -> None:
        self.budget_bytes: int | None = None
        self._members: list[tuple[weakref.ref, str]] = []  # (the model's chunk manager, its label)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> "SharedDeviceBudget":
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())

    def members(self) -> list[tuple[object, str]]:
        """The live members' ``(chunk manager, label)``, in the order they joined."""
        live = [(ref(), label) for ref, label in self._members]
        self._members = [(weakref.ref(m), label) for m, label in live if m is not None]
        return [(m, label) for m, label in live if m is not None]

    def committed_by_others(self) -> int:
        """Bytes the members commit on the device at the least, once re-placed (what a newcomer cannot use)."""
        return sum(_floor(manager) for manager, _ in self.members())

    def budget_for(self, budget_bytes: int | None, measured: bool) -> int | None:
        """The most a newcomer may be placed in: the group's budget less the members' floors ([Note: re-placing
        for a newcomer]); ``budget_bytes`` (this model's own agreed budget) caps it when given explicitly
        (``measured=False``)."""
        if not self.members() or self.budget_bytes is None:
            return budget_bytes
        left = max(0, self.budget_bytes - self.committed_by_others())
        return left if measured or budget_bytes is None else min(budget_bytes, left)

    def needs(self, extra: tuple | None = None) -> str:
        """``label commits N bytes`` of each member (with its floor where re-placing gives some back) and of
        ``extra`` (a ``(manager, label)``), for errors."""
        members = [*self.members(), *([extra] if extra is not None else [])]
        return ", ".join(_need(manager, label) for manager, label in members)

    def allot(self, floor_bytes: int, want_bytes: int) -> int | None:
        """The budget a newcomer whose floor and want are ``floor_bytes`` / ``want_bytes`` is placed in ([Note:
        re-placing for a newcomer]), or ``None`` when the floors do not fit. Moves nothing."""
        members = [m for m, _ in self.members()]
        assert self.budget_bytes is not None, "allot() of a group without a budget"
        wants = [_committed(m) for m in members]
        if sum(wants) + want_bytes <= self.budget_bytes:
            return self.budget_bytes - sum(wants)
        floors = [_floor(m) for m in members]
        spare = self.budget_bytes - sum(floors) - floor_bytes
        if spare < 0:
            return None
        extras = [w - f for w, f in zip(wants, floors)] + [max(0, want_bytes - floor_bytes)]
        return floor_bytes + spare * extras[-1] // max(1, sum(extras))

    def divide(self, manager, label: str) -> None:
        """A newcomer (``manager``, ``label``) is placed: the members are re-placed to fit beside what it commits
        ([Note: re-placing for a newcomer]); then what no model commits is divided equally among the models as
        room for their activations and caches, and each pool's budget becomes its committed bytes plus its share;
        a member's cache beyond that is evicted now, before the newcomer's chunks are filled.

        Raises:
            ValueError: the members cannot give back enough room (names every model's need and the budget).
        """
        members = self.members()
        if self.budget_bytes is None or not members:
            return
        self._replace_members(members, self.budget_bytes - _committed(manager), (manager, label))
        everyone = [*members, (manager, label)]
        spare = max(0, self.budget_bytes - sum(_committed(m) for m, _ in everyone)) // len(everyone)
        for other, other_label in everyone:
            other.pool.budget_bytes = _committed(other) + spare
            if other is not manager:
                other.make_room(0, f"{other_label}'s share of the device budget shared with {label}")
        logger.info("hf_elixir: a device budget of %d bytes shared by %d models: %s; each has %d bytes more for "
                    "activations and cache", self.budget_bytes, len(everyone), self.needs(extra=(manager, label)),
                    spare)

    def _replace_members(self, members: list, room: int, newcomer: tuple) -> None:
        """Re-place the members so that they commit at most ``room`` together: each keeps its floor plus a part of
        the rest in proportion to its want above its floor. Every rank applies rank 0's decision (which chunks
        move decides collectives: an unshard gathers a chunk that is not resident)."""
        plan = _agreed(newcomer[0], self._replacement(members, room, newcomer))
        if isinstance(plan, str):
            raise ValueError(plan)
        for (member, member_label), ids in zip(members, plan):
            if ids:
                before = _committed(member)
                _offload_chunks(member, [c for c in member.chunks if c.chunk_id in set(ids)])
                logger.info("hf_elixir: %s re-placed for %s: %d frozen chunks moved off the device, it commits %d "
                            "bytes (was %d)", member_label, newcomer[1], len(ids), _committed(member), before)

    def _replacement(self, members: list, room: int, newcomer: tuple) -> list[list[int]] | str:
        """Per member, the ids of the chunks to move off the device (:meth:`_replace_members`), or the error."""
        wants = [_committed(m) for m, _ in members]
        if sum(wants) <= room:
            return [[] for _ in members]
        floors = [_floor(m) for m, _ in members]
        if sum(floors) > room:
            return (f"{newcomer[1]} does not fit the device budget it shares with the models prepared before it: "
                    f"ElixirConfig.device_memory_budget_bytes={self.budget_bytes} is the whole device for all of "
                    f"them; {self.needs(extra=newcomer)}, {sum(floors) + _committed(newcomer[0])} in all at the "
                    "least. Raise device_memory_budget_bytes to at least that, or give the models smaller budgets "
                    "of their own")
        extras = [w - f for w, f in zip(wants, floors)]
        spare = room - sum(floors)
        return [_to_move(member, floor + spare * extra // max(1, sum(extras)))
                for (member, _), floor, extra in zip(members, floors, extras)]

    def join(self, manager, label: str) -> None:
        """``manager`` (a model just prepared in this group) joins; the first sets the group's budget."""
        if not self.members():
            self.budget_bytes = manager.pool.budget_bytes
        self._members.append((weakref.ref(manager), label))


def _committed(manager) -> int:
    """What ``manager``'s model keeps on the device at the least (set by placement), else its whole pool budget."""
    committed = getattr(manager.pool, "committed_bytes", None)
    return committed if committed is not None else (manager.pool.budget_bytes or 0)


def _mid_step(manager) -> bool:
    """Is ``manager``'s model inside a step (accesses traced since the last step ended, gradients not stepped)?"""
    return bool(getattr(manager, "trace", None)) or bool(getattr(manager, "grads_pending", False))


def _movable(manager) -> list:
    """The chunks re-placing may move off the device, the last in the model's order first ([Note: re-placing for a
    newcomer]); none while the model is inside a step."""
    if manager.pool.recommit is None or _mid_step(manager):
        return []
    return [c for c in reversed(manager.chunks) if _frozen(manager, c) and c.replicate_group is None
            and (c.resident or c.shard_on_device) and c.pins == 0 and c.pending_gather is None
            and c.pending_refresh is None]


def _frozen(manager, chunk) -> bool:
    """No optimizer state, master or gradient buffer refers to ``chunk``'s buffers: it holds no trained parameter,
    or its model was prepared without an optimizer (each forward is a step: [Note: forward steps] in
    ``_steps.py``)."""
    return (not chunk.trainable or manager.forward_steps) and chunk.grad_full is None


def _floor(manager) -> int:
    """What ``manager``'s model would commit with every movable chunk off the device (never more than now)."""
    movable = _movable(manager)
    if not movable:
        return _committed(manager)
    return min(_committed(manager), manager.pool.recommit(frozenset(c.chunk_id for c in movable)))


def _need(manager, label: str) -> str:
    committed, floor = _committed(manager), _floor(manager)
    return f"{label} commits {committed} bytes" + (f" ({floor} once re-placed)" if floor < committed else "")


def _to_move(manager, target: int) -> list[int]:
    """Ids of ``manager``'s movable chunks to move off the device, the last first, until it commits at most
    ``target`` bytes."""
    chosen: list[int] = []
    for chunk in _movable(manager):
        if manager.pool.recommit(frozenset(chosen)) <= target:
            break
        chosen.append(chunk.chunk_id)
    return chosen


def _agreed(manager, decision):
    """Rank 0's ``decision`` (a picklable object) on every rank of ``manager``'s job: the inputs agree by
    construction, and this keeps it so."""
    group = manager.job_group
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return decision
    box = [decision]
    device = manager.compute_device if manager.compute_device.type == "cuda" else None
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group,
                               device=device)
    return box[0]


def _offload_chunks(manager, chunks: list) -> None:
    """Move ``chunks`` (frozen, idle) off the device and recount what ``manager``'s model commits."""
    manager.host.reserve_for([(c.shard_numel, c.dtype) for c in chunks])  # one host block ([Note: host blocks])
    for chunk in chunks:
        offload_frozen_chunk(manager, chunk)
    manager.pool.committed_bytes = manager.pool.recommit(frozenset())


def offload_frozen_chunk(manager, chunk) -> None:
    """Re-place a frozen chunk between steps: its shard to the host (a counted device-to-host copy), not resident;
    its gathered buffer stays as cache, which eviction may free ([Note: re-placing for a newcomer])."""
    assert _frozen(manager, chunk) and chunk.pins == 0, f"chunk {chunk.chunk_id}: only an idle frozen chunk moves"
    own_device_shard = chunk.shard_on_device and not (chunk.full_alias or chunk.shard_in_full)
    chunk.offload_shard(manager.host_empty(chunk.shard_numel, chunk.dtype))
    manager.counters.d2h_bytes += chunk.shard_bytes
    if own_device_shard:
        manager.pool.release(chunk.shard_bytes)  # charged at prepare


def current_shared_budget() -> SharedDeviceBudget | None:
    """The :class:`SharedDeviceBudget` entered in this context, or ``None``."""
    return _CURRENT.get()
