"""The process mesh: data-parallel x tensor-parallel or data-parallel x expert-parallel.

Ranks are laid out row-major over ``(dp, mp)``: rank = dp_index * mp_size + mp_index, so the
model-parallel (tp or ep) peers of a rank are neighbours (same node on GPU clusters).

Which group each parameter's gradient is averaged (and, under ZeRO, sharded) over
([Note: gradient groups]); the rule is always "average over the group":

- dp x tp: all tp ranks of a row see the *same* batch. Column/row shards differ per tp rank; every
  other parameter is replicated over tp and gets *identical* gradients there (Megatron's identity /
  all-reduce operator pair makes the layer-norm and embedding gradients complete on every tp rank).
  So every parameter is averaged over the ``dp`` axis only (``dp_group``).
- dp x ep: every rank sees its *own* batch, so non-expert parameters are averaged over the whole
  world (``dp_group`` is the world). An expert lives on one ep rank per row and receives the
  gradient of every ep peer's tokens through the all-to-all, pre-divided by ``ep_size`` (see
  [Note: expert gradient scale] in ``_expert_parallel.py``); it is averaged over the ``dp`` axis
  (``expert_dp_group``: the ranks holding the same experts).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ElixirMesh", "build_mesh"]

logger = logging.getLogger(__name__)


@dataclass
class ElixirMesh:
    """A 2-D device mesh and the process groups cut from it.

    Attributes:
        device_mesh: the ``torch.distributed`` mesh, dims ``("dp", "tp")`` or ``("dp", "ep")``.
        mp_axis: ``"tp"`` or ``"ep"`` (the model-parallel axis name).
        dp_size / tp_size / ep_size: axis sizes (the unused one is 1).
        dp_group: group non-expert gradients are averaged over (``dp`` axis under tp; the world
            under ep); pass it as ``ElixirConfig.process_group``.
        tp_group / ep_group: the model-parallel group of this rank (``None`` when the size is 1).
        expert_dp_group: group expert gradients are averaged over (the ``dp`` axis).
    """

    device_mesh: DeviceMesh
    mp_axis: str
    dp_size: int
    tp_size: int
    ep_size: int
    dp_group: Any
    tp_group: Any
    ep_group: Any
    expert_dp_group: Any

    @property
    def world_size(self) -> int:
        return self.dp_size * max(self.tp_size, self.ep_size)

    @property
    def tp_rank(self) -> int:
        return self.device_mesh.get_local_rank("tp") if self.mp_axis == "tp" else 0

    @property
    def ep_rank(self) -> int:
        return self.device_mesh.get_local_rank("ep") if self.mp_axis == "ep" else 0

    @property
    def num_batches(self) -> int:
        """Distinct batches per step (dp rows under tp; every rank under ep)."""
        return self.dp_size if self.mp_axis == "tp" else self.world_size


def build_mesh(config: Any, *, device_type: str | None = None) -> ElixirMesh:
    """Build the mesh for ``config.tensor_parallel_size`` / ``config.expert_parallel_size``.

    Must be called on every rank after ``torch.distributed.init_process_group`` (it creates groups).

    Args:
        config: an :class:`hf_elixir.ElixirConfig`.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` under NCCL, else ``"cpu"`` (gloo).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: both axes > 1, or the world size is not a multiple of the model-parallel size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"parallelize / build_mesh (tensor_parallel_size={config.tensor_parallel_size}, expert_parallel_size="
            f"{config.expert_parallel_size}) needs torch.distributed initialised: launch with torchrun or "
            "accelerate launch and call torch.distributed.init_process_group() first (with the Trainer too: "
            "parallelize runs before Trainer(...) would initialise it)")
    tp_size, ep_size = config.tensor_parallel_size, config.expert_parallel_size
    if tp_size > 1 and ep_size > 1:
        raise ValueError(
            f"ElixirConfig.tensor_parallel_size={tp_size} and expert_parallel_size={ep_size} are both > 1; "
            "the mesh is dp x tp or dp x ep: set one of them to 1"
        )
    world_size = dist.get_world_size()
    mp_axis, mp_size = ("ep", ep_size) if ep_size > 1 else ("tp", tp_size)
    if world_size % mp_size:
        raise ValueError(
            f"world size {world_size} does not factor into dp x {mp_axis} with "
            f"{'expert' if mp_axis == 'ep' else 'tensor'}_parallel_size={mp_size}; use a size that divides {world_size}"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dp_size = world_size // mp_size
    _warn_if_mp_groups_cross_nodes(mp_axis, mp_size)
    if device_type == "cuda":
        _set_device_before_mesh()
    mesh = init_device_mesh(device_type, (dp_size, mp_size), mesh_dim_names=("dp", mp_axis))
    dp_axis_group = mesh.get_group("dp")
    mp_group = mesh.get_group(mp_axis)
    return ElixirMesh(
        device_mesh=mesh,
        mp_axis=mp_axis,
        dp_size=dp_size,
        tp_size=tp_size,
        ep_size=ep_size,
        dp_group=dp_axis_group if mp_axis == "tp" else dist.group.WORLD,
        tp_group=mp_group if mp_axis == "tp" else None,
        ep_group=mp_group if mp_axis == "ep" else None,
        expert_dp_group=dp_axis_group,
    )


# [Note: mesh across nodes]
# Launchers (torchrun, accelerate launch, SLURM) number ranks node by node: node n holds ranks
# n * LOCAL_WORLD_SIZE ... (n + 1) * LOCAL_WORLD_SIZE - 1. The row-major (dp, mp) layout makes each
# model-parallel group a block of mp_size consecutive ranks, so the groups stay inside a node (their
# collectives run every layer) and the dp groups cross nodes (once a step), as long as mp_size divides
# LOCAL_WORLD_SIZE. Otherwise the mesh is still correct but the per-layer collectives cross the network:
# said once, with the fix. On CUDA, ``init_device_mesh`` sets the device of a process that has none to
# ``cuda:LOCAL_RANK``; a process given one GPU by ``CUDA_VISIBLE_DEVICES`` (LOCAL_RANK 1 sees only
# ``cuda:0``) would fail there with an invalid device ordinal, so build_mesh makes cuda:0 current first,
# the device ``hf_elixir.prepare`` computes on in that set-up (see [Note: device selection]).


def _warn_if_mp_groups_cross_nodes(mp_axis: str, mp_size: int) -> None:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if mp_size <= 1 or raw is None or not raw.isdigit() or int(raw) % mp_size == 0:
        return
    logger.warning(
        "%s_parallel_size=%d does not divide the %s ranks on this node (LOCAL_WORLD_SIZE): some %s groups span "
        "two nodes and their collectives (every layer) cross the network; use a %s_parallel_size that divides %s",
        "tensor" if mp_axis == "tp" else "expert", mp_size, raw, mp_axis, "tensor" if mp_axis == "tp" else "expert",
        raw)


def _set_device_before_mesh() -> None:
    if torch.cuda.is_available() and not torch.cuda.is_initialized() and torch.cuda.device_count() == 1:
        torch.cuda.set_device(0)
