"""Reading full gradients of a prepared model between ``backward`` and ``step``.

[Note: readable gradients] Under hf_elixir ``p.grad`` stays ``None``: backward adds each gradient into its chunk's
buffer and reduce-scatters it, so each rank holds the fp32 gradient shard of every chunk (``manager.grad_shards``;
on the host where the optimizer state is offloaded). :func:`full_gradients` and :func:`get_full_grad` give the
full gradient of a parameter as plain PyTorch's ``p.grad`` would hold it after ``loss.backward()`` of the same
(global, data-parallel mean) loss:

* all-gathered over the chunk's group (a collective: every rank calls, in the same order, as for
  ``full_parameters``), host shards going through the device as NCCL needs;
* in fp32, shaped like the parameter, a new host tensor (a copy: writing it changes nothing);
* fp16: divided by the loss scale, unless the optimizer has unscaled it already (``clip_grad_norm``, or the host
  lane during backward);
* after ``clip_grad_norm``: clipped. The factor a clip owes to gradients on the host until the step pays it
  ([Note: owed clip factor] in _clip.py) is applied here, so every gradient reads as clipped.

Parameters that got no gradient in this step (an MoE expert no token reached; PyTorch leaves ``p.grad`` None) are
left out of the mapping, and ``get_full_grad`` returns ``None`` for them. Same role as DeepSpeed's
``safe_get_full_grad``.

Tensor/expert-parallel models (:func:`hf_elixir.parallel.parallelize`): the unmodified model's names and full
shapes, as ``dict(unmodified.named_parameters())`` holds them. After the data-parallel gather above, this rank's
gradients go through ``assemble_full`` (``hf_elixir/parallel/_gather.py``, the same reassembly as
``gather_full_state_dict``; prepare leaves it in ``ElixirState.assemble_full``, as this layer sits below
``parallel``): tensor-parallel shards all-gathered over the tp group and merged, fused 3-D expert slices
concatenated over the ep group in ep-rank order, Switch-style ``expert_{i}`` gradients gathered from their owners.
The shard gradients are already those of the full loss (Megatron's identity / all-reduce pair), experts carry
every ep rank's tokens (pre-divided by ``ep``: [Note: expert gradient scale] in ``parallel/_expert_parallel.py``),
and a ``grad_allreduce`` parameter's gradient is already summed over tp, so replicated parameters are taken from
this rank as they are. One all-gather of has-gradient flags over the tp/ep group comes first, so every rank issues
the same all-gathers (a parameter without a gradient on one rank takes part as zeros) and a Switch expert no rank's
token reached is left out, as PyTorch leaves it. ``local=True``: this rank's view instead (its shards, its
experts, in the parallelized model's names), consolidated over the data-parallel ranks only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hf_elixir._compat import all_gather_single
from hf_elixir.chunk.strict import host_read, register_host, to_device, to_host
from hf_elixir.runtime._entry_check import check_model_entry
from hf_elixir.runtime._state import get_state

__all__ = ["full_gradients", "get_full_grad"]


def _optimizer_of(model: torch.nn.Module):
    state = get_state(model)
    if state.optimizer is None:
        raise ValueError("hf_elixir.full_gradients: this model was prepared without an optimizer "
                         "(hf_elixir.prepare(model, None)), so it keeps no gradients; prepare it with the optimizer "
                         "that trains it")
    return state.manager, state.optimizer


def _check_not_stepped(manager, call: str) -> None:
    """Refuse a read after ``optimizer.step()`` and before ``zero_grad``: the step consumed the shards (fp16: unscaled
    in place, the scale updated), so they no longer read as the step's gradients."""
    if manager.grads_stepped:
        raise ValueError(f"{call} after optimizer.step(): the step consumed the gradient shards, so they no longer "
                         "read as this step's gradients; call it between backward and optimizer.step() (in a Trainer "
                         "callback: on_pre_optimizer_step, after the Trainer's clipping)")


def _settle(manager, optimizer) -> torch.Tensor:
    """Every gradient of this backward in its shard; returns the has-gradient flags (one host read)."""
    manager.drain_reduces()
    lane = getattr(optimizer, "_lane", None)
    if lane is not None:
        lane.join()  # the host lane's intake of offloaded gradients
    flags = manager.flags.has_grad_flags
    return host_read(flags) if flags.numel() else torch.zeros(0)


