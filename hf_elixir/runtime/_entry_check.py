"""Every rank enters a collective call of hf_elixir, or the calling ranks raise within seconds.

[Note: collective entry check] ``model.state_dict()``, ``model.load_state_dict(...)``, ``save_pretrained``,
``hf_elixir.full_parameters`` and ``hf_elixir.full_gradients`` gather chunks (and tensor/expert-parallel shards)
over the model's ranks: collectives that every rank must enter. Called on rank 0 alone (``if rank == 0:
model.state_dict()``, ``if accelerator.is_main_process: model.save_pretrained(dir)``), the first all-gather waited
for the other ranks until the process group's timeout (gloo: 30 min; NCCL may wait for ever), or paired with
another rank's unrelated collective of the same size (the next forward's unshard) and went on with wrong data.

So, before its first collective, such a call checks in on the store of the default process group (the TCP
rendezvous store that ``init_process_group`` already runs, on every backend: no NCCL call, nothing on the
device, a few round trips per rank): each rank writes the call's name under the next sequence number of the
model's group and adds one to a counter; the rank that completes the count compares the names and sets the
number's state to ``go`` (or ``mismatch`` with every rank's call: ranks in two different calls, rank 0 in
``state_dict`` and rank 1 in ``full_parameters``, raise at once, naming both, instead of pairing their
collectives). The others wait for that state for ``HF_ELIXIR_COLLECTIVE_TIMEOUT_S`` seconds (default 30); a rank
that waits in vain sets it to ``abort`` instead, with ``compare_set``, so exactly one outcome wins even when the
last rank arrives at that moment: every rank that arrived sees the same one, and a rank that arrives after an
``abort`` raises as well instead of entering a gather the others left. The rank that serves the store (global rank
0 under ``env://``) leaves last, so a call that gathers nothing afterwards cannot take the store down under the
others' last reads. A call inside another checked call (the ``state_dict`` of a tensor-parallel ``state_dict``) is
not checked again: every rank that entered the outer one runs the same code. A model whose chunks are all whole on every rank
(``"replicated"``, or one rank per group) and that is not tensor/expert parallel gathers nothing: its calls are
local and not checked (``if rank == 0: torch.save(model.state_dict())`` works there, as under DDP). The sequence
numbers of the ranks fall out of step after an error (their next checked calls raise too, none hangs): the job is expected to end there.

Same role as PyTorch's ``monitored_barrier`` (gloo only) and NCCL's watchdog (which kills a job after its
timeout, minutes later, without naming the call).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading

import torch.distributed as dist

__all__ = ["TIMEOUT_ENV", "CollectiveEntryError", "check_entry", "check_model_entry", "checked_call", "timeout_s"]

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "HF_ELIXIR_COLLECTIVE_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 30.0
_PREFIX = "hf_elixir/entry"


class CollectiveEntryError(RuntimeError):
    """A collective call of hf_elixir was entered by some of the model's ranks only ([Note: collective entry
    check])."""


class _Local(threading.local):
    def __init__(self) -> None:
        self.depth = 0  # > 0 inside a checked call: nested calls are not checked again
        self.label: str | None = None  # the user's call that the checked collective belongs to (save_pretrained)


_local = _Local()
_sequence: dict[str, int] = {}  # domain -> this process's next sequence number


def timeout_s() -> float:
    """``HF_ELIXIR_COLLECTIVE_TIMEOUT_S`` (seconds a rank waits for the others to enter a collective call).

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds (default "
                         f"{_DEFAULT_TIMEOUT_S:g}); unset it for the default")
    return value


def _ranks(group) -> list[int] | None:
    """The global ranks of ``group`` (``None``: the world), or ``None`` when there is nothing to check."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return ranks if len(ranks) > 1 else None


def check_model_entry(call: str, state) -> None:
    """:func:`check_entry` for a call on a prepared model (``ElixirState``), over the ranks its gathers span: its
    ``ElixirConfig.process_group``, or the world for a tensor/expert-parallel model (its gathers also run over the
    tp/ep groups of the world's mesh). A model whose chunks are all whole on every rank (one rank per group, or
    ``"replicated"``) and that is not tensor/expert parallel gathers nothing: its calls are local, as PyTorch's
    (``if rank == 0: torch.save(model.state_dict())`` works there, as under DDP), and are not checked."""
    if state.assemble_full is None and all(chunk.world_size == 1 for chunk in state.manager.chunks):
        return
    check_entry(call, None if state.assemble_full is not None else state.config.process_group)


def _store():
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):  # a process group initialised without a store
        return None


def _fix(call: str) -> str:
    if _local.label and _local.label.startswith("trainer."):  # the Trainer writes from its main process by itself
        return (f"call {_local.label} on every rank, not inside `if trainer.is_world_process_zero():` (it gathers "
                "over all of them; only the main process writes)")
    return (f"call {call} on every rank of the model, in the same order (it gathers over all of them); to write a "
            "file from one process, call model.save_pretrained(dir, is_main_process=accelerator.is_main_process) "
            "(under the Trainer: trainer.save_model(dir)) or hf_elixir.save_checkpoint on every rank: every rank "
            "takes part in the gather and only the main process writes")


def _what(call: str) -> str:
    return f"{_local.label} (its {call})" if _local.label and _local.label != call else call


def _decide(store, base: str, ranks: list[int], timeout: float) -> str:
    """This rank's vote for ``base``; returns the agreed state: ``go``, ``mismatch:<calls>`` or ``abort``."""
    if store.add(f"{base}/n", 1) == len(ranks):  # the last to arrive compares the calls for everyone
        calls = [c.decode() for c in store.multi_get([f"{base}/r{r}" for r in ranks])]
        decision = "go" if len(set(calls)) == 1 else "mismatch:" + ", ".join(
            f"rank {r}: {c}" for r, c in zip(ranks, calls))
        return store.compare_set(f"{base}/state", "", decision).decode()
    try:
        store.wait([f"{base}/state"], datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):  # the store's timeout: this rank votes to abort
        pass
    return store.compare_set(f"{base}/state", "", "abort").decode()


