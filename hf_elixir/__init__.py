"""hf_elixir: chunk-based memory management and searched placement plans for Hugging Face models.

Public surface::

    import hf_elixir
    model, optimizer = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), config=hf_elixir.ElixirConfig())
    hf_elixir.memory_stats(model)

Every public name is imported on first use (module ``__getattr__``, PEP 562): ``import hf_elixir`` imports
neither torch nor ``accelerate`` / ``transformers`` (``hf_elixir.ElixirPlugin`` and ``hf_elixir.ElixirCallback``
import those when first asked for), so ``hf-elixir --help`` answers at once.
"""

import importlib as _importlib
from typing import Any as _Any

__all__ = [
    "ElixirCallback",
    "ElixirPlugin",
    "full_gradients",
    "full_parameters",
    "get_full_grad",
    "load_checkpoint",
    "save_checkpoint",
    "DeviceBudgetExceededError",
    "ElixirConfig",
    "ElixirOptimizer",
    "ElixirPlan",
    "LossScalePolicy",
    "SUPPORTED_OPTIMIZERS",
    "SharedDeviceBudget",
    "get_state",
    "memory_stats",
    "min_device_budget_bytes",
    "min_host_budget_bytes",
    "prepare",
    "probe_hardware",
    "profile_step",
    "reset_memory_stats",
    "search_plan",
    "CollectiveEntryError",
    "external_reads",
]
__version__ = "0.1.0"

#: public name -> the module it lives in, imported on first use (PEP 562): ``import hf_elixir`` imports no torch, so
#: ``hf-elixir --help`` (``hf_elixir.cli``, inside this package) answers at once
_LAZY = {
    "ElixirPlugin": "hf_elixir.integrations.accelerate_plugin",
    "ElixirCallback": "hf_elixir.integrations.trainer_callback",
    "get_state": "hf_elixir.api", "memory_stats": "hf_elixir.api", "min_device_budget_bytes": "hf_elixir.api",
    "prepare": "hf_elixir.api", "reset_memory_stats": "hf_elixir.api",
    "DeviceBudgetExceededError": "hf_elixir.chunk.memory", "SharedDeviceBudget": "hf_elixir.chunk._shared_budget",
    "ElixirConfig": "hf_elixir.config", "LossScalePolicy": "hf_elixir.config",
    "min_host_budget_bytes": "hf_elixir.optim._disk_state",
    "full_gradients": "hf_elixir.optim.gradients", "get_full_grad": "hf_elixir.optim.gradients",
    "SUPPORTED_OPTIMIZERS": "hf_elixir.optim.optimizer", "ElixirOptimizer": "hf_elixir.optim.optimizer",
    "load_checkpoint": "hf_elixir.checkpoint", "save_checkpoint": "hf_elixir.checkpoint",
    "ElixirPlan": "hf_elixir.plan",
    "full_parameters": "hf_elixir.runtime.state_dict",
    "CollectiveEntryError": "hf_elixir.runtime._entry_check", "external_reads": "hf_elixir.runtime.external",
    "probe_hardware": "hf_elixir._hardware_probe", "profile_step": "hf_elixir.profiler",
    "search_plan": "hf_elixir.search",
}


def __getattr__(name: str) -> _Any:
    # PEP 562: the public names (and subpackages, ``hf_elixir.search``) are imported on first use
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return _importlib.import_module(f"hf_elixir.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hf_elixir.{name}":
                raise
    raise AttributeError(f"module 'hf_elixir' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
