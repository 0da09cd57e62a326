"""Reassemble a tensor/expert-parallel model's full state dict and save it as a standard HF folder."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_elixir.chunk.strict import register_host, to_device, to_host
from hf_elixir.parallel._state import get_parallel_state
from hf_elixir.parallel._tensor_parallel import merge_shards
from hf_elixir.placement._experts import is_fused_experts

__all__ = ["gather_full_state_dict", "install_save_guard", "save_pretrained_full"]


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


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of the unmodified model class, reassembled from tp shards and ep experts.

    Collective: call on every rank. Works on a model also prepared by ``hf_elixir.prepare`` (built on
    its ``model.state_dict()``, which consolidates the ZeRO chunks over their data-parallel groups into
    this rank's full local tensors). Tp shards are all-gathered over the tp group and merged (GPT-2's
    ``c_attn`` re-fused per head: ``q|k|v`` with every rank's heads in order); experts are
    all-gathered over the ep group (fused 3-D expert slices concatenated on dim 0, in ep rank order). Replicated tensors are taken from this rank (they are equal on
    every rank after a synchronised step). Keys and order are those of the model before
    :func:`hf_elixir.parallel.parallelize`.

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
    mesh = state.mesh
    local = model.state_dict()
    full: dict[str, torch.Tensor] = {}
    named = dict(model.named_modules())
    for container, num_experts in state.expert_containers.items():
        if is_fused_experts(named[container]):  # this rank's slices of the stacked tensors: concatenate
            for key in sorted(k for k in local if k.startswith(container + ".")):
                full[key] = register_host(torch.cat(_all_gather(local[key], mesh.ep_group, mesh.ep_size)).cpu())
            continue
        num_local = num_experts // mesh.ep_size
        first = mesh.ep_rank * num_local
        for j in range(num_local):
            prefix = f"{container}.expert_{first + j}."
            for key in sorted(k for k in local if k.startswith(prefix)):
                suffix = key[len(prefix):]
                for r, t in enumerate(_all_gather(local[key], mesh.ep_group, mesh.ep_size)):
                    full[f"{container}.expert_{r * num_local + j}.{suffix}"] = t.cpu()
    for key in state.full_shapes:
        if key in full:
            continue
        if key in state.tp_layouts:
            parts = _all_gather(local[key], mesh.tp_group, mesh.tp_size)
            full[key] = register_host(merge_shards(parts, state.tp_layouts[key]).cpu())  # merged on the host
        else:
            full[key] = local[key].detach().cpu()
    ordered = {}
    for key, shape in state.full_shapes.items():
        assert tuple(full[key].shape) == shape, f"rank {dist.get_rank()}: {key} gathered {tuple(full[key].shape)} != {shape}"
        ordered[key] = full[key]
    if rank0_only and dist.get_rank() != 0:
        return {}
    return ordered


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

    Hugging Face's ``save_pretrained(dir)`` saves ``model.state_dict()``: on a rewritten model, this
    rank's tensor-parallel shards and experts only, a folder that fails to load (tp) or loads with
    random experts (ep). Without ``state_dict=``, the call becomes :func:`save_pretrained_full`
    (collective: every rank calls it). With a ``state_dict=`` (Trainer, ``accelerator.get_state_dict``)
    whose keys or shapes are not the full model's, it raises ``ValueError`` instead of writing a broken
    folder. Set as an instance attribute (shadows the class method); ``save_pretrained_full`` calls the
    class method through it with the gathered dict.
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
