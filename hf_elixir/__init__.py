"""hf_elixir: chunk-based memory management and searched placement plans for Hugging Face models.

Public surface::

    import hf_elixir
    model, optimizer = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), config=hf_elixir.ElixirConfig())
    hf_elixir.memory_stats(model)
"""

from hf_elixir.api import get_state, memory_stats, min_device_budget_bytes, prepare, reset_memory_stats
from hf_elixir.chunk.memory import DeviceBudgetExceededError
from hf_elixir.config import ElixirConfig, LossScalePolicy
from hf_elixir.optim.optimizer import SUPPORTED_OPTIMIZERS, ElixirOptimizer
from hf_elixir.checkpoint import load_checkpoint, save_checkpoint
from hf_elixir.plan import ElixirPlan
from hf_elixir.runtime.state_dict import full_parameters
from hf_elixir.profiler import probe_hardware, profile_step
from hf_elixir.search import search_plan

__all__ = [
    "full_parameters",
    "load_checkpoint",
    "save_checkpoint",
    "DeviceBudgetExceededError",
    "ElixirConfig",
    "ElixirOptimizer",
    "ElixirPlan",
    "LossScalePolicy",
    "SUPPORTED_OPTIMIZERS",
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
