"""Run one of accelerate's own test scripts with every model + optimizer routed through ``ElixirPlugin``.

Usage (under ``accelerate launch``; see tests/test_upstream_accelerate.py)::

    accelerate launch --cpu --num_processes 1 tests/upstream/accelerate_shim.py test_script
    accelerate launch --multi_gpu --num_processes 2 tests/upstream/accelerate_shim.py test_sync

The upstream script (``accelerate/test_utils/scripts/<name>.py`` in the installed accelerate) is
imported, not copied, and its ``main()`` runs unchanged, except that:

* ``accelerate.Accelerator.prepare`` is patched: a call that gets a model *and* an optimizer (in any
  order, with dataloaders/schedulers around them) puts those two under hf_elixir through
  ``ElixirPlugin().prepare(accelerator, model, optimizer, *rest)`` and returns everything in the order
  given. A call without an optimizer (evaluation, DDP-only checks such as ``join_uneven_inputs``)
  goes to accelerate unchanged.
* the upstream checks named in :data:`EXCLUDED` are replaced, by name, with a function that prints
  ``SKIPPED <name>: <reason>``. Each reason says what hf_elixir deliberately does differently.

The Elixir settings come from ``ELIXIR_<FIELD>`` environment variables (``ElixirPlugin``'s own
reading); ``ELIXIR_SHIM_BUDGET=min`` sets ``device_memory_budget_bytes`` of every prepared model to
:func:`hf_elixir.min_device_budget_bytes` for that model and optimizer (a model-data budget,
``budget_covers_activations=False``), so chunks are offloaded and
onloaded every step. ``ELIXIR_SHIM_READ_FULL=1`` makes ``accelerator.unwrap_model(model)`` of an
hf_elixir model enter ``hf_elixir.full_parameters(model)`` (read-only, kept open until the script's
next ``prepare``) before returning it: upstream checks read ``model.a`` after training, and under
sharding or offload a parameter is not current between steps, so that read raises
``StaleParameterError`` by design ("Reading a parameter that is not current fails loudly",
docs/design/rules.md). With the flag the checks' own assertions run unchanged on the full values.

``ELIXIR_SHIM_ROUTE=launch`` leaves ``Accelerator.prepare`` alone: the script runs under
``hf-elixir launch ... -m tests.upstream.accelerate_shim <name>``, whose own routing
(``hf_elixir/integrations/_route.py``) puts the models under hf_elixir with the launch YAML's settings; the shim
then only applies :data:`EXCLUDED` and ``ELIXIR_SHIM_READ_FULL``.

The shim prints ``ELIXIR_SHIM prepared <n>`` at exit: how many model/optimizer pairs went through
hf_elixir, so a test can tell the routing happened.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import os
import sys
import weakref

import torch

#: upstream checks replaced by a skip, per script: {function name: reason}
EXCLUDED: dict[str, dict[str, str]] = {
    "test_script": {
        # training_check's BF16 and FP16 parts train under mixed_precision and compare the parameters
        # with the fp32 baseline at atol=rtol=1e-6, dtype included. Accelerate keeps fp32 parameters and
        # autocasts (x * a + b stays fp32, so upstream expects bit-equal results); under hf_elixir the
        # parameters ARE the bf16/fp16 compute copies (fp32 masters live in the optimizer, [Note:
        # parameters as views]) and the gradients are low precision too, so fp16 dynamic loss scaling
        # skips the first overflowing steps as DeepSpeed/Apex do. Replacing the two gates keeps the fp32
        # parts of training_check running. (Measured once: bf16 ends within 3e-2 of the baseline.)
        "is_bf16_available": "parameters are bf16 compute copies under hf_elixir; upstream compares dtype and 1e-6",
        "is_fp16_available": "parameters are fp16 compute copies and fp16 loss scaling skips overflow steps",
    },
    "test_sync": {},
    "test_ops": {},
    "test_distributed_data_loop": {
        # Each join check prepares a bare nn.Linear without an optimizer, so it is plain DDP, never
        # hf_elixir. On CPU processes (accelerate's MULTI_CPU) join_uneven_inputs does nothing (it warns
        # "only supported for multi-GPU"), so with uneven batches the DDP model's rank with more
        # batches waits in its all-reduce forever: the hang seen through this shim is stock accelerate's
        # on CPUs. hf_elixir's own join_uneven_inputs (an Elixir model refuses uneven batches at once,
        # naming the fix) is tested in tests/test_accelerate_plugin.py.
        "test_can_join_uneven_inputs": "join_uneven_inputs is a no-op on CPU processes: stock DDP hangs on uneven batches",
        # The next three check what join_uneven_inputs does to the dataloaders (the even_batches
        # override, its warning for iterable ones) in accelerate's multi-GPU branch; on CPU processes the
        # call does nothing and they fail with stock accelerate too.
        "test_join_can_override_even_batches": "the even_batches override happens on multi-GPU only (a no-op on CPU)",
        "test_join_can_override_for_mixed_type_dataloaders": "the even_batches override happens on multi-GPU only",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches": "CPU processes warn 'multi-GPU only' instead",
    },
}


def _full_gradient_check(original):
    """Upstream's ``check_model_parameters`` (test_sync) run unchanged on an hf_elixir model's gradients as
    ``hf_elixir.full_gradients`` gives them: ``p.grad`` stays None under hf_elixir by design (gradients live in chunk
    shards, [Note: readable gradients] in hf_elixir/optim/gradients.py), so the prepared model is shown to the check
    as parameters holding those gradients (in ``parameters()`` order; a parameter without one holds None, as
    PyTorch's would). Those are the global (data-parallel mean) gradients at every point, also inside
    ``accumulate()`` before a sync, where DDP's ``p.grad`` holds only the local batch's: so the check runs its
    in-sync branch on every iteration (upstream's not-in-sync branch asserts DDP's local gradients differ from the
    reference; hf_elixir's equal it, which the in-sync branch checks)."""
    import types

    import hf_elixir

    stepped: dict[int, dict] = {}  # id(model) -> its full gradients just before the optimizer consumed them

    def snapshot(optimizer, args, kwargs):
        # upstream checks after opt.step() and before zero_grad, where PyTorch's p.grad still holds the step's
        # gradient but hf_elixir's step consumed the shards (full_gradients refuses there): keep them from before
        from hf_elixir.optim.optimizer import ElixirOptimizer

        if isinstance(optimizer, ElixirOptimizer):
            for model in _prepared():
                with hf_elixir.full_gradients(model) as grads:
                    stepped[id(model)] = {name: g.clone() for name, g in grads.items()}

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(snapshot)

    @functools.wraps(original)
    def check(model_a, model_b, did_step, iteration, **kwargs):
        if not any(model_b is m for m in _prepared()):
            return original(model_a, model_b, did_step, iteration, **kwargs)
        try:
            with hf_elixir.full_gradients(model_b) as grads:  # collective: every rank checks in the same order
                values = dict(grads)
        except ValueError as err:
            if "after optimizer.step()" not in str(err):
                raise
            values = stepped.pop(id(model_b))
        shown = [types.SimpleNamespace(grad=values.get(name), requires_grad=p.requires_grad)
                 for name, p in model_b.named_parameters()]
        print(f"ELIXIR_SHIM check_model_parameters on full_gradients (iteration {iteration})", flush=True)
        return original(model_a, types.SimpleNamespace(parameters=lambda: iter(shown)), True, iteration, **kwargs)

    return check


#: upstream checks run on hf_elixir's view of the model instead, per script: {function name: wrapper}
ADAPTED = {"test_sync": {"check_model_parameters": _full_gradient_check}}


def _exclude_without_torchdata() -> None:
    """The stateful-dataloader checks need torchdata >= 0.8 (StatefulDataLoader), not a dependency here;
    upstream's main() calls them unconditionally. Where torchdata is installed they run."""
    from accelerate.utils import is_torchdata_stateful_dataloader_available

    if not is_torchdata_stateful_dataloader_available():
        for name in ("test_stateful_dataloader", "test_stateful_dataloader_save_state"):
            EXCLUDED["test_distributed_data_loop"][name] = "needs torchdata >= 0.8 (StatefulDataLoader), not installed"


_exclude_without_torchdata()

# weak references, and a count: a model the shim held would outlive the script and keep its gloo group's threads
# into interpreter finalization (a SIGABRT at exit now and then: [Note: gloo group at exit])
_PREPARED: list = []
_COUNT = {"prepared": 0}
_FULL_VIEWS: list = []  # open ``full_parameters`` contexts (ELIXIR_SHIM_READ_FULL=1)


def _elixir_config(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    import hf_elixir
    from hf_elixir.integrations import resolve_elixir_config

    config, _ = resolve_elixir_config()
    if os.environ.get("ELIXIR_SHIM_BUDGET") == "min":
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        budget = hf_elixir.min_device_budget_bytes(model, optimizer, config=config, world_size=world)
        # the floor bounds model data (activations outside it): chunks offload every step
        config = dataclasses.replace(config, device_memory_budget_bytes=budget, budget_covers_activations=False)
    return config


def _patched_prepare(original):
    from hf_elixir.integrations import ElixirPlugin

    @functools.wraps(original)
    def prepare(self, *args, device_placement=None):
        while _FULL_VIEWS:  # the views opened by unwrap_model last until the script prepares again
            _FULL_VIEWS.pop().__exit__(None, None, None)
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) != 1 or getattr(args[models[0]], "_is_accelerate_prepared", False):
            return original(self, *args, device_placement=device_placement)
        model, optimizer = args[models[0]], args[optimizers[0]]
        rest = [a for i, a in enumerate(args) if i not in (models[0], optimizers[0])]
        plugin = ElixirPlugin(config=_elixir_config(model, optimizer))
        out = plugin.prepare(self, model, optimizer, *rest)
        _PREPARED.append(weakref.ref(out[0]))
        _COUNT["prepared"] += 1
        done_rest = iter(out[2:])
        result = [out[0] if i == models[0] else out[1] if i == optimizers[0] else next(done_rest)
                  for i in range(len(args))]
        return tuple(result) if len(result) > 1 else result[0]

    return prepare


def _prepared() -> list[torch.nn.Module]:
    """The models put under hf_elixir so far: by the shim's own prepare, or by ``hf-elixir launch``'s routing."""
    if os.environ.get("ELIXIR_SHIM_ROUTE") == "launch":
        from hf_elixir.integrations._route import routed_models

        return routed_models()
    return [model for model in (ref() for ref in _PREPARED) if model is not None]


def _num_prepared() -> int:
    """How many models went under hf_elixir, alive or freed since."""
    if os.environ.get("ELIXIR_SHIM_ROUTE") == "launch":
        from hf_elixir.integrations import _route

        return len(_route._STATE["routed"])  # (weak references: one per routed model)
    return _COUNT["prepared"]


def _closing_views(original):
    """``Accelerator.prepare`` (routed by ``hf-elixir launch``) that first closes the views ``unwrap_model`` opened."""

    @functools.wraps(original)
    def prepare(self, *args, device_placement=None):
        while _FULL_VIEWS:
            _FULL_VIEWS.pop().__exit__(None, None, None)
        return original(self, *args, device_placement=device_placement)

    return prepare


def _patched_unwrap_model(original):
    import hf_elixir

    @functools.wraps(original)
    def unwrap_model(self, model, *args, **kwargs):
        unwrapped = original(self, model, *args, **kwargs)
        if any(unwrapped is m for m in _prepared()):
            view = hf_elixir.full_parameters(unwrapped)  # collective: every rank unwraps in the same order
            view.__enter__()
            _FULL_VIEWS.append(view)
        return unwrapped

    return unwrap_model


def _skipper(name: str, reason: str):
    def skipped(*args, **kwargs):
        print(f"SKIPPED {name}: {reason}", flush=True)

    return skipped


def run(script: str) -> None:
    """Patch accelerate, apply :data:`EXCLUDED` to ``script`` and run its ``main()``."""
    import accelerate

    if script not in EXCLUDED:
        raise ValueError(f"script={script!r} is not one of {sorted(EXCLUDED)}")
    if os.environ.get("ELIXIR_SHIM_ROUTE") != "launch":
        accelerate.Accelerator.prepare = _patched_prepare(accelerate.Accelerator.prepare)
    else:
        accelerate.Accelerator.prepare = _closing_views(accelerate.Accelerator.prepare)
    if os.environ.get("ELIXIR_SHIM_READ_FULL") == "1":
        accelerate.Accelerator.unwrap_model = _patched_unwrap_model(accelerate.Accelerator.unwrap_model)
    module = importlib.import_module(f"accelerate.test_utils.scripts.{script}")
    for name, reason in EXCLUDED[script].items():
        assert callable(getattr(module, name, None)), f"{script}.{name} does not exist upstream any more"
        setattr(module, name, _skipper(name, reason))
    for name, wrapper in ADAPTED.get(script, {}).items():
        setattr(module, name, wrapper(getattr(module, name)))
    atexit.register(lambda: print(f"ELIXIR_SHIM prepared {_num_prepared()}", flush=True))
    module.main()
    while _FULL_VIEWS:  # they hold their models
        _FULL_VIEWS.pop().__exit__(None, None, None)


if __name__ == "__main__":
    run(sys.argv[1])
