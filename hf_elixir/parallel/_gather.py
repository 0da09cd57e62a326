"""Reassemble a tensor/expert-parallel model's full tensors (weights: the full state dict and a standard HF folder;
gradients: ``hf_elixir.full_gradients`` through :func:`assemble_full`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_elixir.chunk.strict import register_host, to_device, to_host
from hf_elixir.parallel._state import ParallelState, get_parallel_state
from hf_elixir.parallel._tensor_parallel import TPShardLayout, merge_shards
from hf_elixir.placement._experts import is_fused_experts

__all__ = ["assemble_full", "gather_full_state_dict", "install_save_guard", "save_pretrained_full"]


def _collective_device(group: Any) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(t: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    """All-gather ``t`` (a host tensor of ``state_dict()``) over ``group`` on the device; host copies out.

    NCCL takes device memory only ([Note: strict device] in ``hf_elixir/chunk/strict.py``): the tensor
    goes to the device, is gathered there, and the parts come back to the host after."""
    device = _collective_device(group)
    src = to_device(t.detach().contiguous(), device)
    out = [torch.empty_like(src) for _ in range(size)]
    dist.all_gather(out, src, group=group)
    return [to_host(part) for part in out]


def _all_gather_tp(t: torch.Tensor, layout: TPShardLayout, group: Any, size: int) -> list[torch.Tensor]:
    """:func:`_all_gather` of a tp shard: uneven shards ([Note: uneven tensor-parallel slices] in
    ``hf_elixir/chunk/_tp_slices.py``) are padded along the split dim to the longest, gathered, and each rank's
    part trimmed back to its own length."""
    sizes = layout.sizes(size)
    if len(set(sizes)) == 1:
        return _all_gather(t, group, size)
    pad = [0, 0] * (t.dim() - layout.dim - 1) + [0, sizes[0] - t.shape[layout.dim]]
    parts = _all_gather(register_host(F.pad(t.detach(), pad)), group, size)
    return [part.narrow(layout.dim, 0, n) for part, n in zip(parts, sizes)]


@dataclass(frozen=True)
class _MpGather:
    """One tensor of this rank all-gathered over a model-parallel group (the tp group for ``"tp"``, the ep group for
    the experts).

    Attributes:
        key: its name in this rank's (parallelized) model.
        kind: ``"tp"`` (shards merged by the tensor's :class:`TPShardLayout`), ``"fused"`` (3-D expert
            slices concatenated on dim 0 in ep-rank order) or ``"experts"`` (Switch-style ``expert_{i}``
            modules: each ep rank's part is a whole tensor of its own expert).
        names: the unmodified model's name of each ep rank's part (``"experts"``), else ``(key,)``.
    """

    key: str
    kind: str
    names: tuple[str, ...]


def _mp_gathers(local: dict[str, torch.Tensor], state: ParallelState, named: dict[str, nn.Module]) -> list[_MpGather]:
    """The all-gathers :func:`assemble_full` issues, in an order that is the same on every rank of the group.

    Switch-style experts pair by local index ``j`` (this rank's ``expert_{ep_rank * L + j}``), never by sorting
    the names as strings (``expert_10`` before ``expert_9`` would pair different experts on different ranks)."""
    mesh = state.mesh
    gathers: list[_MpGather] = []
    for container, num_experts in state.expert_containers.items():
        if is_fused_experts(named[container]):  # this rank's slices of the stacked tensors
            gathers += [_MpGather(k, "fused", (k,)) for k in sorted(k for k in local if k.startswith(container + "."))]
            continue
        num_local = num_experts // mesh.ep_size
        for j in range(num_local):
            prefix = f"{container}.expert_{mesh.ep_rank * num_local + j}."
            for suffix in sorted(k[len(prefix):] for k in local if k.startswith(prefix)):
                names = tuple(f"{container}.expert_{r * num_local + j}.{suffix}" for r in range(mesh.ep_size))
                gathers.append(_MpGather(prefix + suffix, "experts", names))
    gathers += [_MpGather(k, "tp", (k,)) for k in state.full_shapes if k in state.tp_layouts and k in local]
    return gathers


def _presence(gathers: list[_MpGather], present: dict[str, bool] | None, group: Any, size: int) -> list[list[bool]]:
    """For each gather, which ranks of ``group`` hold a value (one all-gather of ``len(gathers)`` flags)."""
    if present is None:
        return [[True] * size for _ in gathers]
    mine = torch.tensor([float(present[g.key]) for g in gathers], dtype=torch.float32)
    if size == 1 or not gathers:
        return [[bool(v)] for v in mine.tolist()]
    parts = _all_gather(register_host(mine), group, size)
    return [list(ranks) for ranks in zip(*(part.bool().tolist() for part in parts))]


@torch.no_grad()
def assemble_full(local: dict[str, torch.Tensor], model: nn.Module, *,
                  present: dict[str, bool] | None = None) -> dict[str, torch.Tensor]:
    """This rank's tensors of a parallelized model -> the unmodified model's full tensors (collective).

    The one reassembly behind :func:`gather_full_state_dict` (weights) and ``hf_elixir.full_gradients``
    (gradients). Tensor-parallel shards are all-gathered over the tp group and merged (:func:`merge_shards`);
    fused 3-D expert slices are all-gathered over the ep group and concatenated on dim 0 in ep-rank order;
    Switch-style ``expert_{i}`` tensors are all-gathered over the ep group and renamed to each owner's global
    expert index; everything else (replicated over the model-parallel group, including ``grad_allreduce``
    parameters whose gradient is already summed over tp) is taken from this rank. Every rank of the
    model-parallel group calls it with the same keys (a Switch expert under its own rank's index), in the
    same order; all-gathers run on the device under NCCL (:func:`_all_gather`).

    Args:
        local: name in the parallelized model -> this rank's tensor (host, any dtype; shapes as in the
            parallelized model).
        model: the model :func:`hf_elixir.parallel.parallelize` rewrote.
        present: name -> whether this rank's value exists (a gradient: ``False`` where PyTorch's ``p.grad``
            would be ``None``; ``local`` then holds zeros of the local shape and dtype for it). A merged tensor
            is kept when some rank of its group has it (the others' parts count as zeros), a Switch expert's
            tensor when its owner has it, a replicated one when this rank has it. ``None``: all present, and no
            flags are exchanged.

    Returns:
        ``{name in the unmodified model: full tensor (CPU)}``, in the unmodified model's ``state_dict`` order.

    Raises:
        ValueError: the model was not rewritten by ``parallelize``.
    """
    state = get_parallel_state(model)
    if state is None:
        raise ValueError("assemble_full needs a model rewritten by hf_elixir.parallel.parallelize")
    mesh = state.mesh
    gathers = _mp_gathers(local, state, dict(model.named_modules()))
    full: dict[str, torch.Tensor] = {}
    # experts over the ep group, then tp slices over the tp group (both under tp x ep): the same order on every rank
    for kinds, group, size in ((("fused", "experts"), mesh.ep_group, mesh.ep_size),
                               (("tp",), mesh.tp_group, mesh.tp_size)):
        mine = [g for g in gathers if g.kind in kinds]
        for gather, has in zip(mine, _presence(mine, present, group, size)):
            if any(has):  # else no rank of the group has it: every rank skips this all-gather
                full.update(_gather_one(gather, local, state, group, size, has))
    gathered = {g.key for g in gathers}
    for key, tensor in local.items():
        if key not in gathered and (present is None or present[key]):
            full[key] = tensor.detach().cpu()
    ordered = {}
    for key, shape in state.full_shapes.items():
        if key in full:
            assert tuple(full[key].shape) == shape, \
                f"rank {dist.get_rank()}: {key} assembled {tuple(full[key].shape)} != {shape}"
            ordered[key] = full[key]
    assert len(ordered) == len(full), f"rank {dist.get_rank()}: not in the unmodified model: {set(full) - set(ordered)}"
    _share_tied(model, ordered)
    return ordered


def _gather_one(gather: _MpGather, local: dict[str, torch.Tensor], state: ParallelState, group: Any, size: int,
                has: list[bool]) -> dict[str, torch.Tensor]:
    """One :class:`_MpGather`'s full tensors (collective over ``group``)."""
    if gather.kind == "tp":
        layout = state.tp_layouts[gather.key]
        parts = _all_gather_tp(local[gather.key], layout, group, size)
        return {gather.key: register_host(merge_shards(parts, layout))}  # on the host
    parts = _all_gather(local[gather.key], group, size)
    if gather.kind == "experts":
        return {name: part for name, part, on in zip(gather.names, parts, has) if on}
    return {gather.key: register_host(torch.cat(parts))}


def _share_tied(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Point every name of a tied parameter at one tensor (the first name's), as PyTorch's ``state_dict`` does: each
    name was all-gathered on its own, and ``save_pretrained`` (``remove_tied_weights_from_state_dict``) and
    safetensors find tied weights by storage, so two copies wrote ``lm_head.weight`` beside the embedding (one key
    more than transformers writes)."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in first:
            first[id(param)] = name
        elif name in full and first[id(param)] in full:
            full[name] = full[first[id(param)]]


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of the unmodified model class, reassembled from tp shards and ep experts.

    Collective: call on every rank. What ``model.state_dict()`` returns for such a model ([Note: one state_dict
    contract] in ``_state_dict.py``), kept on rank 0 only by default. Works on a model also prepared by
    ``hf_elixir.prepare`` (its state dict consolidates the ZeRO chunks over their data-parallel groups into
    this rank's full local tensors), through :func:`assemble_full`: tp shards all-gathered over the tp group
    and merged (GPT-2's ``c_attn`` re-fused per head: ``q|k|v`` with every rank's heads in order), experts
    all-gathered over the ep group (fused 3-D expert slices concatenated on dim 0, in ep rank order).
    Replicated tensors are taken from this rank (they are equal on every rank after a synchronised step).
    Keys and order are those of the model before :func:`hf_elixir.parallel.parallelize`.

    Args:
        model: a model rewritten by ``parallelize``.
        rank0_only: return the dict on global rank 0 only (``{}`` elsewhere).

    Returns:
        ``{key: full tensor (CPU, detached)}``.

    Raises:
        ValueError: the model was not rewritten by ``parallelize``.
    """
    state = get_parallel_state(model)
    if state is None:
        raise ValueError("gather_full_state_dict needs a model rewritten by hf_elixir.parallel.parallelize; "
                         "use model.state_dict() for others")
    full = model.state_dict()  # assembled: [Note: one state_dict contract] in _state_dict.py
    missing = [k for k in state.full_shapes if k not in full]
    assert not missing, f"rank {dist.get_rank()}: not gathered: {missing[:3]}"
    if rank0_only and dist.get_rank() != 0:
        return {}
    return full


def save_pretrained_full(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """Gather the full state dict and write a standard HF folder on rank 0 (collective).

    The folder loads into the unmodified class (``GPT2LMHeadModel.from_pretrained(save_directory)``).
    ``kwargs`` go to ``model.save_pretrained`` (e.g. ``safe_serialization``).
    """
    full = gather_full_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=full, **kwargs)
    dist.barrier()


def install_save_guard(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` of a parallelized model write the unmodified model's folder.

    Without ``state_dict=``, the call becomes :func:`save_pretrained_full` (collective: every rank calls it;
    the full tensors are kept on rank 0 only, which writes). With a ``state_dict=`` whose keys or shapes are not
    the full model's (this rank's parts: ``hf_elixir.parallel.local_state_dict``), it raises ``ValueError``
    instead of writing a folder that fails to load (tp) or loads with random experts (ep). Set as an instance
    attribute (shadows the class method); ``save_pretrained_full`` calls the class method through it with the
    gathered dict.
    """
    if not callable(getattr(model, "save_pretrained", None)):
        return
    original = model.save_pretrained
    state = get_parallel_state(model)

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            full = gather_full_state_dict(model, rank0_only=True)
            if dist.get_rank() == 0:
                original(save_directory, *args, state_dict=full, **kwargs)
            dist.barrier()
            return None
        wrong = [k for k, shape in state.full_shapes.items()
                 if k not in state_dict or tuple(state_dict[k].shape) != shape]
        if wrong:
            raise ValueError(
                f"save_pretrained(state_dict=...) of a tensor/expert-parallel model got this rank's parts "
                f"({len(wrong)} tensors missing or sharded, e.g. {wrong[:3]}): the folder would not load. Call "
                "model.save_pretrained(dir) without state_dict on every rank, or "
                "hf_elixir.parallel.save_pretrained_full(model, dir)")
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    save_pretrained.collective = True  # without state_dict: every rank calls it (read by install_config_dtype)
    model.save_pretrained = save_pretrained
