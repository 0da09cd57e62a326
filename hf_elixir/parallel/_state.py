"""What :func:`hf_elixir.parallel.parallelize` did to a model, kept on the model: read by the gather, the
gradient groups and ``prepare`` without importing the rewrite itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hf_elixir.parallel._mesh import ElixirMesh
from hf_elixir.parallel._tensor_parallel import TPShardLayout

__all__ = ["ParallelState", "get_parallel_state"]

_STATE_ATTR = "_hf_elixir_parallel"


@dataclass
class ParallelState:
    """What :func:`~hf_elixir.parallel.parallelize` did to a model (kept on it as ``model._hf_elixir_parallel``).

    Attributes:
        mesh: the :class:`ElixirMesh`.
        placements: module FQN -> placement (record as ``ElixirPlan.placements``).
        full_shapes: state-dict key -> full shape, in the unmodified model's key order.
        tp_layouts: parameter FQN -> :class:`TPShardLayout` for tp-sharded parameters.
        expert_containers: FQN -> number of experts, for expert-parallel containers.
    """

    mesh: ElixirMesh
    placements: dict[str, str]
    full_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tp_layouts: dict[str, TPShardLayout] = field(default_factory=dict)
    expert_containers: dict[str, int] = field(default_factory=dict)

    def is_expert_param(self, name: str) -> bool:
        return any(name.startswith(c + ".") for c in self.expert_containers)

    def stream_shards(self) -> dict:
        """Parameter name -> ``TensorShard``: what streamed init reads for each tp-split parameter (see
        [Note: streamed tensor-parallel shards] in ``hf_elixir/chunk/_stream_load.py``)."""
        from hf_elixir.chunk._stream_load import TensorShard  # noqa: PLC0415 (a lower layer, used only here)

        mesh = self.mesh
        return {name: TensorShard(lay.dim, lay.parts, mesh.tp_rank, mesh.tp_size, lay.full_size)
                for name, lay in self.tp_layouts.items()}


def get_parallel_state(model: nn.Module) -> ParallelState | None:
    """The :class:`ParallelState` of a model rewritten by :func:`~hf_elixir.parallel.parallelize`, else ``None``."""
    return getattr(model, _STATE_ATTR, None)
