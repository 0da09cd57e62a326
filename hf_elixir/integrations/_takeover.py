"""What the integrations do around ``hf_elixir.prepare`` for a model the script did not parallelize, and the line
that says hf_elixir took over.

[Note: parallelized by the integration]

``ElixirConfig(tensor_parallel_size=T, expert_parallel_size=E)`` needs the model rewritten by
``hf_elixir.parallel.parallelize`` before ``prepare`` (``parallel/_apply.py``), and a script written for
``hf_elixir.prepare`` does that itself. An unchanged accelerate loop or ``Trainer`` script launched with a config
whose Elixir section asks for T or E > 1 (``recipes/llama/elixir.yaml``, ``recipes/mixtral/elixir.yaml``) cannot, so
the integrations do it for it, as transformers' ``tp_plan="auto"`` does inside ``from_pretrained``:

* the routed ``Trainer(...)`` (``_route.py``) parallelizes the model before the Trainer's own ``__init__``: the
  Trainer then builds its optimizer on the rewritten parameters and its data loaders for the tensor-parallel rows
  ([Note: tensor-parallel batches] in ``_binding.py``), as when the script calls ``parallelize`` itself;
* ``elixir_prepare`` (``ElixirPlugin.prepare``, the routed ``accelerator.prepare``) parallelizes a model that was
  not, and points the optimizer the script built on the original parameters at the rewritten ones, by name
  (``parallelize`` keeps every parameter's name; a fresh optimizer holds no state yet, so nothing else refers to
  the old tensors). Its param groups, hyperparameters and any scheduler built on it are kept. A data loader
  accelerate prepared before this cannot follow the tensor-parallel rows: that is refused, naming the fix.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from hf_elixir._logging import info_on_main_rank

__all__ = ["log_takeover", "parallelize_for_integration", "show_takeover_line"]

#: the logger of the one line that says hf_elixir took over; the routed launch shows it at INFO on rank 0
TAKEOVER_LOGGER = "hf_elixir.takeover"
logger = logging.getLogger(TAKEOVER_LOGGER)


def _wants_parallel(config) -> bool:
    return config.tensor_parallel_size > 1 or config.expert_parallel_size > 1


def parallelize_for_integration(model: torch.nn.Module, optimizer, config, accelerator=None) -> bool:
    """``parallelize(model, config)`` for a model the script did not rewrite, with ``optimizer``'s param groups
    pointed at the rewritten parameters ([Note: parallelized by the integration]).

    Returns:
        Whether the model was rewritten here.

    Raises:
        ValueError: the optimizer has stepped already (it holds state for the original parameters), or a data
            loader was prepared before a tensor-parallel model (it would feed each rank its own batch).
    """
    from hf_elixir.parallel import get_parallel_state, parallelize  # noqa: PLC0415

    if not _wants_parallel(config) or get_parallel_state(model) is not None:
        return False
    if optimizer is not None and len(optimizer.state):
        raise ValueError(
            f"ElixirConfig(tensor_parallel_size={config.tensor_parallel_size}, expert_parallel_size="
            f"{config.expert_parallel_size}) rewrites {type(model).__name__}'s parameters, but its "
            f"{type(optimizer).__name__} has already stepped; prepare the model and its optimizer before training")
    if config.tensor_parallel_size > 1 and accelerator is not None and accelerator._dataloaders:
        raise ValueError(
            f"ElixirConfig(tensor_parallel_size={config.tensor_parallel_size}): a data loader was prepared before "
            f"the model, so it gives each of the {accelerator.num_processes} processes its own batch, while the "
            "tensor-parallel ranks of a row must compute on the same one; prepare the data loader in the same call "
            "as the model (`model, optimizer, loader = accelerator.prepare(model, optimizer, loader)`) or after it. "
            "With a Trainer, call hf_elixir.parallel.parallelize(model, config) before Trainer(...), or launch the "
            "unchanged script with the config (accelerate launch --config_file elixir.yaml), which does that")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    parallelize(model, config)
    rewritten = dict(model.named_parameters(remove_duplicate=False))
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [rewritten[names[id(p)]] if id(p) in names else p for p in group["params"]]
    return True


def show_takeover_line() -> None:
    """Make :func:`log_takeover`'s line visible at INFO when nothing configured logging (the routed launch of an
    unchanged script: the user asked for hf_elixir in a YAML and reads no code of ours)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def log_takeover(model: torch.nn.Module, source: str) -> None:
    """One line on rank 0: hf_elixir took over ``model``, with which placements, device budget and plan."""
    from hf_elixir.parallel import get_parallel_state  # noqa: PLC0415
    from hf_elixir.runtime._state import get_state  # noqa: PLC0415

    state = get_state(model)
    parallel = get_parallel_state(model)
    kinds = Counter(type(p).__name__ if not isinstance(p, str) else p
                    for p in (parallel.placements.values() if parallel is not None else ["sharded"]))
    mesh = (f" (tp={parallel.mesh.tp_size}, ep={parallel.mesh.ep_size}, dp={parallel.mesh.dp_size})"
            if parallel is not None else "")
    chunks = state.manager.chunks
    budget = state.manager.pool.budget_bytes
    info_on_main_rank(
        logger, "hf_elixir took over %s (%s) from %s: placements %s%s; device budget %s; plan: %d chunks of %d "
        "elements, %d resident, prefetch depth %d", type(model).__name__,
        "trained" if state.optimizer is not None else "frozen", source,
        ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), mesh,
        "unlimited" if budget is None else f"{budget / 2**30:.3g} GiB ({budget} bytes)", len(chunks),
        max((c.chunk_numel for c in chunks), default=0), sum(c.resident for c in chunks),
        state.manager.prefetch_depth)
