"""Per-module placements: a model-type registry of small declarative specs plus user glob overrides.

Public surface: :data:`PLACEMENTS`, :class:`ModelPlacementSpec`, :class:`TensorParallelBlock`,
:func:`register_model_spec`, :func:`get_model_spec`, :func:`resolve_placements`.
"""

from hf_elixir.placement._registry import get_model_spec, register_model_spec
from hf_elixir.placement._resolve import ResolvedPlacements, resolve_placements, resolve_placements_detailed
from hf_elixir.placement._spec import PLACEMENTS, ModelPlacementSpec, TensorParallelBlock

__all__ = [
    "PLACEMENTS",
    "ModelPlacementSpec",
    "ResolvedPlacements",
    "TensorParallelBlock",
    "get_model_spec",
    "register_model_spec",
    "resolve_placements",
    "resolve_placements_detailed",
]
