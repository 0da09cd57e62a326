"""The style tables of ``hf_elixir/placement/_hf_plans.py`` against the installed transformers' own registry of
parallel styles (``transformers.distributed.parallel_utils.ALL_PARALLEL_STYLES``, filled when
``distributed/tensor_parallel.py`` and ``distributed/expert_parallel.py`` are imported).

A transformers release that adds a style fails :func:`test_every_registered_style_is_mapped_or_refused` until the
table maps it or the refusal list below names it; one that drops a style (``moe_tp_experts`` is deprecated, with
removal announced for v5.28) fails :func:`test_every_mapped_style_is_registered` until its entry goes."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers.distributed.expert_parallel  # noqa: F401 (registers the EP styles)
import transformers.distributed.mixin as tf_mixin
import transformers.distributed.tensor_parallel  # noqa: F401 (registers the TP styles)
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

from hf_elixir.placement._hf_plans import (EP_STYLE_TO_PLACEMENT, PARAM_STYLE_TO_SPLIT, TP_STYLE_TO_PLACEMENT,
                                           plan_placements)

#: styles transformers registers that hf_elixir refuses (``plan_placements`` raises naming them), and why
REFUSED = {
    "unit_colwise": "a whole-unit column split transformers applies to its own fused modules",
    "unit_rowwise": "a whole-unit row split transformers applies to its own fused modules",
    "sequence_parallel": "activations split over the sequence: no parameter to place",
    "all_reduce": "an output all-reduce with nothing split",
    "local_params": "a module run on local shards of parameters another entry splits",
}


def _registered() -> set[str]:
    return set(ALL_PARALLEL_STYLES.keys())


def test_every_mapped_style_is_registered():
    mapped = set(TP_STYLE_TO_PLACEMENT) | set(EP_STYLE_TO_PLACEMENT) | set(PARAM_STYLE_TO_SPLIT)
    assert mapped - _registered() == set(), "hf_elixir maps styles the installed transformers no longer registers"


def test_every_registered_style_is_mapped_or_refused():
    known = set(TP_STYLE_TO_PLACEMENT) | set(EP_STYLE_TO_PLACEMENT) | set(PARAM_STYLE_TO_SPLIT) | set(REFUSED)
    assert _registered() - known == set(), "transformers registers styles hf_elixir neither maps nor refuses"
    assert set(REFUSED) & set(TP_STYLE_TO_PLACEMENT) == set()


class _Planned(torch.nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.tp_plan = {"lin": style}


@pytest.mark.parametrize("style", sorted(REFUSED))
def test_refused_style_raises_naming_it(style):
    with pytest.raises(ValueError, match=f"style '{style}'.*tensor_parallel_size=1"):
        plan_placements(_Planned(style), 2, 1)


def test_moe_tp_experts_is_deprecated_upstream():
    """transformers refuses ``moe_tp_experts`` in an expert-parallel plan and announces its removal; hf_elixir still
    maps it for tensor-parallel plans that name it (Llama-4's config does), until the registry drops it."""
    assert "moe_tp_experts" in _registered()
    assert "moe_tp_experts" in TP_STYLE_TO_PLACEMENT
    assert "`moe_tp_experts` parallel styles have been deprecated" in inspect.getsource(tf_mixin)
