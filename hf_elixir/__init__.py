"""hf_elixir: chunk-based memory management and searched placement plans for Hugging Face models.

Public surface::

    import hf_elixir
    model, optimizer = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), config=hf_elixir.ElixirConfig())
    hf_elixir.memory_stats(model)

``hf_elixir.ElixirPlugin`` (Accelerate) and ``hf_elixir.ElixirCallback`` (``transformers.Trainer``) are
imported on first use (module ``__getattr__``, PEP 562), so ``import hf_elixir`` does not import
``accelerate`` or ``transformers``.
"""

import importlib as _importlib
from typing import Any as _Any

from hf_elixir.api import get_state, memory_stats, min_device_budget_bytes, prepare, reset_memory_stats
from hf_elixir.chunk._shared_budget import SharedDeviceBudget
from hf_elixir.chunk.memory import DeviceBudgetExceededError
from hf_elixir.config import ElixirConfig, LossScalePolicy
from hf_elixir.optim.gradients import full_gradients, get_full_grad
from hf_elixir.optim.optimizer import SUPPORTED_OPTIMIZERS, ElixirOptimizer
from hf_elixir.checkpoint import load_checkpoint, save_checkpoint
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime.state_dict import full_parameters
from hf_elixir.profiler import probe_hardware, profile_step
from hf_elixir.search import search_plan

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
    "prepare",
    "probe_hardware",
    "profile_step",
    "reset_memory_stats",
    "search_plan",
]
__version__ = "0.1.0"

_LAZY = {
    "ElixirPlugin": "hf_elixir.integrations.accelerate_plugin",
    "ElixirCallback": "hf_elixir.integrations.trainer_callback",
}


def __getattr__(name: str) -> _Any:
    # PEP 562: the integrations import accelerate / transformers, which `import hf_elixir` must not pay for
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_elixir' has no attribute {name!r}")
