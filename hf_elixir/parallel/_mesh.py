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

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ElixirMesh", "build_mesh"]


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
        raise RuntimeError("build_mesh needs torch.distributed.init_process_group(...) first")
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
