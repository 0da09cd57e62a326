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
* each later model is placed in ``B`` less what the earlier models commit (so its plan, floor and placement count
  them); once it is placed, what no model commits is divided equally among all of them (room for activations,
  which the budget covers, and for caches), and every pool's budget becomes its committed bytes plus its share,
  an earlier model's cache beyond that evicted at once. The pools' budgets then add up to at most ``B``, and each
  one is enforced as before (a charge over it evicts, or raises ``DeviceBudgetExceededError``).
* a later model whose floor does not fit what is left raises ``ValueError`` naming every model's need and the sum.

A frozen model (``prepare(model, None)``) commits its compute-dtype shards and working set only: no gradient
buffers, optimizer states or fp32 masters exist for it (``chunk/_build.py``, [Note: fp32 masters at prepare]).
Without a budget (``None`` off CUDA: unlimited) there is nothing to divide. A model that is garbage-collected
leaves the group (weak references); the room it committed goes to the next model prepared.
"""

from __future__ import annotations

import contextvars
import logging
import weakref

__all__ = ["SharedDeviceBudget", "current_shared_budget"]

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
        """Bytes the members commit on the device (what a newcomer cannot use)."""
        return sum(_committed(manager) for manager, _ in self.members())

    def budget_for(self, budget_bytes: int | None, measured: bool) -> int | None:
        """The budget a newcomer is placed in: the group's budget less what the members commit; ``budget_bytes``
        (this model's own agreed budget) caps it when given explicitly (``measured=False``)."""
        if not self.members() or self.budget_bytes is None:
            return budget_bytes
        left = max(0, self.budget_bytes - self.committed_by_others())
        return left if measured or budget_bytes is None else min(budget_bytes, left)

    def needs(self, extra: tuple | None = None) -> str:
        """``label commits N bytes`` of each member (and of ``extra``, a ``(manager, label)``), for errors."""
        members = [*self.members(), *([extra] if extra is not None else [])]
        return ", ".join(f"{label} commits {_committed(manager)} bytes" for manager, label in members)

    def divide(self, manager, label: str) -> None:
        """A newcomer (``manager``, ``label``) is placed: what no model commits (the group's budget less every
        model's committed bytes) is divided equally among the models as room for their activations and caches, and
        each pool's budget becomes its committed bytes plus its share; a member's cache beyond that is evicted now,
        before the newcomer's chunks are filled."""
        members = self.members()
        if self.budget_bytes is None or not members:
            return
        everyone = [*members, (manager, label)]
        spare = max(0, self.budget_bytes - sum(_committed(m) for m, _ in everyone)) // len(everyone)
        for other, other_label in everyone:
            other.pool.budget_bytes = _committed(other) + spare
            if other is not manager:
                other.make_room(0, f"{other_label}'s share of the device budget shared with {label}")
        logger.info("hf_elixir: a device budget of %d bytes shared by %d models: %s; each has %d bytes more for "
                    "activations and cache", self.budget_bytes, len(everyone), self.needs(extra=(manager, label)),
                    spare)

    def join(self, manager, label: str) -> None:
        """``manager`` (a model just prepared in this group) joins; the first sets the group's budget."""
        if not self.members():
            self.budget_bytes = manager.pool.budget_bytes
        self._members.append((weakref.ref(manager), label))


def _committed(manager) -> int:
    """What ``manager``'s model keeps on the device at the least (set by placement), else its whole pool budget."""
    committed = getattr(manager.pool, "committed_bytes", None)
    return committed if committed is not None else (manager.pool.budget_bytes or 0)


def current_shared_budget() -> SharedDeviceBudget | None:
    """The :class:`SharedDeviceBudget` entered in this context, or ``None``."""
    return _CURRENT.get()