def _factors(optimizer, chunk_id: int, grad: torch.Tensor) -> float:
    """What multiplies ``grad`` to read as PyTorch's gradient: 1 / loss scale where not unscaled yet (fp16), the
    clip factor the step still owes to host gradients ([Note: owed clip factor] in _clip.py)."""
    factor = 1.0
    lane = getattr(optimizer, "_lane", None)
    if optimizer.scaler.enabled and not optimizer._unscaled \
            and not (lane is not None and chunk_id in lane.speculations):
        factor /= optimizer.scaler.scale
    owed = optimizer._host_clip_coef
    if owed is not None and optimizer._is_host(grad):
        factor *= float(host_read(owed.reshape(1).float())[0])
    return factor


def _full_chunk_grad(manager, optimizer, chunk) -> torch.Tensor:
    """The whole chunk's gradient (fp32 ``[chunk_numel]``, a host copy); a collective over ``chunk.group``."""
    grad = manager.grad_shards[chunk.chunk_id]
    if chunk.world_size == 1:
        full = to_host(grad)
    else:
        full = torch.empty(chunk.chunk_numel, dtype=torch.float32, device=manager.compute_device)
        all_gather_single(full, to_device(grad, manager.compute_device), group=chunk.group)
        full = to_host(full)
    factor = _factors(optimizer, chunk.chunk_id, grad)
    if factor != 1.0:
        full.mul_(factor)
    return full


def _slot_grad(full: torch.Tensor, slot) -> torch.Tensor:
    return register_host(full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone())


