"""Activation accounting of the chunk manager: every storage autograd saves for backward (other than the
chunks') is charged to the device pool while it lives, as are the temporaries of a gradient on its way into its
chunk, when the budget covers them ([Note: activations in the budget] in ``memory.py``). Making room for them
evicts chunks like any other charge (``_eviction.py``).

The pack / unpack pair handed to ``torch.autograd.graph.saved_tensors_hooks`` keeps PyTorch's own guarantees:
no reference cycle through a saved output ([Note: pack without a cycle] at
:meth:`ActivationAccountingMixin._pack_saved`) and the in-place modification check (:func:`_unpack_saved`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk._external import ExternalSaved
from hf_elixir.chunk.memory import DeviceBudgetExceededError, DevicePool

__all__ = ["ActivationAccountingMixin"]


class ActivationAccountingMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s activation accounting (a mixin: it charges the manager's
    pool and makes room through the manager's eviction)."""

    def _init_activations(self) -> None:
        # activation storages charged -> their bytes (see saved_tensors_accounting)
        self._saved_storages: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def saved_tensors_accounting(self):
        """A context (entered around the model's forward) that charges every storage autograd saves for
        backward, other than the chunks', to the pool's activation bytes while the storage lives (dead
        storages are dropped at the next :meth:`sync_activation_bytes`: each forward, each end of
        backward, and before evicting for an activation)."""
        self.sync_activation_bytes()
        outer = _active_saved_tensors_hooks()
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
        outer_pack, outer_unpack = outer  # e.g. the profiler's tracer: keep it seeing every saved tensor, itself
        # (the tracer tells tensors apart by identity); what the outer hook packs is what autograd keeps
        def pack(tensor):
            mine = self._pack_saved(tensor)
            return (mine, outer_pack(tensor)) if isinstance(mine, ExternalSaved) else outer_pack(tensor)

        def unpack(packed):
            if type(packed) is tuple and len(packed) == 2 and isinstance(packed[0], ExternalSaved):
                self.unpack_external(packed[0])  # the chunk unsharded again ([Note: external reads])
                packed = packed[1]
            return outer_unpack(packed)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def sync_activation_bytes(self) -> None:
        """Set the pool's activation bytes to the storages still alive (a weak mapping forgets the dead)."""
        live = sum(self._saved_storages.values())
        self.pool.release_activation(self.counters.activation_bytes - live)

    def _pack_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """Charge ``tensor``'s storage (saved for backward) to the activation bytes; return what autograd keeps.

        [Note: pack without a cycle] The packed object is ``tensor.detach()`` (autograd re-attaches the history
        at unpack), never ``tensor`` itself, except for chunk views (parameters: leaves, no history): a saved
        output packed as itself holds its own ``grad_fn``, which holds it, a cycle through C++ that the garbage
        collector cannot see. Backward frees it, but a forward with grad enabled and no backward (an evaluation
        without ``torch.no_grad()``, a forward that raised, a loss computed only to log) then kept its graph
        and every activation it saved for good, still charged to the budget, until a later step failed with
        ``DeviceBudgetExceededError`` on that rank alone (PyTorch's ``saved_tensors_hooks`` warns of this).
        Autograd does not check the version of a tensor packed by hooks, so :func:`_packed` records it and
        :func:`_unpack_saved` raises as PyTorch does when the saved tensor was modified in place (before, backward
        used the modified values silently). Chunk views are exempt: refills write the chunk buffers in place."""
        if strict.is_managed_device(tensor):  # a parameter read outside its module: [Note: external reads]
            external = self.pack_external(tensor)
            return tensor if external is None else external
        if tensor.device != self.compute_device or tensor.layout != torch.strided:
            return _packed(tensor)
        storage = tensor.untyped_storage()
        if storage in self._saved_storages:
            return _packed(tensor)
        nbytes = storage.nbytes()
        if self.pool.charges_activations and not self.pool.fits(nbytes):
            self.sync_activation_bytes()
            try:
                self.make_room(nbytes, f"activations saved for backward ({nbytes} bytes)")
            except DeviceBudgetExceededError:
                err = self.pool.activation_error(nbytes, tuple(tensor.shape), self.counters.device_used_bytes)
                raise DeviceBudgetExceededError(f"{err}. Device holds: {self.describe()}") from None
        self.pool.charge_activation(nbytes)
        self._saved_storages[storage] = nbytes
        return _packed(tensor)

    def _unpack_saved(self, packed):
        """What :meth:`_pack_saved` packed, back for backward (:func:`_unpack_saved`; an external read's chunk
        unsharded again, [Note: external reads] in ``_external.py``)."""
        if isinstance(packed, ExternalSaved):
            return self.unpack_external(packed)
        return _unpack_saved(packed)

    def charge_temporary(self, nbytes: int, what: str):
        """Context: ``nbytes`` of an autograd temporary live on the device inside (charged only when the
        budget covers activations and temporaries; chunks are evicted to make room)."""
        if not self.pool.charges_activations:
            return contextlib.nullcontext()
        self.make_room(nbytes, what)
        self.pool.charge(nbytes, what)
        return _Release(self.pool, nbytes)


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """What :meth:`ChunkManager._pack_saved` hands autograd for a saved activation: ``tensor.detach()`` (shares its
    storage and version counter, holds no ``grad_fn``: [Note: pack without a cycle]), tagged with the version it
    was saved at, which :func:`_unpack_saved` checks as autograd does for tensors saved without hooks."""
    packed = tensor.detach()
    packed._elixir_saved_version = tensor._version
    return packed


def _unpack_saved(tensor: torch.Tensor) -> torch.Tensor:
    """The saved tensor back for backward.

    Raises:
        RuntimeError: it was modified in place after autograd saved it (PyTorch's own check, which does not run
            for tensors packed by ``saved_tensors_hooks``; without this the gradient would silently use the
            modified values).
    """
    saved = getattr(tensor, "_elixir_saved_version", None)
    if saved is not None and tensor._version != saved:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.dtype}, shape {tuple(tensor.shape)}] is at version {tensor._version}; expected version "
            f"{saved} instead (hf_elixir's activation accounting packed it; plain PyTorch raises the same). Use the "
            f"out-of-place form of the operation (e.g. y = y * 2 instead of y.mul_(2)) on tensors that backward "
            f"still needs")
    return tensor


def _active_saved_tensors_hooks():
    """The ``(pack, unpack)`` pair of an enclosing ``saved_tensors_hooks`` context, or ``None`` (a nested
    context replaces the outer one, so the accounting chains to it instead)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Release:
    """Context that releases ``nbytes`` from ``pool`` on exit (see ``ChunkManager.charge_temporary``)."""

    def __init__(self, pool: DevicePool, nbytes: int) -> None:
        self.pool, self.nbytes = pool, nbytes

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        self.pool.release(self.nbytes)
