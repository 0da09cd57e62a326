"""Expert parallelism in the cost model: the step one rank of an expert-parallel group runs, the all-to-all
traffic of its MoE layers, and the expert-parallel degrees the search tries.

[Note: expert parallel pricing]
With ``W`` ranks and an expert-parallel degree ``ep`` (dividing ``W`` and every MoE layer's expert count ``E``),
``hf_elixir.parallel.parallelize`` keeps ``E / ep`` experts of each layer on each rank (``docs/expert-parallel.md``)
and the chunks are built per communication bucket (``hf_elixir.chunk._build.comm_buckets``): the expert parameters
are sharded over the expert-data-parallel group (``W / ep`` ranks holding the same experts, ranks ``r, r + ep, ...``
of the row-major mesh, ``parallel/_mesh.py``), every other parameter over all ``W`` ranks. So:

* :func:`expert_parallel_profile` turns the profiled step into the step of one rank: each fused expert tensor
  keeps ``E / ep`` of its experts (its numel divided by ``ep``), a container with one child per expert keeps
  ``E / ep`` children; nothing else changes. The FLOPs stay: with balanced routing the rank's experts get
  ``ep`` ranks' tokens times ``1 / ep`` of the routed choices, the ``tokens x top_k`` rows they ran before;
* ``build_chunked_step`` packs the two buckets apart, in the order the runtime does (the bucket of the first
  parameter first), and gives each chunk its group size (:attr:`ChunkedStep.chunk_world_sizes`): the expert
  parameters' state per rank is ``1 / (ep * W / ep) = 1 / W`` of the model's, as under ZeRO alone, but their
  chunks are gathered, reduced and (with rank-local host copies) copied within ``W / ep`` ranks, and not at all
  at ``ep = W``, where a chunk is whole on its rank like a single-rank chunk (refilled by a local onload,
  no host copy);
* every MoE layer sends its routed rows to the experts' ranks and back: per layer and step
  ``4 x tokens x top_k x hidden x bytes per element x (ep - 1) / ep`` bytes leave each rank (forward dispatch and
  combine, and the same two in backward; :func:`alltoall_bytes_per_layer`), at the intra-node link rate where the
  expert-parallel group fits in a node (``ep <= gpus_per_node``), else at the network's
  (:meth:`~hf_elixir.profiler.HardwareProfile.link_rate`). The expert computation waits for it: it is added to
  the compute seconds of the expert container's events, a recomputed forward (activation checkpointing) paying
  its two again.

[Note: tp x ep pricing] Under tensor and expert parallel together ([Note: tp x ep mesh] in
``hf_elixir/parallel/_mesh.py``) the ``tp`` ranks of a row share one batch and split its tokens before the
dispatch, so a rank's experts run ``1 / tp`` of the rows they run at the same ``ep`` alone and a rank sends
``1 / tp`` of the all-to-all bytes (:func:`tokens_split_over_tp`: the MoE layers' ``tokens`` and, for an
unmodified model's profile, the expert containers' event FLOPs and seconds, divided by ``tp``); the dense chunks are
sharded over the ``world / tp`` ranks of the dense view and the experts' over the ``world / ep`` ranks holding the
same experts (``build_chunked_step``), and the degrees are compared per token of the whole job, as tensor parallel
alone (``_degree_search.py``).

Source: GShard (arXiv 2006.16668) and DeepSpeed-MoE (arXiv 2201.05596) for the all-to-all dispatch/combine per MoE
layer; the runtime's layout in ``hf_elixir/parallel/_fused_experts.py`` and ``_mesh.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hf_elixir.profiler import HardwareProfile, StepProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES

__all__ = ["alltoall_bytes_per_layer", "alltoall_seconds", "expert_param_indices", "expert_parallel_degrees",
           "expert_parallel_profile", "group_rate", "rank_param_order", "tokens_split_over_tp"]


def alltoall_bytes_per_layer(tokens: int, top_k: int, hidden_size: int, element_bytes: int,
                             expert_parallel_size: int) -> int:
    """Bytes one rank sends in one MoE layer's all-to-alls per training step ([Note: expert parallel pricing]):
    ``4 x tokens x top_k x hidden_size x element_bytes x (ep - 1) / ep`` (forward dispatch + combine, backward
    dispatch + combine; the ``1 / ep`` of the rows routed to the rank's own experts stays). 0 at ``ep = 1``.

    Raises:
        ValueError: a count below 1 (``tokens`` below 0).
    """
    if min(top_k, hidden_size, element_bytes, expert_parallel_size) < 1 or tokens < 0:
        raise ValueError(f"alltoall_bytes_per_layer(tokens={tokens}, top_k={top_k}, hidden_size={hidden_size}, "
                         f"element_bytes={element_bytes}, expert_parallel_size={expert_parallel_size}): counts "
                         "must be >= 1")
    ep = expert_parallel_size
    return 4 * tokens * top_k * hidden_size * element_bytes * (ep - 1) // ep


def expert_parallel_degrees(profile: StepProfile, world_size: int) -> tuple[int, ...]:
    """The degrees the search tries: 1 and the largest ``ep`` dividing ``world_size`` and every MoE layer's
    expert count (just ``(1,)`` for a dense model or one rank)."""
    counts = [layer["num_experts"] for layer in profile.moe_layers.values()]
    if not counts or world_size < 2:
        return (1,)
    largest = math.gcd(world_size, *counts)
    return (1, largest) if largest > 1 else (1,)


def _expert_params(profile: StepProfile) -> dict[int, str]:
    """Parameter index -> the MoE layer (container FQN) it is an expert parameter of."""
    prefixes = {f"{fqn}.": fqn for fqn in profile.moe_layers}
    out: dict[int, str] = {}
    for i, name in enumerate(profile.param_names):
        for prefix, fqn in prefixes.items():
            if name.startswith(prefix):
                out[i] = fqn
                break
    return out


def expert_param_indices(profile: StepProfile) -> frozenset[int]:
    """Indices of the expert parameters (those under a ``moe_layers`` container), as they are: for a model already
    rewritten by ``hf_elixir.parallel.parallelize``, whose profile is one rank's step."""
    return frozenset(_expert_params(profile))


def expert_parallel_profile(profile: StepProfile, expert_parallel_size: int) -> tuple[StepProfile, frozenset[int]]:
    """The step one rank runs at ``expert_parallel_size`` ([Note: expert parallel pricing]) and the indices of its
    expert parameters (the profile itself at 1).

    Raises:
        ValueError: ``expert_parallel_size`` below 1, above 1 for a profile without MoE layers, or not dividing
            a layer's expert count.
    """
    ep = expert_parallel_size
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_parallel_size={ep!r} must be an int >= 1")
    experts = _expert_params(profile)
    if ep == 1:
        return profile, frozenset(experts)
    if not profile.moe_layers:
        raise ValueError(f"expert_parallel_size={ep} but the profile has no MoE layers (StepProfile.moe_layers is "
                         "empty: a dense model, or a profile saved before they were recorded); use 1")
    for fqn, layer in profile.moe_layers.items():
        if layer["num_experts"] % ep:
            raise ValueError(f"{fqn}: num_experts={layer['num_experts']} is not divisible by expert_parallel_size="
                             f"{ep}; pick one that divides it")
    children: dict[str, list[str]] = {}  # per-expert containers: child names in first-use order
    keep: list[int] = []
    numels: list[int] = []
    for i, numel in enumerate(profile.param_numels):
        fqn = experts.get(i)
        if fqn is not None and profile.moe_layers[fqn]["fused"]:
            numel //= ep  # E / ep experts of the fused tensor
        elif fqn is not None:
            child = profile.param_names[i][len(fqn) + 1:].split(".")[0]
            order = children.setdefault(fqn, [])
            if child not in order:
                order.append(child)
            if order.index(child) >= profile.moe_layers[fqn]["num_experts"] // ep:
                continue  # another rank's expert
        keep.append(i)
        numels.append(numel)
    new = {old: j for j, old in enumerate(keep)}
    view = replace(
        profile, param_names=[profile.param_names[i] for i in keep], param_numels=numels,
        param_requires_grad=[profile.param_requires_grad[i] for i in keep],
        grad_ready_event=[profile.grad_ready_event[i] for i in keep],
        events=[replace(e, params=[new[i] for i in e.params if i in new]) for e in profile.events])
    return view, frozenset(new[i] for i in experts if i in new)


def tokens_split_over_tp(profile: StepProfile, expert_parallel_size: int, tensor_parallel_size: int, *,
                         events_too: bool) -> StepProfile:
    """The step of one rank once its tp group splits the MoE layers' tokens ([Note: tp x ep pricing]); the profile
    itself unless both degrees are above 1. ``events_too``: also divide the expert containers' event FLOPs and
    seconds (an unmodified model's profile; a parallelized model's events were measured on the rank)."""
    tp = tensor_parallel_size
    if expert_parallel_size == 1 or tp == 1 or not profile.moe_layers:
        return profile
    layers = {fqn: {**layer, "tokens": -(-layer["tokens"] // tp)} for fqn, layer in profile.moe_layers.items()}
    events = profile.events
    if events_too:
        events = [replace(e, flops=e.flops / tp, compute_s=None if e.compute_s is None else e.compute_s / tp)
                  if e.module in layers else e for e in events]
    return replace(profile, moe_layers=layers, events=events,
                   forward_flops=sum(e.flops for e in events if e.phase == "fwd"),
                   backward_flops=sum(e.flops for e in events if e.phase == "bwd"))


def rank_param_order(rank_profile: StepProfile) -> list[str]:
    """``ElixirPlan.param_order`` of an expert-parallel plan (``rank_profile`` from :func:`expert_parallel_profile`):
    the rank's parameters in packing order, without the experts of per-expert containers, whose names differ from
    rank to rank (``prepare`` packs the parameters a plan does not name after it, in model order: the expert
    bucket keeps its order). A fused expert tensor has the same name on every rank."""
    experts = _expert_params(rank_profile)
    return [name for i, name in enumerate(rank_profile.param_names)
            if i not in experts or rank_profile.moe_layers[experts[i]]["fused"]]


def alltoall_seconds(profile: StepProfile, events: list, expert_parallel_size: int, precision: str,
                     hardware: HardwareProfile, gpus_per_node: int) -> tuple[list[float], int]:
    """Per event of ``events`` (``profile.events``, or the checkpointed list built from them), the seconds of
    its MoE layer's all-to-alls, and the bytes they send in the step ([Note: expert parallel pricing]): a
    layer's forward dispatch + combine spread over its container's forward events (again on each recomputed
    one), its backward pair over its backward events."""
    out = [0.0] * len(events)
    ep = expert_parallel_size
    if ep == 1 or not profile.moe_layers:
        return out, 0
    rate = hardware.link_rate(across_nodes=ep > gpus_per_node)
    original = {id(e) for e in profile.events}
    count: dict[tuple[str, str], int] = {}
    for e in profile.events:
        if e.module in profile.moe_layers:
            count[(e.module, e.phase)] = count.get((e.module, e.phase), 0) + 1
    total = 0
    for k, e in enumerate(events):
        layer = profile.moe_layers.get(e.module)
        if layer is None:
            continue
        phase = e.phase if id(e) in original else "fwd"  # a recomputed forward runs in the backward phase
        pair = alltoall_bytes_per_layer(layer["tokens"], layer["top_k"], layer["hidden_size"],
                                        DTYPE_BYTES[precision], ep) // 2  # dispatch + combine of one pass
        nbytes = pair // max(1, count.get((e.module, phase), 1))
        out[k] = nbytes / rate
        total += nbytes
    return out, total


def group_rate(hardware: HardwareProfile, group_size: int, across_nodes: bool) -> float:
    """Gathered (or reduce-scattered) bytes per second of a ring collective over ``group_size`` ranks: each link
    moves ``(g - 1) / g`` of them, at :meth:`~hf_elixir.profiler.HardwareProfile.link_rate`."""
    return hardware.link_rate(across_nodes) * group_size / max(1, group_size - 1)
