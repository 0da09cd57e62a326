"""Routing an unchanged Accelerate script's ``accelerator.prepare`` (and a stock ``Trainer``) to hf_elixir.

[Note: routing an unchanged script]

accelerate 1.16 has no engine entry point (``DistributedType`` is a closed enum), so a script that calls
``model, optimizer = accelerator.prepare(model, optimizer)`` can only reach hf_elixir if something in its
process changes what that call does. :func:`install` does it at the class level, once per process, before
the script runs (``hf-elixir launch`` runs the script through :mod:`hf_elixir.integrations.launch`; plain
``accelerate launch`` installs it through the start hook, [Note: the start hook] in ``hf_elixir_autoroute.py``):

* ``Accelerator.prepare`` with exactly one model and one optimizer that accelerate has not prepared yet (in
  any order, with data loaders and schedulers around them) goes to ``ElixirPlugin(config).prepare``, and the
  results come back in the order given: the model is never wrapped in ``DistributedDataParallel``.
* a model prepared *without* its optimizer is left to accelerate (evaluation models, upstream's DDP-only
  checks), and remembered: an optimizer over its parameters prepared later raises ``ValueError`` naming the
  one-line change (``model, optimizer = accelerator.prepare(model, optimizer)``), so a run whose config asks
  for Elixir never trains a DDP model silently. Several models or several optimizers in one call raise too:
  accelerate cannot tell which optimizer steps which model, and neither can the router.
* ``transformers.Trainer`` gets an :class:`~hf_elixir.integrations.ElixirCallback` with the same config when
  its ``callbacks`` hold none (the callback then routes the Trainer's own ``prepare``).

Everything the router does not route falls through to accelerate unchanged; models that accelerate already
prepared (``_is_accelerate_prepared``) pass through, which is how the callback and ``ElixirPlugin`` register
their results without coming back here.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

__all__ = ["install", "install_for_accelerate_launch", "installed_config", "routed_models"]

logger = logging.getLogger(__name__)

_STATE: dict[str, Any] = {"config": None, "source": None, "routed": []}

_ONE_LINE = "model, optimizer = accelerator.prepare(model, optimizer)"


def installed_config():
    """The ``ElixirConfig`` :func:`install` routes with, or ``None`` when the router is not installed."""
    return _STATE["config"]


def routed_models() -> list[torch.nn.Module]:
    """The models this process's ``Accelerator.prepare`` calls put under hf_elixir so far (in order)."""
    return list(_STATE["routed"])


def install(config_file: str | None = None, source: str | None = None) -> None:
    """Route ``Accelerator.prepare`` and ``Trainer`` to hf_elixir in this process ([Note: routing an unchanged
    script]); idempotent.

    Args:
        config_file: the accelerate/Elixir YAML whose ``dynamo_config.elixir`` section is read (``None``: found as
            ``ElixirPlugin`` finds it, :mod:`hf_elixir.integrations._launch_config`).
        source: how the settings line names where they came from (default: the file, "hf-elixir launch").

    Raises:
        ValueError / TypeError: an invalid ``ElixirConfig`` field in the YAML or an ``ELIXIR_*`` variable.
    """
    from hf_elixir.integrations.accelerate_plugin import resolve_elixir_config

    config, path = resolve_elixir_config(config_file)
    first = _STATE["config"] is None
    _STATE["config"] = config
    _STATE["source"] = source or (f"{path} (hf-elixir launch)" if path is not None else "hf-elixir launch (defaults)")
    if not first:
        return
    import accelerate

    accelerate.Accelerator.prepare = _routed_prepare(accelerate.Accelerator.prepare)
    try:
        import transformers
    except ImportError:  # accelerate scripts need not have transformers
        return
    transformers.Trainer.__init__ = _trainer_init_with_callback(transformers.Trainer.__init__)


