"""The host optimizer's element-wise states (Adam's moments, ...) as slices of the manager's host blocks.

[Note: host optimizer state] ``torch.optim`` creates a parameter's state lazily, in its first step
(``torch.zeros_like`` per state per parameter; Adagrad in its constructor). For the shard views of a
host optimizer chunk ([Note: shard views] in ``_shard_views.py``) those are many small CPU tensors from
glibc's heap, made in the first step between the freed ranges of that step's activations: on
``benchmarks/host_memory.py``'s GPT-2 (1 rank) 177 MiB of Adam moments, below the mmap threshold
([Note: host heap] in ``hf_elixir/chunk/_host_heap.py``), which split the heap so that ~100 MiB of freed
heap stayed resident to the end. Instead, :class:`HostStates` takes one fp32 ``[shard_numel]`` buffer per
element-wise state key per host chunk from the manager's host blocks at ``prepare`` ([Note: host blocks]
in ``hf_elixir/chunk/host_blocks.py``: one block with the chunk's master and gradient shards, counted in
``host_bytes`` as allocated; ``calloc``ed, so a state costs resident memory only once the first step
writes it, [Note: zero pages]), and the inner optimizer's state tensors are views into them:

* **prime.** Before the inner optimizer steps a view whose state is empty, :meth:`HostStates.prime`
  fills the state in exactly as ``torch.optim``'s lazy initialisation would (same keys in the same
  order, the same scalar ``step`` / ``mu_product`` tensors, per-element states zero or Adagrad's
  ``initial_accumulator_value``), with the per-element ones as slices of the chunk's buffers. A slice
  never written since its allocation is zero already and is not written.
* **adopt.** A per-element state tensor that ``torch.optim`` made itself (SGD's momentum buffer, a clone
  of the first gradient, which no zero initialisation reproduces; Adagrad's ``sum``, made in its
  constructor; a key this table does not know) and one that a load put in (``load_state_dict``, a
  checkpoint) is copied into the chunk's buffer and the state entry rebound to the slice
  (:meth:`HostStates.adopt`), so the state lives in the blocks from then on.

The inner optimizer sees ordinary tensors (slices of a 1-D buffer, contiguous), so ``state_dict`` /
``load_state_dict``, checkpoints, the host lane's snapshots and rollbacks (in-place copies, or a popped
state that is primed again, [Note: host lane] in ``_overlap.py``) and forgetting one parameter's
state (``state.pop``) work as before; only the memory the tensors live in changed. The table below is
``torch.optim``'s ``_init_group`` (torch 2.x); ``tests/test_host_optim_state.py`` checks it against
torch's own initialisation for every supported optimizer.

Source: ``torch.optim`` (``Adam._init_group`` et al.: lazy state initialisation); DeepSpeed's
``DeepSpeedCPUAdam`` and ColossalAI's ``HybridAdam`` keep the moments of a partition in one flat buffer
per partition the same way.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["HostStates", "element_state_keys"]


def _elements(cls: type, group: dict, defaults: dict | None = None) -> list[tuple[str, float | None]]:
    """``(key, initial value)`` of each element-wise state ``cls`` makes for a parameter of ``group``, in
    torch's order; ``None``: made by the step itself (not primed, adopted after the step). ``defaults``:
    the optimizer's (Adagrad takes ``initial_accumulator_value`` from them, not from the group)."""
    if issubclass(cls, torch.optim.Adam):  # AdamW too
        return [("exp_avg", 0.0), ("exp_avg_sq", 0.0)] + ([("max_exp_avg_sq", 0.0)] if group.get("amsgrad") else [])
    if issubclass(cls, torch.optim.Adamax):
        return [("exp_avg", 0.0), ("exp_inf", 0.0)]
    if issubclass(cls, (torch.optim.NAdam, torch.optim.RAdam)):
        return [("exp_avg", 0.0), ("exp_avg_sq", 0.0)]
    if issubclass(cls, torch.optim.RMSprop):
        return ([("square_avg", 0.0)] + ([("momentum_buffer", 0.0)] if group.get("momentum", 0) > 0 else [])
                + ([("grad_avg", 0.0)] if group.get("centered") else []))
    if issubclass(cls, torch.optim.Adagrad):
        return [("sum", float((defaults or group).get("initial_accumulator_value", 0.0)))]
    if issubclass(cls, torch.optim.SGD):
        return [("momentum_buffer", None)] if group.get("momentum", 0) != 0 else []
    return []


def element_state_keys(cls: type, group: dict) -> list[str]:
    """The element-wise state keys ``cls`` keeps per parameter of ``group`` (Adam: exp_avg, exp_avg_sq)."""
    return [key for key, _ in _elements(cls, group)]


