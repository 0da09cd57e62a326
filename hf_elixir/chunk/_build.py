"""Building a model's chunks: parameters split into communication buckets, each bucket packed into
chunks (:func:`~hf_elixir.chunk.packing.pack_chunks`), the chunks built and registered with the
:class:`~hf_elixir.chunk.manager.ChunkManager`; and the same packing as sizes only (:class:`ChunkSpec`),
for the minimum budget, which moves no data.

Which process group a parameter's chunk is sharded over is decided above this layer (plain data
parallel, or a tensor/expert-parallel mesh); it comes in as ``group_of(name) -> (group, replicas)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hf_elixir.chunk.chunk import Chunk, ChunkBytes, ParamSlot
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.chunk._frozen_apart import frozen_apart
from hf_elixir.chunk._frozen_whole import frozen_bucket_numel
from hf_elixir.chunk.packing import ChunkLayout, pack_chunks
from hf_elixir.config import ElixirConfig
from hf_elixir.plan import ElixirPlan
from hf_elixir.chunk.strict import host_copies, register_host, to_host

__all__ = ["ChunkSpec", "GroupOf", "build_chunks", "chunk_specs", "comm_buckets", "materialize_chunks",
           "module_of", "new_manager", "ordered_params", "unique_params", "COMPUTE_DTYPES", "element_bytes"]

#: ``ElixirConfig.precision`` -> the dtype chunks compute in
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: ``group_of(parameter name) -> (process group or None, gradient-norm replicas)``
GroupOf = Callable[[str], tuple[object, int]]


def module_of(param_name: str) -> str:
    """The qualified name of the module owning ``param_name`` (``""`` for the root)."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _placement_of(placements: dict[str, str], param_name: str) -> str | None:
    """The placement of the closest module above ``param_name`` that ``placements`` names: its owner, or for an
    expert of split fused experts (one child module per expert, ``hf_elixir/parallel/_expert_units.py``) the
    experts module, which placements name as one."""
    module = module_of(param_name)
    while module not in placements and module:
        module = module_of(module)
    return placements.get(module)


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def comm_buckets(params, names, placements: dict[str, str], group_of: GroupOf):
    """Split ``params`` (order kept) by (process group, grad-norm replicas, replicated, trained).

    Plain data parallel: one bucket over the default group. A model rewritten by
    :func:`hf_elixir.parallel.parallelize` gets the groups of its mesh (see [Note: gradient groups] in
    ``hf_elixir/parallel/_mesh.py``): expert parameters are sharded over the expert-data-parallel group,
    the rest over the data-parallel group; parameters replicated across tensor-parallel ranks count
    once in the global gradient norm (``replicas = tp``). Parameters of modules placed ``"replicated"``
    go to chunks every rank keeps whole (no all-gather), whose gradients are all-reduced over the group.
    Frozen parameters (LoRA's base, an NF4 base's packed bytes) never share a chunk with trained ones
    ([Note: frozen chunks apart] in ``_frozen_apart.py``).

    Returns:
        list of ``(group, replicas, replicated, params)``.
    """
    params = list(params)
    groups: dict[int, object] = {}
    keys = []
    for p in params:
        name = names[p][0]
        group, replicas = group_of(name)
        groups[id(group)] = group
        keys.append((id(group), replicas, _placement_of(placements, name) == "replicated"))
    return [(groups[group_id], replicas, replicated, [params[i] for i in indices])
            for (group_id, replicas, replicated), indices in frozen_apart(keys, [p.requires_grad for p in params])]


def _build_bucket(params_in_order, names, layout: ChunkLayout, dtype, group, device, manager,
                  first_id: int = 0, first_flag: int = 0, replicas: int = 1):
    chunks: list[Chunk] = []
    flag_index = first_flag
    for local_id, (members, offsets) in enumerate(zip(layout.members, layout.offsets)):
        cid = first_id + local_id
        slots = []
        for i, (member, offset) in enumerate(zip(members, offsets)):
            param = params_in_order[member]
            trainable = param.requires_grad
            slot = ParamSlot(name=names[param][0], param=param, offset=offset, numel=param.numel(),
                             shape=param.shape, trainable=trainable,
                             flag_index=flag_index if trainable else -1, index_in_chunk=i,
                             aliases=names[param][1:])
            flag_index += int(trainable)
            slots.append(slot)
            manager.slot_of[param] = slot
        chunk = Chunk(cid, slots, layout.chunk_numels[local_id], dtype, group, device, manager)
        chunk.norm_replicas = replicas
        for slot in slots:
            manager.chunk_of[slot.param] = chunk
        chunks.append(chunk)
    return chunks, flag_index


