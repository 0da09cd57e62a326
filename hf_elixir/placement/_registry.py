"""The model-type registry: ``config.model_type`` -> :class:`ModelPlacementSpec`.

Adding a model family is one :func:`register_model_spec` call with a small spec; nothing in the
core changes. Models without an entry get the generic fallback (every module ``"sharded"``).
"""

from __future__ import annotations

from hf_elixir.placement._spec import ModelPlacementSpec, TensorParallelBlock

__all__ = ["GENERIC_SPEC", "MODEL_TYPE_TO_SPEC", "get_model_spec", "register_model_spec"]

GENERIC_SPEC = ModelPlacementSpec(model_type="*")

_GPT2 = ModelPlacementSpec(
    model_type="gpt2",
    tensor_parallel={
        "*.attn.c_attn": "column",  # Conv1D (in, 3*embd): q|k|v, each split by heads
        "*.attn.c_proj": "row",
        "*.mlp.c_fc": "column",
        "*.mlp.c_proj": "row",
    },
    blocks=(
        TensorParallelBlock(parent="*.attn", column=("c_attn",), row="c_proj", fused_parts=3,
                            num_heads_attr="num_heads", width_attrs=("split_size",)),
        TensorParallelBlock(parent="*.mlp", column=("c_fc",), row="c_proj"),
    ),
)

_OPT = ModelPlacementSpec(
    model_type="opt",
    tensor_parallel={
        "*.self_attn.q_proj": "column",
        "*.self_attn.k_proj": "column",
        "*.self_attn.v_proj": "column",
        "*.self_attn.out_proj": "row",
        "*.layers.*.fc1": "column",
        "*.layers.*.fc2": "row",
    },
    blocks=(
        TensorParallelBlock(parent="*.self_attn", column=("q_proj", "k_proj", "v_proj"), row="out_proj",
                            num_heads_attr="num_heads"),
        TensorParallelBlock(parent="*.layers.*", column=("fc1",), row="fc2"),
    ),
)

_SWITCH = ModelPlacementSpec(
    model_type="switch_transformers",
    expert_parallel={"*.mlp.experts": "expert"},
    expert_containers=("SwitchTransformersExperts",),
)

MODEL_TYPE_TO_SPEC: dict[str, ModelPlacementSpec] = {s.model_type: s for s in (_GPT2, _OPT, _SWITCH)}


def register_model_spec(spec: ModelPlacementSpec, *, overwrite: bool = False) -> None:
    """Add (or with ``overwrite=True`` replace) the spec for ``spec.model_type``.

    Raises:
        TypeError: ``spec`` is not a :class:`ModelPlacementSpec`.
        ValueError: a spec for that model type exists and ``overwrite`` is False.
    """
    if not isinstance(spec, ModelPlacementSpec):
        raise TypeError(f"register_model_spec(spec={spec!r}) needs a ModelPlacementSpec")
    if spec.model_type in MODEL_TYPE_TO_SPEC and not overwrite:
        raise ValueError(
            f"a placement spec for model_type={spec.model_type!r} is already registered; "
            "pass overwrite=True to replace it"
        )
    MODEL_TYPE_TO_SPEC[spec.model_type] = spec


def get_model_spec(model_type: str | None) -> ModelPlacementSpec:
    """The registered spec for ``model_type``, or the generic fallback (every module sharded)."""
    return MODEL_TYPE_TO_SPEC.get(model_type or "", GENERIC_SPEC)