def install_for_accelerate_launch(path=None) -> bool:
    """Called by the start hook (``hf_elixir_autoroute``, [Note: the start hook]) at the first
    ``accelerator.prepare`` or ``Trainer(...)`` of a process ``accelerate launch`` started: install the router if
    the launch's config file (``path``, or found as ``ElixirPlugin`` finds it) has a ``dynamo_config.elixir``
    section.

    Returns:
        Whether the router is installed now.

    Raises:
        ValueError / TypeError: the section holds an invalid ``ElixirConfig`` field (raised inside the script's
            first ``accelerator.prepare`` / ``Trainer(...)``, so the run never trains as DDP instead).
    """
    from hf_elixir.integrations._launch_config import find_launch_config_file, has_elixir_section

    if _STATE["config"] is not None:  # hf-elixir launch installed it already
        return True
    path = path if path is not None else find_launch_config_file()
    if path is None or not has_elixir_section(path):
        return False
    install(str(path), source=f"{path} (accelerate launch)")
    return True


def _split(args: tuple) -> tuple[list[int], list[int]]:
    from accelerate.optimizer import AcceleratedOptimizer

    models = [i for i, a in enumerate(args)
              if isinstance(a, torch.nn.Module) and not getattr(a, "_is_accelerate_prepared", False)]
    optimizers = [i for i, a in enumerate(args)
                  if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)]
    return models, optimizers


def _refuse_optimizer_of_unrouted_model(accelerator, optimizer: torch.optim.Optimizer) -> None:
    """Raise when ``optimizer`` steps a model this accelerator prepared without hf_elixir (DDP or plain)."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in accelerator.__dict__.get("_hf_elixir_unrouted", []):
        if any(id(p) in ids for p in model.parameters()):
            raise ValueError(
                f"accelerator.prepare(optimizer): the optimizer steps a {type(model).__name__} that was prepared "
                "on its own, so accelerate wrapped it (DistributedDataParallel under several processes) instead of "
                "hf_elixir, which this launch's config asks for. Prepare the model and its optimizer in one call: "
                f"`{_ONE_LINE}`")


def _routed_prepare(original):
    @functools.wraps(original)
    def prepare(self, *args, device_placement=None):
        models, optimizers = _split(args)
        if len(models) > 1 or len(optimizers) > 1:
            raise ValueError(
                f"accelerator.prepare got {len(models)} models and {len(optimizers)} optimizers in one call; under "
                "hf_elixir (this launch's config has a dynamo_config.elixir section) each model is prepared with its "
                f"own optimizer: one `{_ONE_LINE}` call per pair")
        if optimizers and not models:
            _refuse_optimizer_of_unrouted_model(self, args[optimizers[0]])
        if not (models and optimizers):
            if models:
                self.__dict__.setdefault("_hf_elixir_unrouted", []).append(args[models[0]])
            return original(self, *args, device_placement=device_placement)
        return _prepare_under_elixir(self, args, models[0], optimizers[0])

    return prepare


def _prepare_under_elixir(accelerator, args: tuple, model_at: int, optimizer_at: int):
    from hf_elixir.integrations.accelerate_plugin import ElixirPlugin

    plugin = ElixirPlugin(config=_STATE["config"])
    plugin._source = lambda: _STATE["source"]  # the settings line names the YAML, not "ElixirPlugin(config=...)"
    rest = [a for i, a in enumerate(args) if i not in (model_at, optimizer_at)]
    out = plugin.prepare(accelerator, args[model_at], args[optimizer_at], *rest)
    _STATE["routed"].append(out[0])
    done_rest = iter(out[2:])
    result = [out[0] if i == model_at else out[1] if i == optimizer_at else next(done_rest) for i in range(len(args))]
    return tuple(result) if len(result) > 1 else result[0]


def _trainer_init_with_callback(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from hf_elixir.integrations.trainer_callback import ElixirCallback

        bound = signature.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        if not any(isinstance(c, ElixirCallback) or c is ElixirCallback for c in callbacks):
            callback = ElixirCallback(config=_STATE["config"])
            callback._source = _STATE["source"]
            bound.arguments["callbacks"] = [*callbacks, callback]
        original(*bound.args, **bound.kwargs)

    return __init__
