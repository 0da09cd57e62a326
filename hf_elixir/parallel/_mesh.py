"""The process mesh: data-parallel x tensor-parallel, data-parallel x expert-parallel, or both at once.

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
- tp x ep: see [Note: tp x ep mesh].

[Note: tp x ep mesh] With ``tensor_parallel_size = tp > 1`` and ``expert_parallel_size = ep > 1`` the world is
laid out twice over the same ranks, as transformers' ``DistributedConfig(tp_size, fsdp_size, ep_size)`` does
(``distributed/configuration_utils.py``, ``efsdp_size``): a *dense view* ``(dp, tp)`` (rank = dp_index * tp +
tp_index; attention and dense MLPs split over ``tp``, the tp ranks of a row share one batch, so there are
``dp = world / tp`` batches) and an *expert view* ``(edp, ep)`` (rank = edp_index * ep + ep_index; each ep group
of ``ep`` consecutive ranks holds every expert once, ``E / ep`` each, and the ``edp = world / ep`` ranks holding
the same experts shard them). ``ep`` must be a multiple of ``tp`` and divide the world: an ep group is then
``ep / tp`` whole tp groups (one node when ``ep`` divides the ranks of a node), and it holds ``ep / tp``
distinct batches. Inside the experts' dispatch the tp ranks of a row take disjoint slices of their shared batch's
tokens (each token reaches its expert once), exchange them by all-to-all over the ep group, and all-gather the
outputs back over tp (``_fused_experts.py``). Gradient groups: every non-expert parameter over the dense ``dp``
axis (as dp x tp), experts over the expert view's ``edp`` axis, their gradient divided by the ``ep / tp``
batches of their ep group ([Note: expert gradient scale in the graph]); an expert is held by one ep index, so
it counts once in the global norm (a dense replicated parameter counts ``tp`` times).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ElixirMesh", "build_mesh", "check_tp_ep_sizes", "valid_tp_ep_sizes"]

logger = logging.getLogger(__name__)


@dataclass
class ElixirMesh:
    """A 2-D device mesh and the process groups cut from it.

    Attributes:
        device_mesh: the ``torch.distributed`` mesh, dims ``("dp", "tp")`` or ``("dp", "ep")`` (under tp x ep
            the dense view ``("dp", "tp")``).
        mp_axis: ``"tp"``, ``"ep"`` or ``"tp_ep"`` (both; [Note: tp x ep mesh]).
        dp_size / tp_size / ep_size: axis sizes (the unused one is 1); under tp x ep ``dp_size`` is the dense
            view's ``world / tp``.
        dp_group: group non-expert gradients are averaged over (``dp`` axis under tp; the world
            under ep); pass it as ``ElixirConfig.process_group``.
        tp_group / ep_group: the model-parallel group of this rank (``None`` when the size is 1).
        expert_dp_group: group expert gradients are averaged over (the ``dp`` axis; the expert view's ``edp`` axis
            under tp x ep).
        expert_mesh: the expert view ``("edp", "ep")`` under tp x ep, else ``None``.
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
    expert_mesh: DeviceMesh | None = None

    @property
    def world_size(self) -> int:
        return self.dp_size * (self.tp_size if self.mp_axis != "ep" else self.ep_size)

    @property
    def tp_rank(self) -> int:
        return self.device_mesh.get_local_rank("tp") if self.mp_axis in ("tp", "tp_ep") else 0

    @property
    def ep_rank(self) -> int:
        if self.mp_axis == "tp_ep":
            return self.expert_mesh.get_local_rank("ep")
        return self.device_mesh.get_local_rank("ep") if self.mp_axis == "ep" else 0

    @property
    def shares_batches_over_tp(self) -> bool:
        """Do the tp ranks of a dp row read one batch (tensor parallel, alone or with expert parallel)?"""
        return self.mp_axis in ("tp", "tp_ep") and self.tp_size > 1

    @property
    def num_batches(self) -> int:
        """Distinct batches per step (dp rows under tp and tp x ep; every rank under ep)."""
        return self.dp_size if self.mp_axis != "ep" else self.world_size

    @property
    def batch_index(self) -> int:
        """Which of the :attr:`num_batches` batches this rank reads (its dp row, or its rank under ep)."""
        return self.device_mesh.get_local_rank("dp") if self.mp_axis != "ep" else dist.get_rank()