def _leave(store, base: str, ranks: list[int], rank: int, timeout: float) -> None:
    """The rank that serves the store (global rank 0) leaves last: a rank that finishes first (a call that gathers
    nothing) and exits would take the store down under the others' last reads."""
    if rank != 0:
        store.set(f"{base}/d{rank}", "1")  # this rank's last store operation for ``base``
        return
    with contextlib.suppress(RuntimeError, dist.DistError):
        store.wait([f"{base}/d{r}" for r in ranks if r != rank], datetime.timedelta(seconds=timeout))


def _cleanup(store, domain: str, seq: int, rank: int, ranks: list[int]) -> None:
    """Delete the keys of sequence number ``seq - 2``: every rank has left it (it entered ``seq - 1``)."""
    old = seq - 2
    if old < 0:
        return
    base = f"{_PREFIX}/{domain}/{old}"
    keys = [f"{base}/r{rank}", f"{base}/d{rank}"]
    if rank == ranks[0]:
        keys += [f"{base}/n", f"{base}/state"]
    for key in keys:
        with contextlib.suppress(RuntimeError, NotImplementedError):
            store.delete_key(key)


def _domain(group, ranks: list[int]) -> str:
    """The key namespace of ``group``: its name (unique per group, the same on its ranks) and its ranks."""
    name = getattr(group if group is not None else dist.group.WORLD, "group_name", "")
    return f"{name}:{'-'.join(map(str, ranks))}"


def check_entry(call: str, group=None) -> None:
    """Check that every rank of ``group`` enters the collective ``call`` (see [Note: collective entry check]).

    A no-op with one rank, without torch.distributed, and inside another checked call (:func:`checked_call`).

    Args:
        call: the call as the user writes it (``"model.state_dict()"``), named in the error.
        group: the model's process group (``None``: the world).

    Raises:
        CollectiveEntryError: some rank of ``group`` did not enter a collective call within
            ``HF_ELIXIR_COLLECTIVE_TIMEOUT_S`` seconds, or entered another one; names the call and the fix.
    """
    if _local.depth > 0:
        return
    ranks = _ranks(group)
    store = _store() if ranks is not None else None
    if store is None:
        return
    timeout = timeout_s()
    rank = dist.get_rank()
    domain = _domain(group, ranks)
    seq = _sequence.get(domain, 0)
    _sequence[domain] = seq + 1
    _cleanup(store, domain, seq, rank, ranks)
    base = f"{_PREFIX}/{domain}/{seq}"
    what = _what(call)
    store.set(f"{base}/r{rank}", what)
    outcome = _decide(store, base, ranks, timeout)
    if outcome == "abort":
        _raise_abort(store, base, ranks, rank, what, call, timeout)
    _leave(store, base, ranks, rank, timeout)
    if outcome != "go":
        raise CollectiveEntryError(
            f"the model's ranks entered different collective calls at the same point ({outcome[len('mismatch:'):]}): "
            f"their gathers would pair with each other's and give wrong data or hang. {_fix(call)}")


def _raise_abort(store, base: str, ranks: list[int], rank: int, what: str, call: str, timeout: float):
    arrived = [r for r in ranks if store.check([f"{base}/r{r}"])]
    missing = [r for r in ranks if r not in arrived]
    if not missing:  # this rank came after the others had given up: a lonely call earlier, or a slow rank
        calls = {r: store.get(f"{base}/r{r}").decode() for r in ranks if r != rank}
        raise CollectiveEntryError(
            f"{what} on rank {rank} came after {', '.join(f'{c} on rank {r}' for r, c in calls.items())} had "
            f"given up waiting {timeout:g} s for this rank and raised: the ranks' collective calls are out of step "
            f"since (a call made on some ranks only, e.g. inside `if rank == 0:`). {_fix(call)}. If this rank was "
            f"only slower to get there, raise {TIMEOUT_ENV} (now {timeout:g} s)")
    raise CollectiveEntryError(
        f"{what} is a collective call, but on rank {rank} it waited {timeout:g} s and ranks {missing} of the "
        f"model's ranks {ranks} did not enter it (ranks {arrived} did): {_fix(call)}. If those ranks are only "
        f"slower to get there (a long write on one rank), raise {TIMEOUT_ENV} (now {timeout:g} s)")


@contextlib.contextmanager
def checked_call(call: str, group=None, *, label: bool = False):
    """:func:`check_entry` for ``call``, then run the body with nested checks off (every rank runs the same code).

    Args:
        label: name ``call`` in the errors of the checks it would have made (a ``save_pretrained`` whose
            ``state_dict()`` is checked): nothing is checked on entry, the first nested check is.
    """
    if label:
        outer, _local.label = _local.label, _local.label or call
        try:
            yield
        finally:
            _local.label = outer
        return
    check_entry(call, group)
    _local.depth += 1
    try:
        yield
    finally:
        _local.depth -= 1
