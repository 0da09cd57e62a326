"""The one interface through which the chunk manager tells its optimizer what happens to the chunks.

The manager is in a layer below the optimizer (``hf_elixir/optim/``), so it cannot call it by name; the optimizer
registers itself instead (:meth:`~hf_elixir.chunk.manager.ChunkManager.set_listener`), as one object with named
methods rather than one bare callable per event. :class:`ChunkStepListener` is that interface, and its methods'
defaults are what the manager does without an optimizer (``prepare(model, None)``, inference): nothing.
``ElixirOptimizer`` implements it and hands the host-lane events to its lane ([Note: host lane] in
``hf_elixir/optim/_overlap.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ChunkStepListener"]


class ChunkStepListener:
    """The events a :class:`~hf_elixir.chunk.manager.ChunkManager` reports to its optimizer (every method a no-op
    here: what the manager does without one)."""

    #: whether :meth:`on_grad_offloaded` takes over host gradients (the host lane); ``False``: the manager finishes
    #: each gradient offload itself ([Note: gradient offload] in ``_grad_shards.py``)
    takes_offloaded_grads: bool = False

    def before_backward(self) -> None:
        """A backward starts ([Note: owed clip factor] in ``optim/_clip.py``)."""

    def on_grad_progress(self) -> None:
        """A gradient landed in its chunk ([Note: early refresh] in ``optim/_refresh.py``)."""

    def on_grad_offloaded(self, chunk, staging: torch.Tensor | None, event) -> Callable[[], None] | None:
        """Take over ``chunk``'s host gradient (``staging``, ready once ``event`` is; only called where
        :attr:`takes_offloaded_grads`); may return a callable that waits until ``staging`` is consumed."""
        return None

    def host_fence(self, chunk) -> None:
        """``chunk``'s shard (``None``: every gradient shard) is about to be read or written: host work on it
        ends first ([Note: gradient offload] in ``_grad_shards.py``)."""

    def early_refresh_fence(self, chunk) -> None:
        """Something waits for ``chunk``'s refresh issued from an unvalidated speculative step ([Note: early
        refresh] in ``optim/_refresh.py``)."""

    def on_param_writes(self, chunks: list) -> None:
        """The shards of ``chunks`` took parameter writes: merge them into the masters ([Note: parameter writes] in
        ``_chunk_params.py``)."""

    def on_zero_grad(self) -> None:
        """Every gradient is zero again ([Note: owed clip factor] in ``optim/_clip.py``)."""

    def hyper_code(self) -> int:
        """This rank's 24-bit code of the optimizer's hyperparameters ([Note: hyperparameter check] in
        ``_rank_checks.py``); 0 without an optimizer."""
        return 0
