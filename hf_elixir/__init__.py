"""hf_elixir: chunk-based memory management and searched placement plans for Hugging Face models."""

from hf_elixir.config import ElixirConfig, LossScalePolicy
from hf_elixir.plan import ElixirPlan

__all__ = ["ElixirConfig", "ElixirPlan", "LossScalePolicy"]
__version__ = "0.1.0"
