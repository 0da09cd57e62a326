"""Frozen chunks kept whole on every rank: where the frozen base of a LoRA model (its chunks apart from the adapters',
[Note: frozen chunks apart] in ``_frozen_apart.py``) is sharded and all-gathered like trained chunks, or kept whole on
every rank and copied in from the host; and how large such whole chunks are.

[Note: whole frozen chunks] A frozen chunk never gets a gradient, so nothing has to be reduced for it and nothing
ever writes its parameters: every rank can hold the whole chunk (world-size-1 storage, ``Chunk.group`` ``None``, as a
chunk of a one-rank run), with no reduce-scatter, no all-reduce and no all-gather. Unlike a "replicated" chunk it
is placed under the budget like any other: its host copy (the shard, which is the chunk) is written once at
``prepare`` and never again (nothing changes it), an onload is a host->device copy of the whole chunk, and an
eviction just frees the device copy (no write-back; :meth:`Chunk.reshard`). ``Chunk.whole_group`` names the group
whose rank 0's values every rank starts from (one broadcast at ``prepare``, as a sharded chunk's).

Such chunks are packed like DDP's gradient buckets (``pack_chunks(bucket_packing=True)`` at
:func:`frozen_bucket_numel`): GPT-2's 38.6M-element tied embedding gets a chunk of its own and each block's frozen
weights smaller ones, so the largest frozen parameter no longer sets every chunk's size. The device floor is then
two adjacent units' own chunks (a block's base, or the embedding) plus the adapters' working set, not two
embedding-sized chunks plus a staging shard: GPT-2 124M with LoRA r16 at 2 ranks (fp32, AdamW) has a floor of 182
MiB, 36% of its 511 MiB of model data (sharded: 377 MiB, 74%). The device pool charges bytes, so chunks of several
sizes share it as chunks of one size do. Trained chunks keep their layout (the chunk size the search or the config
gives).

What each costs (per rank, for ``F`` frozen bytes, ``W`` ranks of the data-parallel group), which
``ElixirConfig(frozen_placement="auto")`` weighs (:func:`choose_frozen_whole`):

* whole: ``F`` bytes of host RAM on every rank (``W F`` per node; the sharded layout's ``F / W``), and each onload of
  an offloaded chunk moves the whole chunk host->device: ``F / h2d`` seconds a pass over the base;
* sharded: ``F / W`` of host RAM, and each unshard moves a shard host->device and all-gathers the chunk:
  ``F / (W h2d) + F / allgather`` seconds (``allgather``: gathered bytes per second).

Whole is the cheaper copy where ``1 / h2d < 1 / (W h2d) + 1 / allgather``, i.e. where the all-gather is slower than
``h2d W / (W - 1)``: gloo over loopback on a CPU (a memcpy against a socket round trip) and PCIe cards without a fast
link; a GPU whose NVLink gathers faster than that shards. Where the frozen base does not fit the host budget per rank
whole it is sharded whatever the rates say (memory first: PatrickStar, arXiv 2108.05818, and Elixir, arXiv
2212.05339 section 5, partition only when memory requires it; DDP keeps a whole copy per rank of everything, and
frozen copies are the part of that which costs no communication). Without measured rates (no hardware probe cached
on this machine at this world size) "auto" keeps them whole on a CPU (gloo's all-gather is a socket round trip) and
shards them on a GPU (NCCL over NVLink gathers faster than a PCIe copy of the whole chunk, and a whole copy per rank
of a large base is what a GPU node's host memory can least afford); ``hf-elixir probe`` measures both rates. A model
that trains nothing (a reference model, a teacher: every parameter frozen) is stored once, sharded: its only cost
is the all-gather, and ``W`` host copies of a whole model per node are what sharding exists to avoid. One rank: no difference in storage, so "auto" keeps the
layout one-rank runs always had (sharded chunks, which at one rank are whole). The decision is made once per
``prepare`` (rank 0's), before the search packs chunks, and a searched plan records it (``ElixirPlan.frozen_whole``):
a plan numbers the chunks of one layout, so ``prepare`` given a plan follows it.
"""

