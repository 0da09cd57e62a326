"""``hf_elixir.probe_hardware``: the profiler's hardware probe with the runtime probe given ``hf_elixir.prepare``
([Note: runtime probe] in ``hf_elixir/profiler/_runtime_probe.py``): this module sits above the façade, so it hands
the façade's entry points down to the profiler, which never imports them."""

from __future__ import annotations

import functools

from hf_elixir import api, profiler
from hf_elixir.profiler._hardware import probe_hardware as _probe_hardware
from hf_elixir.profiler._runtime_probe import RuntimeProbe

__all__ = ["probe_hardware", "runtime_probe"]


def runtime_probe() -> RuntimeProbe:
    """A :class:`~hf_elixir.profiler._runtime_probe.RuntimeProbe` on ``hf_elixir.prepare``."""
    return RuntimeProbe(api.prepare, api.memory_stats, api.min_device_budget_bytes)


@functools.wraps(_probe_hardware)
def probe_hardware(*args, **kwargs):
    kwargs.setdefault("runtime_probe", runtime_probe())
    return profiler.probe_hardware(*args, **kwargs)  # looked up at each call (tests stand in for the machine)
