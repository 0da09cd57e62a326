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
* several models and their optimizers in one call (policy and value as in PPO, student and teacher) are paired
  by the parameters each optimizer holds, and each pair goes to ``ElixirPlugin.prepare``; a model none of whose
  parameters requires a gradient (a frozen reference or teacher model) is prepared for inference
  (``hf_elixir.prepare(model, None)``: compute dtype, sharded, no gradients or optimizer states). All the models
  of one accelerator share one device budget ([Note: one device budget for several models] in
  ``hf_elixir/chunk/_shared_budget.py``), and ``accelerator.backward(loss)`` finds the models the loss reached
  ([Note: which model a loss belongs to] in ``_binding.py``). An optimizer over several models' parameters raises.
* a model with trainable parameters prepared *without* its optimizer is left to accelerate (evaluation models,
  upstream's DDP-only checks), and remembered: an optimizer over its parameters prepared later raises
  ``ValueError`` naming the one-line change (``model, optimizer = accelerator.prepare(model, optimizer)``), so a
  run whose config asks for Elixir never trains a DDP model silently.
* ``transformers.Trainer`` gets an :class:`~hf_elixir.integrations.ElixirCallback` with the same config when
  its ``callbacks`` hold none (the callback then routes the Trainer's own ``prepare``).
* a config asking for tensor or expert parallelism parallelizes the model first (the Trainer's in its
  ``__init__``, a loop's at its ``prepare``): [Note: parallelized by the integration] in ``_takeover.py``.
* one INFO line on rank 0 per model says that hf_elixir took over, with which placements, budget and plan.

Everything the router does not route falls through to accelerate unchanged; models that accelerate already
prepared (``_is_accelerate_prepared``) pass through, which is how the callback and ``ElixirPlugin`` register
their results without coming back here.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Any

import torch

__all__ = ["install", "install_for_accelerate_launch", "installed_config", "routed_models"]

logger = logging.getLogger(__name__)

# "routed": weak references: a model this held would outlive the script and keep its gloo group's threads into
# interpreter finalization ([Note: gloo group at exit] in hf_elixir/parallel/_exit.py)
_STATE: dict[str, Any] = {"config": None, "source": None, "routed": []}

_ONE_LINE = "model, optimizer = accelerator.prepare(model, optimizer)"


def installed_config():
    """The ``ElixirConfig`` :func:`install` routes with, or ``None`` when the router is not installed."""
    return _STATE["config"]


def routed_models() -> list[torch.nn.Module]:
    """The models this process's ``Accelerator.prepare`` calls put under hf_elixir so far (in order), those still
    alive."""
    return [model for model in (ref() for ref in _STATE["routed"]) if model is not None]


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
    from hf_elixir.integrations._takeover import show_takeover_line

    show_takeover_line()  # the one line that says hf_elixir took over, at INFO on rank 0
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


def _pair(args: tuple, models: list[int], optimizers: list[int]) -> tuple[list[tuple[int, int | None]], list[int]]:
    """Which optimizer steps which model, from the parameters each optimizer holds.

    Returns:
        ``(pairs, alone)``: ``(model index, optimizer index)`` for each model with its optimizer, then ``(model
        index, None)`` for each frozen model (no parameter requires a gradient: a reference or teacher model), and the
        models with trainable parameters but no optimizer in this call (left to accelerate).

    Raises:
        ValueError: an optimizer over parameters of several models, or of none of them.
    """
    owner = {id(p): m for m in models for p in args[m].parameters()}
    pairs: list[tuple[int, int | None]] = []
    for o in optimizers:
        held = {owner.get(id(p)) for group in args[o].param_groups for p in group["params"]}
        if len(held) != 1 or None in held:
            names = sorted(type(args[m]).__name__ for m in held if m is not None)
            names += ["no model in this call"] if None in held else []
            raise ValueError(
                f"accelerator.prepare: optimizer {type(args[o]).__name__} (argument {o}) holds parameters of "
                f"{' and of '.join(names)}; "
                "under hf_elixir (this launch's config has a dynamo_config.elixir section) each optimizer steps "
                f"one model prepared in the same call: `{_ONE_LINE}`, one optimizer per model")
        pairs.append((held.pop(), o))
    paired = {m for m, _ in pairs}
    if len(paired) != len(pairs):
        raise ValueError("accelerator.prepare: two optimizers step the same model; under hf_elixir one optimizer "
                         "steps one model (put the parameter groups in one optimizer)")
    frozen = [m for m in models if m not in paired and not any(p.requires_grad for p in args[m].parameters())]
    alone = [m for m in models if m not in paired and m not in frozen]
    return sorted(pairs) + [(m, None) for m in frozen], alone  # trained first: they take the loaders (search='auto')


def _routed_prepare(original):
    @functools.wraps(original)
    def prepare(self, *args, device_placement=None):
        models, optimizers = _split(args)
        if optimizers and not models:
            for o in optimizers:
                _refuse_optimizer_of_unrouted_model(self, args[o])
        pairs, alone = _pair(args, models, optimizers) if models else ([], [])
        for m in alone:  # an evaluation model (or one whose optimizer comes later, refused then): accelerate's
            self.__dict__.setdefault("_hf_elixir_unrouted", []).append(args[m])
        if not pairs:
            return original(self, *args, device_placement=device_placement)
        return _prepare_under_elixir(self, args, pairs, device_placement)

    return prepare


def _prepare_under_elixir(accelerator, args: tuple, pairs: list[tuple[int, int | None]], device_placement):
    """Each (model, optimizer) pair and each frozen model through ``ElixirPlugin.prepare``, the frozen models first
    (their chunks can be re-placed for the trained models that join after them, a trained model's cannot: [Note:
    re-placing for a newcomer] in ``chunk/_shared_budget.py``), else in the order given, all under one device
    budget (``hf_elixir.shared_device_budget``, one per accelerator: [Note: one device budget for several models]);
    the other arguments (data loaders, schedulers, models left to accelerate) through the first call. Results come
    back in the order given."""
    from hf_elixir.integrations.accelerate_plugin import ElixirPlugin

    taken = {i for pair in pairs for i in pair if i is not None}
    rest_at = [i for i in range(len(args)) if i not in taken]
    out: dict[int, Any] = {}
    for k, (model_at, optimizer_at) in enumerate(sorted(pairs, key=lambda pair: pair[1] is not None)):
        plugin = ElixirPlugin(config=_STATE["config"])
        plugin._source = lambda: _STATE["source"]  # the settings line names the YAML, not "ElixirPlugin(config=...)"
        rest = [args[i] for i in rest_at] if k == 0 else []
        done = plugin.prepare(accelerator, args[model_at], None if optimizer_at is None else args[optimizer_at], *rest)
        out[model_at] = done[0]
        if optimizer_at is not None:
            out[optimizer_at] = done[1]
        out.update(zip(rest_at, done[2:]) if k == 0 else ())
    _STATE["routed"].extend(weakref.ref(out[model_at]) for model_at, _ in pairs)  # in the order given
    result = [out[i] for i in range(len(args))]
    return tuple(result) if len(result) > 1 else result[0]


def _trainer_init_with_callback(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        from hf_elixir.integrations.trainer_callback import ElixirCallback

        bound = signature.bind(self, *args, **kwargs)
        model = bound.arguments.get("model")
        if isinstance(model, torch.nn.Module):  # before the Trainer builds its optimizer and data loaders on it
            from hf_elixir.integrations._takeover import parallelize_for_integration

            parallelize_for_integration(model, None, _STATE["config"])  # [Note: parallelized by the integration]
        callbacks = list(bound.arguments.get("callbacks") or [])
        if not any(isinstance(c, ElixirCallback) or c is ElixirCallback for c in callbacks):
            callback = ElixirCallback(config=_STATE["config"])
            callback._source = _STATE["source"]
            bound.arguments["callbacks"] = [*callbacks, callback]
        original(*bound.args, **bound.kwargs)

    return __init__
