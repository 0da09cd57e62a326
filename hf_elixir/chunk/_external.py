"""Parameters read outside their own module's forward: the chunk manager serves such reads while the model runs.

[Note: external reads] Hooks unshard a module's parameters for its own forward and backward. Code that reads a
parameter without calling its module sees whatever state the chunk is in: TRL's default loss (``model(...,
fused_lm_head=True)``) and Liger's fused linear cross-entropy read ``lm_head.weight`` directly and hand it to an
``autograd.Function``; a custom loss reads the tied input embedding; a value head reads backbone weights. The
manager serves them, FSDP2's way (its root unit owns the parameters outside every ``fully_shard`` child,
unsharded for the root's forward) narrowed to what is read, and with DeepSpeed ZeRO-3's ``GatheredParameters``
for reads elsewhere in a step:

* **the window**: from the start to the end of the model's outermost forward (any grad mode), inside
  ``hf_elixir.external_reads(model)``, and while autograd runs a backward. Outside it (between steps) a read of a
  parameter that is not current stays loud (:class:`~hf_elixir.chunk.params.StaleParameterError`).
* **a read of a stale parameter in the window** (its placeholder's ``__torch_function__``, [Note: stale
  placeholder] in ``params.py``) unshards its chunk on the spot (:meth:`ChunkManager.access`: a gather at
  several ranks; ranks run the same code, so they issue the same gathers in the same order) and pins it until the
  window closes (the forward's end, the context's exit, the end of backward). The access is recorded in the step's
  trace, so the next step's eviction and gathers ahead know it (the trace is the profiled order).
* **a parameter autograd saves for backward outside its own module's forward** (the slot is not in COMPUTE: its
  module is not running) is packed as an :class:`_ExternalSaved` (activation accounting's pack hook, ``_activations.py``):
  its unpack in backward unshards the chunk again and pins it until the parameter's gradient has arrived (its
  post-accumulate-grad hook, after every node that read it: autograd sums a leaf's incoming gradients before it
  accumulates them) or, for a frozen parameter, until the end of backward. Saving it marks the parameter used by
  this forward, so its chunk's reduce waits for its gradient ([Note: reduce order] in ``_reduce.py``); a tied weight
  read by its module and outside it gets one accumulated gradient, reduced once.
* **a tensor-parallel split parameter** holds this rank's slice only: read whole outside its module it would give a
  part of the weight silently, so such a read is refused by name (``split_names``, set by the runtime from the
  parallel state).

What it does not see: a *current* parameter read in the window, turned into a view (``w = p.t()``) and used after
later modules ran (which may evict the chunk) without being saved for backward. Read parameters where they are used,
as every reader above does.
"""

from __future__ import annotations

import torch

from hf_elixir.chunk.chunk import Chunk
from hf_elixir.chunk.states import TensorState

__all__ = ["ExternalReadsMixin", "ExternalSaved"]


class ExternalSaved:
    """What the pack hook hands autograd for a parameter saved outside its module's forward ([Note: external
    reads]): the tensor, its chunk and the parameter whose gradient ends the backward hold (``None``: held until
    the end of backward)."""

    __slots__ = ("tensor", "chunk", "param")

    def __init__(self, tensor: torch.Tensor, chunk: Chunk, param: torch.nn.Parameter | None) -> None:
        self.tensor, self.chunk, self.param = tensor, chunk, param


def _in_backward() -> bool:
    """Is autograd running a backward on this thread?"""
    return torch._C._current_graph_task_id() != -1


class ExternalReadsMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s service of reads outside a parameter's own module
    ([Note: external reads]; a mixin: it unshards and pins through the manager's ``access`` / ``release``)."""

    def _init_external(self) -> None:
        self._reads_depth = 0  # open windows: the outermost forward, external_reads contexts
        self._forward_holds: list[Chunk] = []  # pinned by reads in the window, released when it closes
        # pinned by unpacks (and reads) in backward: parameter -> chunks (``None``: until the end of backward)
        self._backward_holds: dict[torch.nn.Parameter | None, list[Chunk]] = {}
        #: FQNs of tensor-parallel split parameters (set by the runtime); an external read of one is refused
        self.split_names: frozenset[str] = frozenset()

    # -- the window ----------------------------------------------------------------------------
    def open_reads_window(self) -> None:
        self._reads_depth += 1

    def close_reads_window(self) -> None:
        """Close one window; the last one releases the chunks its reads pinned."""
        self._reads_depth -= 1
        if self._reads_depth == 0 and self._forward_holds:
            holds, self._forward_holds = self._forward_holds, []
            self.release(holds)

    # -- reads ---------------------------------------------------------------------------------
    def serve_read(self, param: torch.nn.Parameter, reader: str) -> bool:
        """A read (``reader``: the operation) of stale ``param``: unshard and pin its chunk if a window is
        open or a backward runs (``True``); ``False`` between steps (the caller raises).

        Raises:
            ValueError: ``param`` is split over tensor-parallel ranks (it cannot be read whole here).
        """
        backward = _in_backward()
        if not (self._reads_depth or backward):
            return False
        slot = self.slot_of[param]
        self._check_whole(slot, reader)
        chunk = self.chunk_of[param]
        if backward:
            self.start_backward()
            self.access([chunk])
            self._backward_holds.setdefault(None, []).append(chunk)
        else:
            self.access([chunk])
            self._forward_holds.append(chunk)
        return True

    def _check_whole(self, slot, reader: str) -> None:
        names = [slot.name, *slot.aliases]
        split = next((n for n in names if n in self.split_names), None)
        if split is not None:
            raise ValueError(
                f"parameter {split!r} (this rank's shape {tuple(slot.shape)}) is split over the tensor-parallel "
                f"ranks, and {reader} reads it outside its own module, where only this rank's slice exists; the "
                f"result would be computed on a part of the weight. Keep the module whole: "
                f"ElixirConfig(placements={{{split.rsplit('.', 1)[0]!r}: 'sharded'}}), or turn off the fused "
                "reader (e.g. TRL's fused LM head)")

    # -- saved for backward --------------------------------------------------------------------
    def pack_external(self, tensor: torch.Tensor):
        """``tensor`` (a chunk view autograd saves) wrapped as :class:`ExternalSaved` when it is a parameter
        saved outside its own module's forward ([Note: external reads]); else ``None``."""
        slot = self.slot_of.get(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        if slot is None or slot.param is not tensor or slot.state is TensorState.COMPUTE:
            return None
        self._check_whole(slot, "autograd (a function that saves it for backward)")
        chunk = self.chunk_of[tensor]
        trainable = slot.trainable and tensor.requires_grad
        if trainable:  # its gradient is awaited before the chunk's reduce ([Note: reduce order] in _reduce.py)
            chunk.used_slots.add(slot.index_in_chunk)
        return ExternalSaved(tensor, chunk, tensor if trainable else None)

    def unpack_external(self, saved: ExternalSaved) -> torch.Tensor:
        """The saved parameter for backward, its chunk unsharded and pinned until the parameter's gradient has
        arrived (a frozen one: until the end of backward)."""
        if not _in_backward():  # read outside backward (e.g. ``grad_fn._saved_*``): no hold to end
            return saved.tensor
        self.start_backward()
        self.access([saved.chunk])
        self._backward_holds.setdefault(saved.param, []).append(saved.chunk)
        return saved.tensor

    def release_external(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient has arrived: release what backward unpacks of it pinned."""
        if self._backward_holds:
            held = self._backward_holds.pop(param, None)
            if held:
                self.release(held)

    def release_backward_holds(self) -> None:
        """The end of backward: release every chunk backward's external reads still pin."""
        holds, self._backward_holds = self._backward_holds, {}
        for held in holds.values():
            self.release(held)
