"""Tensor and expert parallelism on a ``(dp, tp)`` or ``(dp, ep)`` device mesh, or both on one mesh (``_mesh.py``).

Public surface: :func:`build_mesh` / :class:`ElixirMesh`, :func:`parallelize` (rewrites a model in
place from its resolved placements), :func:`reduce_gradients` / :func:`param_process_groups` (which
group each gradient is reduced over), :func:`gather_full_state_dict` / :func:`save_pretrained_full`
(back to a standard Hugging Face checkpoint: what ``model.state_dict()`` returns), :func:`local_state_dict` (this
rank's parts) and :func:`load_full_state_dict` (from one, e.g. to resume),
and the layers themselves (Switch's :class:`ExpertParallelExperts`; :func:`shard_fused_experts` /
:class:`FusedExpertDispatch` for the fused 3-D experts of Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss;
:func:`split_fused_experts` / :func:`unsplit_fused_experts`, one hook unit per expert, which ``prepare`` applies
by default).
"""

from hf_elixir.parallel._apply import (
    param_process_groups,
    parallelize,
    placements_for_plan,
    reduce_gradients,
)
from hf_elixir.parallel._collectives import all_to_all, copy_to_group, reduce_from_group
from hf_elixir.parallel._expert_parallel import ExpertParallelExperts
from hf_elixir.parallel._expert_units import SplitExpertsForward, split_fused_experts, unsplit_fused_experts
from hf_elixir.parallel._fused_experts import FusedExpertDispatch, shard_fused_experts
from hf_elixir.parallel._gather import gather_full_state_dict, save_pretrained_full
from hf_elixir.parallel._load import load_full_state_dict
from hf_elixir.parallel._mesh import ElixirMesh, build_mesh
from hf_elixir.parallel._state import ParallelState, get_parallel_state
from hf_elixir.parallel._state_dict import local_state_dict
from hf_elixir.parallel._tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPShardLayout

__all__ = [
    "ColumnParallelLinear",
    "ElixirMesh",
    "ExpertParallelExperts",
    "FusedExpertDispatch",
    "ParallelState",
    "RowParallelLinear",
    "SplitExpertsForward",
    "TPShardLayout",
    "all_to_all",
    "build_mesh",
    "copy_to_group",
    "gather_full_state_dict",
    "get_parallel_state",
    "load_full_state_dict",
    "local_state_dict",
    "param_process_groups",
    "parallelize",
    "placements_for_plan",
    "reduce_from_group",
    "reduce_gradients",
    "save_pretrained_full",
    "shard_fused_experts",
    "split_fused_experts",
    "unsplit_fused_experts",
]
