"""Loading ``ElixirConfig.plan`` and checking that it was made for this run (model, world size,
precision, budget, chunk count, per-module placements) before ``prepare`` follows it."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_elixir.config import ElixirConfig
from hf_elixir.plan import ElixirPlan

__all__ = ["check_plan", "check_plan_placements", "load_plan"]


def load_plan(config: ElixirConfig) -> ElixirPlan | None:
    """``config.plan`` as an :class:`ElixirPlan` (read from its file when it is a path).

    Raises:
        FileNotFoundError: the path is not a file.
        TypeError: ``config.plan`` is neither a plan, a path nor ``None``.
    """
    plan = config.plan
    if plan is None or isinstance(plan, ElixirPlan):
        return plan
    if isinstance(plan, (str, Path)):
        if not Path(plan).is_file():
            raise FileNotFoundError(f"ElixirConfig.plan={str(plan)!r} is not a file; write one with "
                                    "`hf-elixir plan ... --output plan.yaml` or pass an ElixirPlan")
        return ElixirPlan.load(plan)
    raise TypeError(f"ElixirConfig.plan={plan!r} must be an ElixirPlan, a path to a plan file, or None")


def check_plan(plan: ElixirPlan, model: torch.nn.Module, num_params: int, world_size: int,
               precision: str, num_chunks: int, budget: int | None = None, reduce_dtype: str | None = "fp32") -> None:
    """Raise ``ValueError`` when ``plan`` was made for another precision, budget, model or world size, or a searched
    plan for another ``reduce_dtype`` (its gradient bytes were priced at that dtype)."""
    if plan.precision != precision:  # the one mismatch the user fixes in the config, not by re-planning
        raise ValueError(f"ElixirConfig.plan was made for precision={plan.precision!r} but ElixirConfig.precision="
                         f"{precision!r} (the default is 'fp32'; `hf-elixir plan` defaults to bf16): set "
                         f"ElixirConfig(precision={plan.precision!r}), or re-run `hf-elixir plan --precision "
                         f"{precision}`")
    if plan.predicted_step_s is not None and plan.reduce_dtype != reduce_dtype:
        raise ValueError(f"ElixirConfig.plan was searched with reduce_dtype={plan.reduce_dtype!r} (its gradient "
                         f"buffers and reduces priced at that dtype) but ElixirConfig.reduce_dtype={reduce_dtype!r}: "
                         f"set ElixirConfig(reduce_dtype={plan.reduce_dtype!r}), or re-run `hf-elixir plan "
                         f"--reduce-dtype {'fp32' if reduce_dtype == 'fp32' else 'compute'}`")
    if budget is not None and plan.predicted_peak_device_bytes and plan.predicted_peak_device_bytes > budget:
        raise ValueError(f"ElixirConfig.plan predicts a device peak of {plan.predicted_peak_device_bytes} bytes but "
                         f"device_memory_budget_bytes={budget}: the plan was made for a larger budget. Re-run the "
                         "search (`hf-elixir plan --gpu-memory ...`) for this budget, or raise the budget")
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    problems = []
    if plan.model_type and model_type and plan.model_type != model_type:
        problems.append(f"model_type {plan.model_type!r} (this model is {model_type!r})")
    if plan.num_params and plan.num_params != num_params:
        problems.append(f"num_params {plan.num_params} (this model has {num_params})")
    if plan.world_size != world_size:
        problems.append(f"world_size {plan.world_size} (this run has {world_size})")
    bad = [c for c in plan.resident_chunks + plan.device_shard_chunks + plan.device_optim_chunks
           + plan.host_copy_chunks if c >= num_chunks]
    if bad:
        problems.append(f"chunk ids {sorted(set(bad))} (this model packs into {num_chunks} chunks)")
    if problems:
        raise ValueError("ElixirConfig.plan was made for another run: it has " + "; ".join(problems)
                         + ". Re-run the search (`hf-elixir plan`) for this model and world size")


def check_plan_placements(plan: ElixirPlan, placements: dict[str, str]) -> None:
    """Raise ``ValueError`` when the plan's per-module placements (if any) differ from ``placements``."""
    if plan.placements and dict(plan.placements) != placements:
        changed = sorted(k for k in set(plan.placements) | set(placements)
                         if plan.placements.get(k) != placements.get(k))
        raise ValueError(f"ElixirConfig.plan.placements differ from this model's placements at {changed[:5]}; "
                         "re-run the search (`hf-elixir plan`) with the same ElixirConfig.placements and "
                         "tensor/expert-parallel sizes")
