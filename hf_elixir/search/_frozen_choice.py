"""``ElixirConfig.frozen_placement`` resolved for a model ([Note: whole frozen chunks] in
``hf_elixir/chunk/_frozen_whole.py``): the frozen bytes, the host budget and this machine's cached rates, priced by
:func:`~hf_elixir.chunk._frozen_whole.choose_frozen_whole`. ``prepare`` (``_lay_out.py``), its floor (``_floor.py``)
and the search's packing (``_plan_search.py``) all take the decision from here, so they lay out the same chunks.
"""

from __future__ import annotations

import dataclasses

from hf_elixir.chunk._build import element_bytes
from hf_elixir.chunk._frozen_whole import choose_frozen_whole
from hf_elixir.chunk.memory import default_host_budget_bytes
from hf_elixir.config import ElixirConfig
from hf_elixir.parallel import get_parallel_state
from hf_elixir.placement._plan_check import load_plan
from hf_elixir.profiler._device import select_compute_device
from hf_elixir.profiler._hardware import cached_rates

__all__ = ["frozen_whole", "resolve_frozen_placement", "searched_frozen_whole"]


def resolve_frozen_placement(params, config: ElixirConfig, world_size: int, *, is_parallel: bool,
                             rates: dict | None = None) -> tuple[ElixirConfig, str]:
    """``config`` with ``frozen_placement`` ``"whole"`` or ``"sharded"``, and the reason ("" when nothing was priced).
    With an ``ElixirConfig.plan``: as the plan was made (``ElixirPlan.frozen_whole``; ``hf-elixir plan``'s are sharded).

    Raises:
        ValueError: ``frozen_placement`` "whole" or "sharded" against a plan made the other way.

    Args:
        params: the floating-point parameters ``prepare`` packs (their ``requires_grad`` says which are frozen).
        world_size: ranks of the data-parallel group.
        is_parallel: a tensor/expert-parallel model.
        rates: ``h2d_bytes_per_s`` / ``allgather_bytes_per_s`` (a ``HardwareProfile``'s fields); ``None``: the ones
            :func:`~hf_elixir.profiler._hardware.cached_rates` has for this machine at ``world_size`` ranks.
    """
    plan = load_plan(config)
    if plan is not None:  # a given plan numbers the chunks of the layout it was made for
        if config.frozen_placement != "auto" and (config.frozen_placement == "whole") != plan.frozen_whole:
            raise ValueError(f"ElixirConfig.frozen_placement={config.frozen_placement!r} but the plan was made with the "
                             f"frozen chunks {'whole' if plan.frozen_whole else 'sharded'} (ElixirPlan.frozen_whole="
                             f"{plan.frozen_whole}); leave frozen_placement='auto' to follow the plan, or make a new plan")
        return dataclasses.replace(config, frozen_placement="whole" if plan.frozen_whole else "sharded"), ""
    if config.frozen_placement != "auto":
        whole, reason = choose_frozen_whole(config.frozen_placement, world_size, 0, 0, None, None, is_parallel)
        return dataclasses.replace(config, frozen_placement="whole" if whole else "sharded"), reason
    frozen = sum(p.numel() for p in params if not p.requires_grad) * element_bytes(config.precision)
    device = select_compute_device()
    if frozen and world_size > 1 and not is_parallel and rates is None:
        rates = cached_rates(device, world_size) or {}
    rates = rates or {}
    host = config.host_memory_budget_bytes or default_host_budget_bytes()
    whole, reason = choose_frozen_whole("auto", world_size, frozen, host, rates.get("h2d_bytes_per_s"),
                                        rates.get("allgather_bytes_per_s"), is_parallel,
                                        trains=any(p.requires_grad for p in params), device_type=device.type)
    return dataclasses.replace(config, frozen_placement="whole" if whole else "sharded"), reason


def frozen_whole(config: ElixirConfig) -> bool:
    """A resolved config's decision (``"auto"`` counts as not yet resolved: sharded)."""
    return config.frozen_placement == "whole"



def searched_frozen_whole(model, config, world_size: int, hardware) -> bool:
    """Whether the search packs frozen chunks whole: a config ``prepare`` resolved says so; ``"auto"`` (``auto_plan``
    called directly) is priced at ``hardware``'s rates (a ``HardwareProfile``)."""
    if not isinstance(config, ElixirConfig):
        return False
    params = [p for p in dict.fromkeys(model.parameters()) if p.is_floating_point()]
    resolved, _ = resolve_frozen_placement(params, config, world_size, rates=hardware.to_dict(),
                                           is_parallel=get_parallel_state(model) is not None)
    return frozen_whole(resolved)