def _bucket_layout(bucket, size: int, replicated: bool, whole: bool, chunk_size: int,
                   element_bytes: int) -> tuple[ChunkLayout, int]:
    """``(layout, storage world size)`` of one communication bucket: replicated and whole frozen buckets are packed
    for world size 1 like DDP's buckets ([Note: replicated buckets] in packing.py; whole frozen ones at most
    :func:`frozen_bucket_numel`, [Note: whole frozen chunks] in ``_frozen_whole.py``), the rest in chunks of
    ``chunk_size`` sharded over the bucket's ``size`` ranks."""
    numels = [p.numel() for p in bucket]
    if whole:
        return pack_chunks(numels, frozen_bucket_numel(chunk_size, element_bytes), 1, bucket_packing=True), 1
    return pack_chunks(numels, chunk_size, 1 if replicated else size, bucket_packing=replicated), \
        (1 if replicated else size)


def _is_whole(frozen_whole: bool, replicated: bool, bucket) -> bool:
    """A bucket kept whole on every rank as frozen chunks: asked for, not "replicated", nothing in it trained."""
    return frozen_whole and not replicated and not any(p.requires_grad for p in bucket)


def build_chunks(manager: ChunkManager, params, names, placements: dict[str, str], group_of: GroupOf,
                 chunk_size: int, dtype: torch.dtype, device: torch.device, frozen_whole: bool = False) -> list[Chunk]:
    """Pack ``params`` (order kept) into chunks of ``chunk_size`` elements per communication bucket and
    register them (chunks, slots, has-gradient flags and their groups) with ``manager``. No data moves:
    the chunks are built empty (see :func:`materialize_chunks`). ``frozen_whole``: frozen buckets are kept whole on
    every rank ([Note: whole frozen chunks] in ``_frozen_whole.py``)."""
    chunks: list[Chunk] = []
    num_flags = 0
    flag_groups = []
    esize = torch.empty((), dtype=dtype).element_size()
    for bucket_group, replicas, replicated, bucket in comm_buckets(params, names, placements, group_of):
        bucket_ws = _group_size(bucket_group)
        whole = _is_whole(frozen_whole, replicated, bucket)
        layout, storage_ws = _bucket_layout(bucket, bucket_ws, replicated, whole, chunk_size, esize)
        storage_group = bucket_group if storage_ws > 1 else None
        new, end_flag = _build_bucket(bucket, names, layout, dtype, storage_group, device, manager,
                                      first_id=len(chunks), first_flag=num_flags,
                                      replicas=replicas * (bucket_ws if replicated else 1))
        if (replicated or whole) and bucket_ws > 1:
            for chunk in new:
                if replicated:
                    chunk.replicate_group = bucket_group
                else:
                    chunk.whole_group = bucket_group
        if bucket_ws > 1 and end_flag > num_flags:
            flag_groups.append((bucket_group, torch.arange(num_flags, end_flag)))
        chunks += new
        num_flags = end_flag
    manager.chunks = chunks
    manager.flags.init(num_flags, flag_groups, manager.chunks)
    return chunks


def _materialize_bytes(chunk: Chunk) -> int:
    """Device bytes :meth:`Chunk.materialize` charges: the full buffer, plus a device copy of the shard
    when the shard stays on the device and is not part of the full buffer (one rank: they alias; a
    resident chunk sharded over several ranks keeps its shard as a view into it, ``Chunk.shard_in_full``)."""
    inside = chunk.world_size == 1 or chunk.resident  # full_alias, or shard_in_full
    return chunk.full_bytes + (chunk.shard_bytes if chunk.shard_on_device and not inside else 0)