from __future__ import annotations

import logging

from hf_elixir.chunk.packing import REPLICATED_BUCKET_BYTES
from hf_elixir.config import FROZEN_PLACEMENTS

__all__ = ["FROZEN_PLACEMENTS", "choose_frozen_whole", "frozen_bucket_numel"]

logger = logging.getLogger(__name__)

def frozen_bucket_numel(chunk_size_numel: int, element_bytes: int) -> int:
    """Elements per whole frozen chunk ([Note: whole frozen chunks]): DDP's 25 MiB bucket, at most the trained chunks'
    size (a parameter larger than that still gets a chunk of its own)."""
    return max(1, min(chunk_size_numel, REPLICATED_BUCKET_BYTES // max(1, element_bytes)))


def choose_frozen_whole(mode: str, world_size: int, frozen_bytes: int, host_budget_bytes: int,
                        h2d_bytes_per_s: float | None, allgather_bytes_per_s: float | None,
                        is_parallel: bool = False, *, trains: bool = True,
                        device_type: str = "cpu") -> tuple[bool, str]:
    """Whether frozen chunks are kept whole on every rank ([Note: whole frozen chunks]).

    Args:
        mode: ``ElixirConfig.frozen_placement``: ``"whole"``, ``"sharded"`` or ``"auto"`` (priced).
        world_size: ranks of the data-parallel group.
        frozen_bytes: bytes of the frozen floating-point parameters in the compute dtype (one whole copy).
        host_budget_bytes: host bytes per rank (``ElixirConfig.host_memory_budget_bytes`` or its default).
        h2d_bytes_per_s / allgather_bytes_per_s: the measured host->device copy rate and all-gather rate (gathered
            bytes per second) of this machine at ``world_size`` (``HardwareProfile``); ``None``: not measured.
        is_parallel: a tensor/expert-parallel model (its chunks have groups of their own): always sharded.
        trains: the model trains some parameter; ``False`` (every parameter frozen): "auto" shards.
        device_type: the compute device's type: without measured rates "auto" keeps whole on ``"cpu"`` only.

    Returns:
        ``(whole, reason)``.
    """
    if mode == "whole":
        return not is_parallel, ("frozen chunks whole on every rank (frozen_placement='whole')" if not is_parallel
                                 else "frozen chunks sharded: a tensor/expert-parallel model's chunks keep their groups")
    if mode == "sharded" or frozen_bytes == 0:
        return False, ""
    if world_size == 1 or is_parallel:
        return False, ""
    if frozen_bytes > host_budget_bytes:
        return False, (f"frozen_placement='auto' -> sharded: a whole copy of the {frozen_bytes} frozen bytes does not "
                       f"fit the host budget of {host_budget_bytes} bytes per rank")
    if not trains:
        return False, "frozen_placement='auto' -> sharded: a model that trains nothing is stored once, sharded"
    if not h2d_bytes_per_s or not allgather_bytes_per_s:
        if device_type != "cpu":
            return False, ("frozen_placement='auto' -> sharded: no measured copy or all-gather rate here, and on a "
                           f"{device_type} device the all-gather outpaces whole copies (run `hf-elixir probe` to price it)")
        return True, ("frozen_placement='auto' -> whole: no measured copy or all-gather rate here, and a whole copy "
                      f"of the {frozen_bytes} frozen bytes fits the host budget (no collective for them)")
    whole_s = frozen_bytes / h2d_bytes_per_s
    sharded_s = frozen_bytes / (world_size * h2d_bytes_per_s) + frozen_bytes / allgather_bytes_per_s
    verdict = "whole" if whole_s <= sharded_s else "sharded"
    return whole_s <= sharded_s, (
        f"frozen_placement='auto' -> {verdict}: a pass over the {frozen_bytes} frozen bytes costs {whole_s:.3g} s as "
        f"whole-chunk copies ({h2d_bytes_per_s:.3g} B/s host->device) against {sharded_s:.3g} s as shard copies "
        f"plus all-gathers ({allgather_bytes_per_s:.3g} B/s) at {world_size} ranks")
