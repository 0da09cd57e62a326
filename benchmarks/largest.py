"""Largest trainable GPT-2 at a fixed device budget, per system.

The family: ``ModelSpec`` with the width, heads, vocabulary and positions of the base spec and
``n_layer`` varied (depth is the axis that grows a model without growing its largest layer, which
is how GPT-2 small -> XL and OPT 125M -> 30B mostly grow). "Device memory" means *model data*:
parameters, gradients and optimizer states held on the device (activations are excluded for every
system alike; on this CPU-only machine there is no device to measure them against).

How each system is judged (``budget_bytes`` = B, ``host_bytes`` = H):

- plain PyTorch: everything lives on the device: 4 B (param) + 4 B (grad) + 8 B (AdamW moments) per
  parameter, fp32; fits if ``16 P <= B``. Analytic and exact (a real step allocates exactly these).
- FSDP2 + CPUOffloadPolicy: by its design the device holds the unsharded parameters of the unit in
  use plus the prefetched next unit, and the unsharded gradients of one unit before they are
  reduce-scattered and offloaded: ``4 (2 U + U)`` bytes with U the largest FSDP unit (one
  ``GPT2Block``, or the root: embeddings + final norm); the host holds ``16 P / world``. Analytic.
- DeepSpeed ZeRO-3 + optimizer/param offload: DeepSpeed's own estimator
  ``estimate_zero3_model_states_mem_needs(cpu_offload=True, cpu_offload_params=True)`` (device
  = 4 x largest layer; note it assumes fp16 params+grads, so for fp32 the real need is 2x that,
  which is what we use) and its host estimate (``18 P x 1.5``). Analytic, DeepSpeed's accounting.
- hf_elixir: real training steps in a spawned process with
  ``ElixirConfig(device_memory_budget_bytes=B, budget_covers_activations=False, chunk_size_numel=<largest
  parameter>)`` (B bounds model data, as the peers' accounting does; the library's
  default chunk size grows with the model, total/8, which would make the working set grow too); a model fits if one step completes and
  ``memory_stats(model)["device_peak_bytes"] <= B``. Binary search over ``n_layer`` up to a cap
  chosen so the real run stays inside the host RAM this shared machine can spare; if the cap fits,
  the result is reported as ">= cap" and, separately, the analytic host-RAM limit from the measured
  host bytes per parameter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks._harness import ModelSpec, RunSpec, count_params, launch

__all__ = ["LargestResult", "largest_layers_analytic", "search_elixir", "analytic_limits"]


@dataclass(kw_only=True)
class LargestResult:
    system: str
    n_layer: int  # largest depth that fits (0 = not even a 0-layer model fits)
    num_params: int
    method: str  # "analytic: ..." or "measured: ..."
    capped: bool = False  # the search stopped at its cap (true limit is higher)
    note: str = ""


def _with_layers(base: ModelSpec, n_layer: int) -> ModelSpec:
    return dataclasses.replace(base, n_layer=n_layer)


def largest_layers_analytic(base: ModelSpec, fits: Callable[[ModelSpec], bool], max_layers: int = 100_000) -> int:
    """Largest ``n_layer`` in [0, max_layers] with ``fits(spec)`` (``fits`` monotone in depth); -1 if none."""
    if not fits(_with_layers(base, 0)):
        return -1
    lo, hi = 0, max_layers
    if fits(_with_layers(base, hi)):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(_with_layers(base, mid)) else (lo, mid)
    return lo


def _block_numel(spec: ModelSpec) -> int:
    return count_params(_with_layers(spec, 1)) - count_params(_with_layers(spec, 0))


def _root_numel(spec: ModelSpec) -> int:
    return count_params(_with_layers(spec, 0))


def _ds_estimate(total: int, largest_layer: int, world_size: int) -> tuple[int, int]:
    """DeepSpeed's own ZeRO-3 offload estimate (cpu_bytes, device_bytes_fp32)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest_layer, num_gpus_per_node=world_size,
                                                        cpu_offload=True, cpu_offload_params=True,
                                                        zero_init=True)
    return cpu, 2 * gpu  # its device figure is 4 B/param = fp16 param + fp16 grad; fp32 doubles it