def _fp32_shard(chunk: Chunk, fill=None) -> torch.Tensor | None:
    """[Note: fp32 masters at prepare] This rank's part of ``chunk`` in fp32, read from its parameters before
    :meth:`Chunk.materialize` casts them to the compute dtype: a host copy of ``[shard_numel]`` elements (the
    whole chunk where it is not sharded), rank 0's values (the broadcast ``materialize`` does). ``None`` where
    the cast loses nothing (an fp32 chunk, or parameters already in the compute dtype) or nothing trains. The
    optimizer starts its fp32 masters from it, as PyTorch AMP steps the fp32 parameters it was given: a model
    saved with fp32 masters ([Note: fp32 exports] in runtime/_exports.py) and prepared again continues from the
    same masters, not from their bf16 rounding. Costs one fp32 chunk on the device while it is read. Streamed
    init (``fill``, [Note: streamed init] in _stream_load.py): this rank's elements read from the checkpoint once
    more, in fp32 (the file's values where it holds fp32), no collective."""
    if not chunk.trainable or chunk.dtype == torch.float32 or \
            not any(s.param.dtype == torch.float32 for s in chunk.slots):
        return None
    if fill is not None:
        shard = torch.zeros(chunk.shard_numel, dtype=torch.float32)
        fill(chunk.shard_begin, chunk.shard_begin + chunk.shard_numel, shard)
        return register_host(shard)
    full = torch.zeros(chunk.chunk_numel, dtype=torch.float32, device=chunk.compute_device)
    with torch.no_grad():
        for slot in chunk.slots:
            full[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
    group = chunk.group if chunk.world_size > 1 else chunk.copies_group
    if group is not None:
        dist.broadcast(full, src=dist.get_global_rank(group, 0), group=group)
    return to_host(full[chunk.shard_begin:chunk.shard_begin + chunk.shard_numel])


def _fill_from(chunk: Chunk, fp32: torch.Tensor, fill):
    """``fill`` that serves this rank's range of ``chunk`` from ``fp32`` (cast as ``Tensor.copy_`` casts, as
    ``fill`` itself would) and any other range from ``fill``."""
    own = (chunk.shard_begin, chunk.shard_begin + chunk.shard_numel)

    def fill_own(begin: int, end: int, out: torch.Tensor) -> None:
        if (begin, end) != own:
            fill(begin, end, out)
            return
        with host_copies():
            out.copy_(fp32)

    return fill_own


def materialize_chunks(manager: ChunkManager, fill_of=None, fp32_masters: dict | None = None) -> None:
    """Copy every parameter into its chunk (placed as the chunks' flags say), reshard the chunks that
    are not resident, and hide the resharded parameters' stale values.

    Args:
        fill_of: streamed init: ``fill_of(chunk)`` gives the chunk's ``fill`` callable (see
            :meth:`~hf_elixir.chunk.chunk.Chunk.materialize`); ``None`` copies the parameters' data.
        fp32_masters: a dict to fill with ``{chunk id: this rank's fp32 part}`` of the chunks whose cast to the
            compute dtype rounds their parameters ([Note: fp32 masters at prepare]); ``None``: not kept (no
            optimizer, so no masters).
    """
    host_shards = [(c.shard_numel, c.dtype) for c in manager.chunks if not c.shard_on_device]
    manager.host.reserve_for(host_shards)  # one host block for every host shard ([Note: host blocks])
    for chunk in manager.chunks:
        fill = fill_of(chunk) if fill_of is not None else None
        fp32 = _fp32_shard(chunk, fill) if fp32_masters is not None else None
        if fp32 is not None:
            fp32_masters[chunk.chunk_id] = fp32
            if fill is not None:  # the compute copy from the fp32 values read: the file is read once
                fill = _fill_from(chunk, fp32, fill)
        manager.make_room(_materialize_bytes(chunk), f"materialising chunk {chunk.chunk_id}")
        chunk.materialize(fill)
        if not chunk.resident and not chunk.full_alias:
            chunk.reshard()
    manager.hide_stale()  # resharded parameters raise on any read until their first use
    manager._trainable_chunks = [c for c in manager.chunks if c.trainable]


@dataclass
class ChunkSpec(ChunkBytes):
    """The sizes of a chunk :func:`build_chunks` would build, without its buffers (what the placement
    layer's sizes and working set read)."""

    chunk_id: int
    chunk_numel: int
    world_size: int
    element_size: int
    grad_element_size: int
    trainable: bool
    replicate_group: object = None  # not None: a "replicated" chunk (kept whole on every rank)

    @property
    def shard_numel(self) -> int:
        return self.chunk_numel // self.world_size

    @property
    def grad_full_bytes(self) -> int:
        return self.chunk_numel * self.grad_element_size


def chunk_specs(params, names, placements: dict[str, str], group_of: GroupOf, group_size: Callable[[object], int],
                chunk_size: int, element_size: int, grad_element_size: int,
                frozen_whole: bool = False) -> tuple[list[ChunkSpec], dict[torch.nn.Parameter, ChunkSpec]]:
    """The chunks :func:`build_chunks` would build, as sizes: the same :func:`comm_buckets` and packing.

    Args:
        group_of: as for :func:`build_chunks`; its groups need not exist (``group_size`` sizes them).
        group_size: ranks of a group ``group_of`` returns.
        frozen_whole: as for :func:`build_chunks`.

    Returns:
        ``(specs, chunk_of)``: one :class:`ChunkSpec` per chunk, and each parameter's spec.
    """
    specs: list[ChunkSpec] = []
    chunk_of: dict[torch.nn.Parameter, ChunkSpec] = {}
    for group, _, replicated, bucket in comm_buckets(params, names, placements, group_of):
        size = group_size(group)
        whole = _is_whole(frozen_whole, replicated, bucket)
        layout, storage_ws = _bucket_layout(bucket, size, replicated, whole, chunk_size, element_size)
        for members, chunk_numel in zip(layout.members, layout.chunk_numels):
            spec = ChunkSpec(len(specs), chunk_numel, storage_ws, element_size, grad_element_size,
                             any(bucket[m].requires_grad for m in members),
                             replicate_group=group if replicated and size > 1 else None)
            specs.append(spec)
            for m in members:
                chunk_of[bucket[m]] = spec
    return specs, chunk_of


def unique_params(model: torch.nn.Module) -> dict[torch.nn.Parameter, list[str]]:
    """Each parameter of ``model`` once (shared ones once), with every name it has, in model order."""
    names: dict[torch.nn.Parameter, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


def ordered_params(plan: ElixirPlan | None, params: list, names: dict) -> list:
    """``params`` in the plan's packing order (the rest after it, in model order)."""
    if plan is None or not plan.param_order:
        return params
    by_name = {names[p][0]: p for p in params}
    unknown = [n for n in plan.param_order if n not in by_name]
    if unknown:
        raise ValueError(f"ElixirConfig.plan.param_order names parameters this model lacks: {unknown[:5]}; "
                         "re-run the search for this model")
    ordered = [by_name[n] for n in plan.param_order]
    seen = set(ordered)
    return ordered + [p for p in params if p not in seen]


def element_bytes(precision: str) -> int:
    """Bytes per element of the compute dtype of ``ElixirConfig.precision``."""
    return torch.empty((), dtype=COMPUTE_DTYPES[precision]).element_size()


def new_manager(config: ElixirConfig, plan: ElixirPlan | None, device: torch.device, job_group,
                charges_activations: bool, activation_reserve_bytes: int) -> ChunkManager:
    """The chunk manager ``prepare`` builds chunks into: the agreed budget on ``device``, the reduce dtype, the
    plan's prefetch depth (else the config's), the group of every rank of the job (``job_group``), and whether
    (and how many bytes of) the budget is kept for activations ([Note: activations in the budget] in
    ``memory.py``)."""
    manager = ChunkManager(compute_device=device, budget_bytes=config.device_memory_budget_bytes,
                           reduce_dtype=torch.float32 if config.reduce_dtype == "fp32" else None,
                           prefetch_depth=plan.prefetch_depth if plan else config.prefetch_depth)
    manager.job_group = job_group
    manager.pool.charges_activations = charges_activations
    manager.pool.activation_reserve_bytes = activation_reserve_bytes  # what placement keeps (its errors say so)
    return manager
