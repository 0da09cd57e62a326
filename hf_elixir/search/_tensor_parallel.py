"""Tensor parallelism in the cost model: the step one rank of a tensor-parallel group runs, the collectives of its
split layers, and the tensor-parallel degrees the search tries.

[Note: tensor parallel pricing]
With ``W`` ranks and a tensor-parallel degree ``tp`` (dividing ``W`` and the model's head counts),
``hf_elixir.parallel.parallelize`` rewrites the modules ``resolve_placements`` places ``column`` / ``row`` /
``column_gather`` / ``row_split`` / ``embedding_row`` / ``embedding_column`` (``hf_elixir/parallel/_tp_modules.py``)
so that each rank holds ``1 / tp`` of their weights, and every parameter's chunk, split or not, is sharded over the
data-parallel group: the ``W / tp`` ranks ``r, r + tp, ...`` of the row-major ``(dp, tp)`` mesh (``dp_group`` in
``parallel/_mesh.py``, :func:`hf_elixir.parallel._groups.chunk_group_of`). The ``tp`` ranks of a row read the same
batch. So:

* :func:`tensor_parallel_profile` turns the profiled step into the step of one rank: a split module's weight (and a
  column module's bias; a row module adds its whole bias after the all-reduce) keeps ``1 / tp`` of its elements; the
  compute of an event of a split linear (from its pre-hook to the next event: its matmul and, for ``v_proj``-like
  projections, the attention over the rank's heads) is divided by ``tp``; the activations saved inside a
  tensor-parallel block (the parent of a column/row pair: attention over ``heads / tp`` heads, the MLP's
  intermediate) shrink by ``tp``, except the inputs the column modules save (the whole block input, on every rank);
* ``build_chunked_step`` packs every chunk for ``W / tp`` ranks (:attr:`ChunkedStep.chunk_world_sizes`): per rank the
  split parameters' state is ``1 / (tp * W / tp) = 1 / W`` of the model's, the others' ``tp / W``; at ``tp = W``
  each chunk is whole on its rank;
* the split layers' collectives ([Megatron-LM] section 3), per step, priced on the events that wait for them
  (added to their compute seconds, a recomputed forward paying its forward ones again):
  ``T`` tokens, ``H`` hidden size, ``b`` bytes per element, ring collectives that send ``2 (tp - 1) / tp`` (all-
  reduce) or ``(tp - 1) / tp`` (all-gather) of the tensor from each rank:

  =====================  ========================================  ==========================================
  placement              forward                                   backward
  =====================  ========================================  ==========================================
  ``row``                all-reduce of the output, ``T H b``        --
  ``row_split``          all-reduce of the output, ``T H b``        all-gather of the input gradient
  ``column``             --                                        all-reduce of the input gradient, ``T H b``
  ``column_gather``      all-gather of the output (``T x out``)    all-reduce of the input gradient, ``T H b``
  ``embedding_row``      all-reduce of the lookups, ``T H b``      --
  ``embedding_column``   all-gather of the lookups, ``T H b``      --
  =====================  ========================================  ==========================================

  (:func:`collective_bytes`), at the intra-node link rate where the group fits in a node (``tp <= gpus_per_node``),
  else at the network's (:meth:`~hf_elixir.profiler.HardwareProfile.link_rate`). A column module's input and a row
  module's output are taken as ``H`` wide (true of every transformer block the registry splits); a
  ``column_gather`` / ``row_split`` module's other side is its weight's numel over ``H``.

A model already rewritten by ``parallelize`` is profiled as one rank's step: nothing is divided again, only the
chunk groups and the collectives are priced (``parallelized=True``).

Source: Megatron-LM (arXiv 1909.08053, section 3: the column/row pairs, one all-reduce per attention and per MLP
in each pass); the runtime's layers in ``hf_elixir/parallel/_tensor_parallel.py`` and ``_tp_modules.py``.
"""

from __future__ import annotations

from dataclasses import replace

from hf_elixir.profiler import HardwareProfile, StepProfile
from hf_elixir.search._activation_cost import DTYPE_BYTES

__all__ = ["SPLIT_PLACEMENTS", "collective_bytes", "tensor_parallel_collectives", "tensor_parallel_degrees",
           "tensor_parallel_profile"]

#: placements whose weights ``parallelize`` splits over the tensor-parallel group
SPLIT_PLACEMENTS = ("column", "row", "column_gather", "row_split", "embedding_row", "embedding_column")
#: placements whose module's event compute is one rank's share of a split matmul
_SPLIT_MATMULS = ("column", "row", "column_gather", "row_split")