def analytic_limits(base: ModelSpec, budget_bytes: int, host_bytes: int, world_size: int = 1,
                    have_deepspeed: bool = True) -> list[LargestResult]:
    """Largest depth for plain PyTorch, FSDP2-offload and DeepSpeed ZeRO-3-offload (see module doc)."""
    out = []

    def plain(s):
        return 16 * count_params(s) <= budget_bytes

    def fsdp2(s):
        unit = max(_root_numel(s), _block_numel(s) if s.n_layer else 0)
        return 4 * 3 * unit <= budget_bytes and 16 * count_params(s) // world_size <= host_bytes

    layers = largest_layers_analytic(base, plain)
    out.append(LargestResult(system="PyTorch (plain)", n_layer=layers,
                             num_params=count_params(_with_layers(base, max(layers, 0))),
                             method="analytic: 16 B/param (fp32 param+grad+AdamW moments) <= budget"))
    layers = largest_layers_analytic(base, fsdp2)
    out.append(LargestResult(system="FSDP2 + CPUOffload", n_layer=layers,
                             num_params=count_params(_with_layers(base, max(layers, 0))),
                             method="analytic: device 12 B x largest unit; host 16 B/param <= host RAM",
                             note="bounded by host RAM, not by the device budget"))
    if have_deepspeed:
        def ds(s):
            cpu, dev = _ds_estimate(count_params(s), _largest_leaf_layer(s), world_size)
            return dev <= budget_bytes and cpu <= host_bytes

        layers = largest_layers_analytic(base, ds)
        out.append(LargestResult(system="DeepSpeed ZeRO-3 offload", n_layer=layers,
                                 num_params=count_params(_with_layers(base, max(layers, 0))),
                                 method="analytic: deepspeed estimate_zero3_model_states_mem_needs "
                                        "(device x2 for fp32; host 27 B/param)",
                                 note="bounded by host RAM, not by the device budget"))
    return out


def _largest_leaf_layer(spec: ModelSpec) -> int:
    """DeepSpeed's 'largest layer': most parameters owned directly by one module (the embedding)."""
    d = spec.n_embd
    return max(spec.vocab_size * d, spec.n_positions * d, 4 * d * d + 4 * d, 3 * d * d + 3 * d)


def smallest_chunk_numel(spec: ModelSpec) -> int:
    """The smallest legal chunk for this family: the largest parameter (the token embedding, V x d)."""
    return max(spec.vocab_size * spec.n_embd, 4 * spec.n_embd * spec.n_embd)


def search_elixir(base: ModelSpec, budget_bytes: int, max_layers: int, work_dir: str | Path,
                  world_size: int = 1, timeout_s: float = 300.0, log: Callable[[str], None] = print,
                  chunk_size_numel: int | None = None) -> tuple[LargestResult, list[dict[str, Any]]]:
    """Binary search over ``n_layer`` with real hf_elixir steps at ``budget_bytes`` (see module doc).

    Probes ``max_layers`` first (one run when the cap fits), then bisects. ``chunk_size_numel`` fixes
    the chunk size (``None`` = the library's choice, which grows with the model). Returns the result
    and the probe log (n_layer, ok, device peak, host bytes, error).
    """
    probes: list[dict[str, Any]] = []

    def fits(n_layer: int) -> bool:
        spec = RunSpec(peer="elixir_budget", world_size=world_size, model=_with_layers(base, n_layer),
                       warmup_steps=0, steps=1,
                       options={"budget_bytes": budget_bytes, "chunk_size_numel": chunk_size_numel})
        result = launch(spec, work_dir, timeout_s=timeout_s)
        peak = result.extra.get("device_peak_bytes") if result.ok else None
        ok = result.ok and peak is not None and peak <= budget_bytes
        probes.append({"n_layer": n_layer, "num_params": count_params(spec.model), "ok": ok,
                       "device_peak_bytes": peak, "host_bytes": result.extra.get("host_bytes"),
                       "step_s": result.step_times_s[0] if result.ok else None,
                       "error": (result.error.splitlines()[0][:300] if not result.ok
                                 else "" if ok else f"device peak {peak} > budget {budget_bytes}")})
        log(f"  hf_elixir largest-model probe n_layer={n_layer}: {'fits' if ok else 'does not fit'}"
            f" (device peak {peak}, budget {budget_bytes})")
        return ok

    lo, hi = 0, max_layers
    capped = False
    if fits(hi):
        best, capped = hi, True
    elif not fits(lo):
        best = -1
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        best = lo
    system = "hf_elixir" if chunk_size_numel else "hf_elixir (library default chunk size)"
    result = LargestResult(system=system, n_layer=best,
                           num_params=count_params(_with_layers(base, max(best, 0))),
                           method="measured: real steps, device_peak_bytes <= budget"
                                  + (f", chunk_size_numel={chunk_size_numel} (the largest parameter)"
                                     if chunk_size_numel else ""), capped=capped,
                           note=f"search capped at n_layer={max_layers} (host RAM/time on this shared "
                                f"machine); the true limit is higher" if capped else "")
    return result, probes


def host_limited_params(host_bytes: int, host_bytes_per_param: float) -> int:
    """Parameters that fit in ``host_bytes`` at the measured host bytes per parameter."""
    return int(math.floor(host_bytes / host_bytes_per_param)) if host_bytes_per_param > 0 else 0
