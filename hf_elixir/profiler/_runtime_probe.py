"""The runtime probe: hf_elixir's own overheads, timed on small models that ``hf_elixir.prepare`` prepares.

[Note: runtime probe]

The cost model prices hf_elixir's own work per module call, per chunk onload and per optimizer tensor
(``HardwareProfile.hook_event_s``, ``onload_fixed_s``, ``optim_tensor_s``). They are timed on small models prepared
by ``hf_elixir.prepare``, which lives in a layer above this one (``hf_elixir.api`` calls the search, which calls
the hardware probe). So that nothing below imports it, the caller in the upper layer hands ``prepare`` and its two
companions down as the arguments of a :class:`RuntimeProbe`, which :func:`~hf_elixir.profiler.probe_hardware` takes
as ``runtime_probe``: ``prepare`` passes one through the search to the probe, and the public
``hf_elixir.probe_hardware`` (``hf_elixir/_hardware_probe.py``) builds one. Without one, the three fields come from
the cache, else stay 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_elixir.profiler._hardware import _best_time

__all__ = ["RuntimeProbe"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeProbe:
    """Times hf_elixir's own overheads with the entry points its caller gives ([Note: runtime probe]).

    Args:
        prepare: ``hf_elixir.prepare``.
        memory_stats: ``hf_elixir.memory_stats``.
        min_device_budget_bytes: ``hf_elixir.min_device_budget_bytes``.
    """

    prepare: Callable
    memory_stats: Callable
    min_device_budget_bytes: Callable

    def __call__(self, device: torch.device, rates: dict[str, Any], repeats: int,
                 sync: Callable[[], None]) -> dict[str, float]:
        """Time hf_elixir's own overheads on a small ``nn.Sequential`` of ``nn.Linear`` layers (one layer per
        chunk): plain vs prepared all-resident (per module call), all-resident vs smallest budget (per chunk
        onload), and the optimizer step (per parameter view). Single-rank only: with a process group the
        fields stay 0 (the group's collectives are timed separately).

        Args:
            device: the compute device.
            rates: the rates measured so far (``h2d_bytes_per_s`` is read).
            repeats: timed repetitions (the fastest counts).
            sync: waits for the device (a no-op on CPU).
        """
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return {"hook_event_s": 0.0, "onload_fixed_s": 0.0, "optim_tensor_s": 0.0}
        return _time_overheads(self, device, rates, repeats, sync)


def _time_overheads(probe: RuntimeProbe, device: torch.device, rates: dict[str, Any], repeats: int,
                    sync: Callable[[], None]) -> dict[str, float]:
    from hf_elixir.config import ElixirConfig  # noqa: PLC0415

    prepare, memory_stats, min_device_budget_bytes = probe.prepare, probe.memory_stats, probe.min_device_budget_bytes

    width, depth = 64, 8
    chunk = width * width + width
    x = torch.randn(32, width, device=device)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device)

    def fwd_bwd(model: torch.nn.Module) -> None:
        model(x).pow(2).mean().backward()

    plain = build()

    def plain_step() -> None:
        fwd_bwd(plain)
        plain.zero_grad(set_to_none=True)

    runs = max(5, 3 * repeats)
    t_plain = _best_time(plain_step, runs, sync)
    resident = build()
    resident, res_opt = prepare(resident, torch.optim.AdamW(resident.parameters(), lr=1e-3),
                                ElixirConfig(chunk_size_numel=chunk))
    t_res = _best_time(lambda: fwd_bwd(resident), runs, sync)
    sized = build()
    budget = min_device_budget_bytes(sized, torch.optim.AdamW(sized.parameters(), lr=1e-3),
                                     ElixirConfig(chunk_size_numel=chunk))
    small = build()
    # the model-data floor (activations outside it): every chunk is onloaded for each use
    small, small_opt = prepare(small, torch.optim.AdamW(small.parameters(), lr=1e-3),
                               ElixirConfig(chunk_size_numel=chunk, device_memory_budget_bytes=budget,
                                            budget_covers_activations=False))
    for _ in range(2):  # a recorded trace makes eviction Belady's, as in steady state
        fwd_bwd(small)
        small_opt.step()
    before = memory_stats(small)["num_onloads"]
    fwd_bwd(small)
    onloads = max(1, memory_stats(small)["num_onloads"] - before)
    t_off = _best_time(lambda: fwd_bwd(small), runs, sync)
    # per parameter view: a model of many tiny layers, whose elements cost next to nothing
    narrow = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2 * depth)]).to(device)
    narrow, narrow_opt = prepare(narrow, torch.optim.AdamW(narrow.parameters(), lr=1e-3),
                                 ElixirConfig(chunk_size_numel=20))
    narrow(torch.randn(8, 4, device=device)).sum().backward()
    t_views = _best_time(narrow_opt.step, runs, sync)
    logger.info("runtime probe: plain %.3g s, resident %.3g s, smallest budget %.3g s (%d onloads), "
                "step of %d views %.3g s", t_plain, t_res, t_off, onloads, 4 * depth, t_views)
    return {
        "hook_event_s": max(0.0, (t_res - t_plain) / (2 * depth)),
        "onload_fixed_s": max(0.0, (t_off - t_res) / onloads - chunk * 4 / rates["h2d_bytes_per_s"]),
        "optim_tensor_s": t_views / (4 * depth),
    }