def _owner(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _split_numel(numel: int, placement: str, param_name: str, tp: int) -> int:
    """One rank's elements of a parameter of a module placed ``placement``: a row module's bias stays whole."""
    if placement in ("row", "row_split") and param_name.endswith(".bias"):
        return numel
    return -(-numel // tp)


def _block_parents(placements: dict[str, str]) -> set[str]:
    """The tensor-parallel blocks: parents of the ``column`` / ``row`` pairs (``*.self_attn``, ``*.mlp``)."""
    return {_owner(fqn) for fqn, p in placements.items() if p in ("column", "row") and fqn}


def _split_activation_bytes(profile: StepProfile, placements: dict[str, str]) -> dict[str, int]:
    """Module FQN -> profiled saved bytes that the tensor-parallel split divides: those of a block parent and of the
    modules under it, except column modules (they save the whole block input)."""
    parents = _block_parents(placements)
    out = {}
    for fqn, nbytes in profile.module_activation_bytes.items():
        if placements.get(fqn) in ("column", "column_gather"):
            continue
        if any(fqn == p or fqn.startswith(p + ".") for p in parents):
            out[fqn] = nbytes
    return out


def tensor_parallel_profile(profile: StepProfile, tensor_parallel_size: int,
                            placements: dict[str, str]) -> StepProfile:
    """The step one rank runs at ``tensor_parallel_size`` ([Note: tensor parallel pricing]); the profile itself at 1.

    Args:
        profile: the unmodified model's step.
        tensor_parallel_size: ``tp >= 1``.
        placements: module FQN -> placement at that degree (``resolve_placements(model,
            ElixirConfig(tensor_parallel_size=tp))``; ``ElixirPlan.placements``).

    Raises:
        ValueError: ``tensor_parallel_size`` below 1, or above 1 with no module placed in :data:`SPLIT_PLACEMENTS`.
    """
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r} must be an int >= 1")
    if tp == 1:
        return profile
    if not any(p in SPLIT_PLACEMENTS for p in placements.values()):
        raise ValueError(f"tensor_parallel_size={tp} but no module is placed {'/'.join(SPLIT_PLACEMENTS)}: pass the "
                         "placements resolve_placements(model, ElixirConfig(tensor_parallel_size=...)) gives")
    numels = [_split_numel(n, placements[_owner(name)], name, tp) if placements.get(_owner(name)) in SPLIT_PLACEMENTS
              else n for name, n in zip(profile.param_names, profile.param_numels)]
    events = []
    for e in profile.events:
        if placements.get(e.module) in _SPLIT_MATMULS:
            e = replace(e, flops=e.flops / tp, compute_s=None if e.compute_s is None else e.compute_s / tp)
        events.append(e)
    split = _split_activation_bytes(profile, placements)
    saved = {fqn: nbytes - nbytes // tp for fqn, nbytes in split.items()}  # bytes one rank no longer holds
    blocks = {b: v - sum(s for fqn, s in saved.items() if fqn == b or fqn.startswith(b + "."))
              for b, v in profile.block_activation_bytes.items()}
    return replace(
        profile, param_numels=numels, events=events,
        module_activation_bytes={fqn: v - saved.get(fqn, 0) for fqn, v in profile.module_activation_bytes.items()},
        block_activation_bytes=blocks, activation_peak_bytes=profile.activation_peak_bytes - sum(saved.values()),
        forward_flops=sum(e.flops for e in events if e.phase == "fwd"),
        backward_flops=sum(e.flops for e in events if e.phase == "bwd"))


def collective_bytes(tensor_numel: int, element_bytes: int, tensor_parallel_size: int, kind: str) -> int:
    """Bytes one rank sends in a ring ``kind`` (``"all_reduce"`` or ``"all_gather"``) of a tensor of
    ``tensor_numel`` elements (the whole, gathered tensor) over ``tensor_parallel_size`` ranks:
    ``2 (tp - 1) / tp`` or ``(tp - 1) / tp`` of its bytes. 0 at ``tp = 1``.

    Raises:
        ValueError: an unknown ``kind``, or a count below 1 (``tensor_numel`` below 0).
    """
    if kind not in ("all_reduce", "all_gather"):
        raise ValueError(f"kind={kind!r} must be 'all_reduce' or 'all_gather'")
    if min(element_bytes, tensor_parallel_size) < 1 or tensor_numel < 0:
        raise ValueError(f"collective_bytes(tensor_numel={tensor_numel}, element_bytes={element_bytes}, "
                         f"tensor_parallel_size={tensor_parallel_size}): counts must be >= 1")
    tp = tensor_parallel_size
    return (2 if kind == "all_reduce" else 1) * tensor_numel * element_bytes * (tp - 1) // tp


def _module_numels(profile: StepProfile, scale: int) -> dict[str, int]:
    """Module FQN -> elements of its own parameters, times ``scale`` (``tp`` for one rank's profile: about the full
    sizes of split modules)."""
    out: dict[str, int] = {}
    for name, numel in zip(profile.param_names, profile.param_numels):
        out[_owner(name)] = out.get(_owner(name), 0) + numel * scale
    return out


def _pass_collectives(placement: str, tokens: int, hidden: int, module_numel: int) -> dict[str, tuple[str, int]]:
    """``phase -> (kind, tensor numel)`` of one call of a module placed ``placement`` (the table of [Note: tensor
    parallel pricing])."""
    th = tokens * hidden
    other = tokens * max(1, module_numel // max(1, hidden))  # T x (the features that are not H)
    return {
        "row": {"fwd": ("all_reduce", th)},
        "row_split": {"fwd": ("all_reduce", th), "bwd": ("all_gather", other)},
        "column": {"bwd": ("all_reduce", th)},
        "column_gather": {"fwd": ("all_gather", other), "bwd": ("all_reduce", th)},
        "embedding_row": {"fwd": ("all_reduce", th)},
        "embedding_column": {"fwd": ("all_gather", th)},
    }.get(placement, {})


def tensor_parallel_collectives(profile: StepProfile, events: list, tensor_parallel_size: int,
                                placements: dict[str, str], precision: str, hardware: HardwareProfile,
                                gpus_per_node: int) -> tuple[list[float], int]:
    """Per event of ``events`` (``profile.events``, or the checkpointed list built from them), the seconds of the
    tensor-parallel collectives it waits for, and the bytes they send in the step ([Note: tensor parallel
    pricing]). ``profile``: one rank's step (:func:`tensor_parallel_profile`, or a parallelized model's profile; the
    one ``events`` were built from), with ``tokens`` and ``hidden_size``.

    Raises:
        ValueError: ``tp > 1`` and the profile recorded no ``tokens`` or ``hidden_size`` (a profile saved before
            they were recorded, or a model without ``config.hidden_size``).
    """
    out = [0.0] * len(events)
    tp = tensor_parallel_size
    if tp == 1:
        return out, 0
    if profile.tokens < 1 or profile.hidden_size < 1:
        raise ValueError(f"tensor_parallel_size={tp} needs StepProfile.tokens and hidden_size to price the "
                         f"collectives (got {profile.tokens} and {profile.hidden_size}): profile the step again "
                         "with hf_elixir.profiler.profile_step (a model whose config has hidden_size)")
    b = DTYPE_BYTES[precision]
    rate = hardware.link_rate(across_nodes=tp > gpus_per_node)
    numels = _module_numels(profile, tp)
    original = {id(e) for e in profile.events}
    count: dict[tuple[str, str], int] = {}
    for e in profile.events:
        count[(e.module, e.phase)] = count.get((e.module, e.phase), 0) + 1
    total = 0
    for k, e in enumerate(events):
        placement = placements.get(e.module)
        if placement not in SPLIT_PLACEMENTS:
            continue
        phase = e.phase if id(e) in original else "fwd"  # a recomputed forward runs in the backward phase
        what = _pass_collectives(placement, profile.tokens, profile.hidden_size, numels.get(e.module, 0)).get(phase)
        if what is None:
            continue
        nbytes = collective_bytes(what[1], b, tp, what[0]) // max(1, count.get((e.module, phase), 1))
        out[k] = nbytes / rate
        total += nbytes
    return out, total


def tensor_parallel_degrees(world_size: int, gpus_per_node: int, heads: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The degrees ``--tensor-parallel-size auto`` tries: 1, 2, 4, 8 where they divide ``world_size`` and every
    head count in ``heads``, and fit in a node (``<= gpus_per_node``): tensor parallelism talks every layer, over
    NVLink."""
    return tuple(tp for tp in (1, 2, 4, 8) if tp <= min(world_size, gpus_per_node) and not world_size % tp
                 and all(h % tp == 0 for h in heads))
