"""Profiler: one traced training step (:func:`profile_step`) and a measured hardware probe
(:func:`probe_hardware`), the two inputs of the configuration search."""

from hf_elixir.profiler._step import AccessEvent, StepProfile, canonical_parameters, profile_step, static_profile

__all__ = ["AccessEvent", "StepProfile", "canonical_parameters", "profile_step", "static_profile"]
from hf_elixir.profiler._hardware import HardwareProfile, default_cache_path, probe_hardware

__all__ += ["HardwareProfile", "default_cache_path", "probe_hardware"]
