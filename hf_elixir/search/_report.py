"""The plan the configuration search (``_plan_search.py``) returns: the winning candidate as an
:class:`~hf_elixir.plan.ElixirPlan`, with its reasons (chunk size, device bytes, predicted time, activation
policy, where the all-gathers run, sharded against replicated data parallelism), and the smallest need the
search names when nothing fits.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_elixir.plan import ElixirPlan, policy_summary
from hf_elixir.profiler import StepProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES, activation_bytes
from hf_elixir.search._grid import Candidate

__all__: list[str] = []


def _default_replicated_placements(model_or_profile: Any, profile: StepProfile) -> dict[str, str]:
    """Every parameter-owning module replicated (no user overrides known here)."""
    if isinstance(model_or_profile, nn.Module):
        from hf_elixir.config import ElixirConfig  # noqa: PLC0415
        from hf_elixir.placement import resolve_placements  # noqa: PLC0415

        return resolve_placements(model_or_profile, ElixirConfig(default_placement="replicated"))
    return {fqn: "replicated" for fqn in profile.param_modules}


def _data_parallel_reasons(modes: tuple[str, ...], best: Candidate, best_by_mode: dict[str, Candidate],
                           world_size: int, tensor_parallel_size: int = 1) -> list[str]:
    """Why sharded or replicated data parallelism won (Elixir section 5: partition only when needed); under tensor
    parallelism, the mesh (``tensor parallel 2 x data parallel 4``)."""
    tp = tensor_parallel_size
    if tp > 1:
        return [f"tensor parallel {tp} x data parallel {world_size // tp} ({world_size} ranks): chunks {modes[0]} "
                f"over the {world_size // tp} data-parallel rank(s) of each tensor-parallel position"]
    if len(modes) == 1:
        return [f"data parallel over {world_size} rank(s): {modes[0]} only"] if world_size > 1 else []
    other = "sharded" if best.data_parallel == "replicated" else "replicated"
    mine = best.prediction
    if other not in best_by_mode:
        why = ("no replicated configuration fits the budget (whole model + gradient buffers per rank)"
               if other == "replicated" else "no sharded configuration fits")
        return [f"{best.data_parallel} data parallelism: {why}; predicted {mine.step_s:.4g} s"]
    theirs = best_by_mode[other].prediction
    return [f"{best.data_parallel} data parallelism wins: predicted {mine.step_s:.4g} s vs {theirs.step_s:.4g} s for "
            f"the best {other} plan ({other} device peak {theirs.device_peak_bytes / 2**30:,.2f} GiB, "
            f"{best.data_parallel} {mine.device_peak_bytes / 2**30:,.2f} GiB)"]


def _gather_reasons(profile: StepProfile, best: Candidate, world_size: int, act_on_device: bool) -> list[str]:
    """Where a sharded plan at several ranks issues its all-gathers ([Note: gather prefetch] in
    ``chunk/manager.py``, priced as in [Note: overlap] in ``_cost.py``): MoE-expert chunks keep every gather in its
    hook; so does inference (prepare without an optimizer) under a budget covering activations; training under
    such a budget issues the forward ones ahead from the third step on, as the ranks agree at each optimizer step."""
    if world_size < 2 or best.data_parallel != "sharded":
        return []
    hooks = "so each gather waits in its hook where the ranks agree ([Note: gather prefetch] in chunk/_prefetch.py)"
    if profile.subtree_units:
        return ["all-gathers are not issued ahead: MoE-expert chunks are used only where experts got tokens and "
                f"the ranks' pools drift apart, {hooks}"]
    if not act_on_device:
        return []
    if profile.forward_only:
        return ["all-gathers are not issued ahead: the budget covers activations, whose bytes can differ between "
                "ranks, and inference (prepare without an optimizer) has no optimizer step at which the ranks "
                f"agree, {hooks}; ElixirConfig(budget_covers_activations=False) with a budget for model data lets "
                "them run ahead"]
    if best.knobs.prefetch_depth == 0:
        return []
    return [f"forward all-gathers are issued ahead ({best.knobs.prefetch_depth} events) from the third step on "
            "although the budget covers activations, whose bytes can differ between ranks: agreed by every rank at "
            "each optimizer step (each rank votes, per chunk, whether it had room in the previous step; [Note: "
            "agreed gathers ahead] in chunk/_agreed_gathers.py); backward refills are local copies of the rank-local host "
            "copies; MoE-expert models and inference (prepare without an optimizer) keep them in their hooks"]


def _to_plan(profile: StepProfile, best: Candidate, world_size: int, precision: str, budget: int, limit: int,
             size_reason: str, evaluated: int, host_memory_bytes: int | None, act_on_device: bool,
             ranks_per_host: int = 1, reduce_dtype: str | None = "fp32") -> ElixirPlan:
    k, p = best.knobs, best.prediction
    gib = 2**30
    reasons = [
        size_reason,
        f"fastest that fits {limit / gib:,.2f} GiB "
        f"(budget {budget / gib:,.2f} GiB minus safety margin) is {best.summary()}",
        f"device bytes at the peak ({p.device_peak_bytes / gib:,.2f} GiB): "
        + ", ".join(f"{name} {v / gib:,.2f} GiB" for name, v in (p.peak_breakdown or p.breakdown).items() if v),
        f"predicted step {p.step_s:.4g} s = forward+backward {p.forward_backward_s:.4g} s "
        f"(compute {p.compute_s:.4g} s, {p.onloads} chunk onloads) + optimizer {p.optimizer_s:.4g} s"
        if not profile.forward_only else
        f"inference (no optimizer): predicted forward {p.step_s:.4g} s (compute {p.compute_s:.4g} s, {p.onloads} "
        "chunk onloads in the steady state of repeated forwards); no backward, gradient buffers or optimizer "
        "states, every block keeps its activations (none are saved)",
    ]
    if best.expert_parallel_size > 1:
        ep = best.expert_parallel_size
        where = ("whole on its rank" if ep == world_size else
                 f"sharded over the {world_size // ep} ranks holding the same ones")
        reasons.append(f"expert parallel over {ep} ranks: each rank holds 1/{ep} of every MoE layer's experts, "
                       f"{where}, and sends "
                       f"{p.alltoall_bytes / 2**30:,.2f} GiB a step in the all-to-alls; train it with "
                       f"ElixirConfig(placements={{'<experts module glob>': 'expert'}}, expert_parallel_size={ep}) "
                       "and hf_elixir.parallel.parallelize (docs/expert-parallel.md)")
    if best.tensor_parallel_size > 1:
        tp = best.tensor_parallel_size
        where = ("each chunk whole on its rank" if tp == world_size else
                 f"every chunk sharded over the {world_size // tp} data-parallel ranks")
        reasons.append(f"tensor parallel over {tp} ranks: each rank holds 1/{tp} of the column/row modules' weights "
                       f"and computes 1/{tp} of their matmuls, {where}, and sends {p.tensor_parallel_bytes / 2**30:,.2f} "
                       "GiB a step in the split layers' all-reduces and all-gathers; train it with "
                       f"ElixirConfig(tensor_parallel_size={tp}) and hf_elixir.parallel.parallelize "
                       "(docs/placements.md)")
    if not act_on_device:
        reasons.append("activations are not counted in the device budget (the pool bounds model data only)")
    if best.activation_policy and policy_summary(best.activation_policy) != "keep":
        blocks = list(best.activation_policy)  # forward order
        moved = [b for b in blocks if best.activation_policy[b] != "keep"]
        where = "first blocks in forward order" if moved == blocks[:len(moved)] else "blocks: " + ", ".join(moved)
        reasons.append(f"activation policy {policy_summary(best.activation_policy)} blocks ({where}; "
                       f"activations {p.breakdown.get('activations', 0) / gib:,.2f} GiB on the device): keeping "
                       "every block's activations does not leave room for a faster plan")
    elif best.activation_checkpointing:
        reasons.append("activation checkpointing on: without it the activations do not leave room for a faster plan")
    gathers = _gather_reasons(profile, best, world_size, act_on_device)
    reasons.extend(gathers)
    if not gathers and k.prefetch_depth == 0 and best.data_parallel == "sharded":
        reasons.append("prefetch depth 0: copies do not overlap compute here, or blocks are better spent on caching")
    if k.refresh_cast == "device":
        reasons.append(f"refresh cast on the device: uploading the fp32 masters (twice the PCIe bytes, "
                       f"{p.breakdown.get('refresh_staging', 0) / 2**20:.3g} MiB of device staging) beats casting them "
                       "in the host lane here")
    if host_memory_bytes is not None:
        reasons.append(f"host bytes {p.host_bytes / gib:,.2f} GiB per rank x {ranks_per_host} rank(s) per host fit "
                       f"in host memory {host_memory_bytes / gib:,.2f} GiB")
    return ElixirPlan(
        model_type=profile.model_type, num_params=profile.num_params, world_size=world_size, precision=precision,
        chunk_size_numel=best.chunk_size_numel, param_order=list(profile.param_names),
        resident_chunks=sorted(k.resident), device_shard_chunks=sorted(k.device_shard | k.resident),
        device_optim_chunks=sorted(k.device_optim), prefetch_depth=k.prefetch_depth,
        host_copy_chunks=(sorted(set(range(best.num_chunks)) - set(k.resident) - best.whole_chunks)
                          if k.host_copies else []),
        refresh_cast=k.refresh_cast if precision != "fp32" else "host", reduce_dtype=reduce_dtype,
        activation_checkpointing=best.activation_checkpointing, activation_policy=dict(best.activation_policy),
        predicted_step_s=float(p.step_s), predicted_peak_device_bytes=int(p.device_peak_bytes),
        activation_peak_bytes=_activation_room_bytes(
            profile, precision, _policy_or_ckpt(best.activation_policy, best.activation_checkpointing)),
        reasons=reasons,
    )


def _policy_or_ckpt(policy: dict[str, str] | None, checkpointing: bool | None) -> dict[str, str] | bool:
    """The block policy, or the uniform ``activation_checkpointing`` when none (no blocks profiled)."""
    return policy if policy else bool(checkpointing)


def _activation_room_bytes(profile: StepProfile, precision: str, checkpointing: bool | dict[str, str]) -> int:
    """``ElixirPlan.activation_peak_bytes``: the profiled activation peak at ``precision`` (with or
    without checkpointing) plus the largest parameter's gradient, the temporary autograd holds before it
    lands in its chunk ([Note: activations in the budget] in ``hf_elixir/chunk/memory.py``); a forward-only step
    has no gradient, so only the forward's transient ([Note: forward-only step] in ``profiler/_step.py``)."""
    largest_grad = 0 if profile.forward_only else max(profile.param_numels, default=0) * DTYPE_BYTES[precision]
    return int(activation_bytes(profile, precision, checkpointing)) + largest_grad