def build_mesh(config: Any, *, device_type: str | None = None) -> ElixirMesh:
    """Build the mesh for ``config.tensor_parallel_size`` / ``config.expert_parallel_size``.

    Must be called on every rank after ``torch.distributed.init_process_group`` (it creates groups).

    Args:
        config: an :class:`hf_elixir.ElixirConfig`.
        device_type: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` under NCCL, else ``"cpu"`` (gloo).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the world size is not a multiple of the model-parallel size; with both axes > 1, see
            :func:`check_tp_ep_sizes`.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"parallelize / build_mesh (tensor_parallel_size={config.tensor_parallel_size}, expert_parallel_size="
            f"{config.expert_parallel_size}) needs torch.distributed initialised: launch with torchrun or "
            "accelerate launch and call torch.distributed.init_process_group() first (with the Trainer too: "
            "parallelize runs before Trainer(...) would initialise it)")
    tp_size, ep_size = config.tensor_parallel_size, config.expert_parallel_size
    world_size = dist.get_world_size()
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if tp_size > 1 and ep_size > 1:
        return _build_tp_ep_mesh(tp_size, ep_size, world_size, device_type)
    mp_axis, mp_size = ("ep", ep_size) if ep_size > 1 else ("tp", tp_size)
    if world_size % mp_size:
        raise ValueError(
            f"world size {world_size} does not factor into dp x {mp_axis} with "
            f"{'expert' if mp_axis == 'ep' else 'tensor'}_parallel_size={mp_size}; use a size that divides {world_size}"
        )
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


def valid_tp_ep_sizes(world_size: int) -> list[tuple[int, int]]:
    """Every ``(tensor_parallel_size, expert_parallel_size)`` pair, both > 1, that lays ``world_size`` ranks out as
    [Note: tp x ep mesh] asks: ``tp`` divides ``ep`` and ``ep`` divides the world."""
    return [(tp, ep) for ep in range(2, world_size + 1) if world_size % ep == 0
            for tp in range(2, ep + 1) if ep % tp == 0]


def check_tp_ep_sizes(tp_size: int, ep_size: int, world_size: int) -> None:
    """Refuse a tp x ep mesh that does not divide ``world_size`` ranks (see [Note: tp x ep mesh]).

    Raises:
        ValueError: ``ep`` is not a multiple of ``tp``, or does not divide the world; names tp, ep, the world size
            and the valid pairs.
    """
    if ep_size % tp_size == 0 and world_size % ep_size == 0:
        return
    why = (f"expert_parallel_size={ep_size} is not a multiple of tensor_parallel_size={tp_size} (an expert-parallel "
           "group is made of whole tensor-parallel groups)" if ep_size % tp_size else
           f"expert_parallel_size={ep_size} does not divide the world size {world_size}")
    valid = ", ".join(f"(tp={tp}, ep={ep})" for tp, ep in valid_tp_ep_sizes(world_size)) or "none"
    raise ValueError(
        f"ElixirConfig(tensor_parallel_size={tp_size}, expert_parallel_size={ep_size}) does not lay out {world_size} "
        f"ranks as dp x tp (dense) and edp x ep (experts): {why}. Valid pairs at world size {world_size}: {valid}; "
        "or set one of the two sizes to 1")


def _build_tp_ep_mesh(tp_size: int, ep_size: int, world_size: int, device_type: str) -> ElixirMesh:
    """The two views of [Note: tp x ep mesh] over the same ranks."""
    check_tp_ep_sizes(tp_size, ep_size, world_size)
    _warn_if_mp_groups_cross_nodes("ep", ep_size)  # the ep groups contain the tp groups
    if device_type == "cuda":
        _set_device_before_mesh()
    dense = init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    experts = init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    return ElixirMesh(
        device_mesh=dense, mp_axis="tp_ep", dp_size=world_size // tp_size, tp_size=tp_size, ep_size=ep_size,
        dp_group=dense.get_group("dp"), tp_group=dense.get_group("tp"), ep_group=experts.get_group("ep"),
        expert_dp_group=experts.get_group("edp"), expert_mesh=experts)


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