def _named_trainable(model: torch.nn.Module, manager) -> dict[torch.nn.Parameter, str]:
    """Every trainable parameter hf_elixir manages -> its name, in ``model.named_parameters()`` order."""
    names: dict[torch.nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        slot = manager.slot_of.get(param)
        if slot is not None and slot.trainable:
            names.setdefault(param, name)
    return names


def _local_grads(manager, optimizer, names: dict, flags: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: gradient}`` of this rank's parameters in ``names`` that got one; gathers one chunk at a time
    (chunk order: the same on every rank of each chunk's group, as the flags are)."""
    grads: dict[str, torch.Tensor] = {}
    for chunk in manager.chunks:
        wanted = [slot for slot in chunk.slots if slot.param in names and float(flags[slot.flag_index]) > 0]
        if not chunk.trainable or not wanted:
            continue
        full = _full_chunk_grad(manager, optimizer, chunk)
        for slot in wanted:
            grads[names[slot.param]] = _slot_grad(full, slot)
    return grads


def _fused_present(model, fuse, names: dict, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``grads`` with split experts' pieces concatenated into the fused names ([Note: split fused experts] in
    ``hf_elixir/parallel/_expert_units.py``): a fused gradient exists when any piece got one (the pieces always
    run together, so all do), the others count as zeros."""
    local = {name: grads[name] if name in grads else register_host(torch.zeros(param.shape, dtype=torch.float32))
             for param, name in names.items()}
    local, present = fuse(model, local, {name: name in grads for name in local})
    return {name: value for name, value in local.items() if present[name]}


def _assembled(model, assemble, names: dict, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unmodified model's full gradients from this rank's (see [Note: readable gradients]); a collective over
    the tensor/expert-parallel group. A parameter without a gradient on this rank takes part as zeros."""
    local = {name: grads[name] if name in grads else register_host(torch.zeros(param.shape, dtype=torch.float32))
             for param, name in names.items()}
    present = {name: name in grads for name in local}
    fuse = get_state(model).fuse_experts
    if fuse is not None:  # split experts' pieces -> the fused tensors expert parallel reassembles
        local, present = fuse(model, local, present)
    return assemble(local, model, present=present)


@contextlib.contextmanager
def full_gradients(model: torch.nn.Module, *, local: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Full fp32 gradients of every trainable parameter, between ``backward`` and ``optimizer.step()``.

    ``with hf_elixir.full_gradients(model) as grads:`` gives ``{name: gradient}`` for every parameter that
    hf_elixir manages and that got a gradient since the last ``zero_grad``: ``gradient`` is a new fp32 host tensor,
    equal to what plain PyTorch's ``p.grad`` holds after the same ``backward`` (loss scale removed, clipping
    applied; [Note: readable gradients]). For a tensor/expert-parallel model (:func:`hf_elixir.parallel.parallelize`)
    names and shapes are those of the unmodified model, as ``dict(unmodified.named_parameters())`` (shards merged,
    experts of every rank); so are those of fused MoE experts split per expert (``ElixirConfig.split_fused_experts``:
    the pieces concatenated on dim 0). Collective under torch.distributed (every rank enters, in the same order).

    Args:
        model: a model prepared by :func:`hf_elixir.prepare` with an optimizer.
        local: tensor/expert-parallel models only: this rank's view instead, in the parallelized model's names and
            shapes (its tensor-parallel shards, its experts), consolidated over the data-parallel ranks only; no
            collective over the tp/ep group (split fused experts: this rank's fused slices). Other models: no effect.

    Yields:
        ``dict[str, torch.Tensor]``: parameter name -> full gradient (fp32, CPU), in ``named_parameters()`` order
        (of the unmodified model under tensor/expert parallel, unless ``local``).

    Raises:
        ValueError: the model was not prepared, or was prepared without an optimizer; called after
            ``optimizer.step()`` and before ``zero_grad`` (in a Trainer callback, use ``on_pre_optimizer_step``).
        CollectiveEntryError: some rank did not enter it ([Note: collective entry check] in
            ``hf_elixir/runtime/_entry_check.py``).
    """
    manager, optimizer = _optimizer_of(model)
    _check_not_stepped(manager, "hf_elixir.full_gradients(model)")
    check_model_entry("hf_elixir.full_gradients(model)", get_state(model))
    flags = _settle(manager, optimizer)
    names = _named_trainable(model, manager)
    grads = _local_grads(manager, optimizer, names, flags)
    assemble = get_state(model).assemble_full
    if assemble is not None and not local:
        yield _assembled(model, assemble, names, grads)
        return
    grads = {name: grads[name] for name in names.values() if name in grads}  # named_parameters order
    fuse = get_state(model).fuse_experts
    if fuse is not None:  # split experts: the fused names and shapes (this rank's slices with local=True)
        grads = _fused_present(model, fuse, names, grads)
    yield grads


def get_full_grad(param: torch.nn.Parameter, model: torch.nn.Module, *, local: bool = False) -> torch.Tensor | None:
    """The full fp32 gradient of one parameter of a prepared model, between ``backward`` and ``step``.

    As :func:`full_gradients` for one parameter (DeepSpeed's ``safe_get_full_grad(param)``). Collective over the
    ranks the parameter's chunk is sharded over, and for a tensor/expert-parallel model over its tp or ep group
    (every rank calls it for the same parameter: under Switch-style expert parallel, its own rank's expert at the
    same position). It all-gathers the whole chunk, so for many parameters one :func:`full_gradients` costs less.

    Args:
        param: a parameter of ``model``.
        model: the prepared model that holds it.
        local: tensor/expert-parallel models only: the gradient of this rank's local parameter (its shard, its
            experts), no collective over the tp/ep group.

    Returns:
        fp32 host tensor shaped like the parameter of the unmodified model (under tensor/expert parallel: the
        whole tensor, every rank's shards or experts merged; a Switch expert is whole already; a piece of split
        fused experts, ``ElixirConfig.split_fused_experts``, is its own ``(1, ...)`` expert); ``None`` when it
        got no gradient since the last ``zero_grad`` (as PyTorch's ``p.grad``), or is frozen.

    Raises:
        ValueError: ``model`` was not prepared with an optimizer, or ``param`` is not one hf_elixir manages in it;
            called after ``optimizer.step()`` and before ``zero_grad``.
    """
    manager, optimizer = _optimizer_of(model)
    slot = manager.slot_of.get(param)
    if slot is None:
        raise ValueError(f"hf_elixir.get_full_grad: the parameter of shape {tuple(param.shape)} is not managed by "
                         "this prepared model; pass a parameter of model.parameters()")
    _check_not_stepped(manager, "hf_elixir.get_full_grad(param, model)")
    check_model_entry("hf_elixir.get_full_grad(param, model)", get_state(model))
    flags = _settle(manager, optimizer)
    if not slot.trainable:  # the same on every rank: none takes part in a collective
        return None
    grad = None
    if float(flags[slot.flag_index]) > 0:
        grad = _slot_grad(_full_chunk_grad(manager, optimizer, manager.chunk_of[param]), slot)
    assemble = get_state(model).assemble_full
    # a piece of split fused experts (parallel/_expert_units.py): its own (1, ...) rows, this rank's expert
    if assemble is None or local or getattr(param, "_hf_elixir_expert_piece", False):
        return grad
    name = next(n for n, p in model.named_parameters() if p is param)
    return _assembled(model, assemble, {param: name}, {} if grad is None else {name: grad}).get(name)