def _scalars(cls: type, group: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The scalar states ``torch.optim`` initialises a parameter of ``group`` with (``step``, NAdam's
    ``mu_product``), on the tensors and devices it uses."""
    fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
    if issubclass(cls, (torch.optim.Adam, torch.optim.Adagrad)):
        on_device = fused or (capturable and issubclass(cls, torch.optim.Adam))
        dtype = _get_scalar_dtype(is_fused=fused)
    else:
        on_device, dtype = capturable, _get_scalar_dtype()
    step = torch.zeros((), dtype=dtype, device=device) if on_device else torch.tensor(0.0, dtype=dtype)
    if issubclass(cls, torch.optim.NAdam):
        mu = torch.ones((), dtype=dtype, device=device) if on_device else torch.tensor(1.0, dtype=dtype)
        return {"step": step, "mu_product": mu}
    return {"step": step}


class HostStates:
    """Element-wise optimizer states of the host optimizer chunks, as views into host-block buffers
    ([Note: host optimizer state]).

    Args:
        manager: the :class:`~hf_elixir.chunk.manager.ChunkManager` (its host blocks, its counters).
        cls: the optimizer class (one of ``SUPPORTED_OPTIMIZERS``).
        views: the shard views (``_ShardView``) of host optimizer chunks that the inner optimizer steps.
        keys_of_chunk: chunk id -> the state keys to allocate at once (fp32 ``[shard_numel]`` each); a
            key found later is allocated when first adopted.
        disk: the ``DiskStates`` whose file holds some chunks' states instead of the blocks, or ``None``.
    """

    def __init__(self, manager, cls: type, views: list, keys_of_chunk: dict[int, list[str]], disk=None) -> None:
        self.manager = manager
        self.disk = disk  # DiskStates: chunks whose states are in the disk tier's file ([Note: disk states])
        self.cls = cls
        self._view_of = {id(v.tensor): v for v in views}
        self._chunk_numel = {v.chunk.chunk_id: v.chunk.shard_numel for v in views}
        self.buffers: dict[int, dict[str, torch.Tensor]] = {cid: {} for cid in self._chunk_numel}
        self._pristine = set(self._view_of)  # views whose slices are zero since allocation (never written)
        for cid, keys in keys_of_chunk.items():
            for key in keys:
                if cid in self.buffers:
                    self._buffer(cid, key)

    @staticmethod
    def requests(cls: type, groups: list[dict], groups_of_chunk: dict[int, set[int]],
                 shard_numel: dict[int, int]) -> dict[int, list[str]]:
        """The keys to allocate per host chunk: the union over the param groups of its parameters."""
        return {cid: sorted({k for g in gids for k in element_state_keys(cls, groups[g])})
                for cid, gids in groups_of_chunk.items() if shard_numel[cid]}

    def _buffer(self, cid: int, key: str) -> torch.Tensor:
        buffers = self.buffers[cid]
        if key not in buffers:
            on_disk = self.disk.tensor(cid, key) if self.disk is not None else None  # zero: a fresh file
            buffers[key] = on_disk if on_disk is not None else self.manager.host_zeros(self._chunk_numel[cid],
                                                                                       torch.float32)
        return buffers[key]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of the host views these states are kept for."""
        return id(tensor) in self._view_of

    def prime(self, inner: torch.optim.Optimizer, params_per_group: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Before ``inner.step()`` on ``params_per_group`` (aligned with ``inner.param_groups``): give every
        host view with an empty state the state ``torch.optim`` would make, in the blocks.

        Returns:
            the host views whose state was empty (the step may make some itself: :meth:`adopt` them after).
        """
        fresh = []
        for group, params in zip(inner.param_groups, params_per_group):
            elements = None
            for tensor in params:
                view = self._view_of.get(id(tensor))
                if view is None or inner.state.get(tensor):
                    continue
                fresh.append(tensor)
                elements = _elements(self.cls, group, inner.defaults) if elements is None else elements
                if any(fill is None for _, fill in elements):
                    continue  # made by the step itself (SGD's momentum buffer): adopted after it
                inner.state[tensor] = self._primed(view, group, elements)
        return fresh

    def _primed(self, view, group: dict, elements: list[tuple[str, float]]) -> dict:
        state: dict = _scalars(self.cls, group, view.tensor.device)
        pristine = id(view.tensor) in self._pristine
        self._pristine.discard(id(view.tensor))
        for key, fill in elements:
            part = self._buffer(view.chunk.chunk_id, key)[view.lo:view.hi]
            if not (pristine and fill == 0.0):
                part.fill_(fill)
            state[key] = part
        return state

    def take_over(self, inner: torch.optim.Optimizer) -> None:
        """Right after ``inner`` was built: a state it made in its constructor (Adagrad's ``step`` and
        ``sum``, still as initialised) is made again in the blocks (copied there if not primable)."""
        for group in inner.param_groups:
            elements = _elements(self.cls, group, inner.defaults)
            for tensor in group["params"]:
                view = self._view_of.get(id(tensor))
                if view is None or not inner.state.get(tensor):
                    continue
                if all(fill is not None for _, fill in elements):
                    inner.state[tensor] = self._primed(view, group, elements)
                else:
                    self.adopt(inner, [tensor])

    def adopt(self, inner: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
        """Move every per-element fp32 state tensor of these host views that is not yet a slice of its
        chunk's buffer into it (a copy), and rebind the state entry to the slice."""
        for tensor in tensors:
            view = self._view_of.get(id(tensor))
            state = inner.state.get(tensor)
            if view is None or not state:
                continue
            for key, value in list(state.items()):
                if not (torch.is_tensor(value) and value.dim() > 0 and value.numel() == tensor.numel()
                        and value.dtype == torch.float32 and value.device.type == "cpu"):
                    continue
                part = self._buffer(view.chunk.chunk_id, key)[view.lo:view.hi]
                if value.data_ptr() != part.data_ptr():
                    part.copy_(value.reshape(-1))
                    state[key] = part
                    self._pristine.discard(id(tensor))
