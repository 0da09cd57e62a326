"""Deterministic packing of parameters into fixed-size chunks.

The search (hf_elixir/search) and the chunk manager both call :func:`pack_chunks`, so a chunk id
in an :class:`~hf_elixir.plan.ElixirPlan` names the same group of parameters on both sides.

Source: PatrickStar (arXiv 2108.05818) section 4.1 and Elixir (arXiv 2212.05339) section 5.1:
parameters are appended in first-use order to the current chunk; a parameter that does not fit
opens a new chunk; a parameter never spans two chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkLayout", "pack_chunks", "replicated_chunk_size", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value`` (``multiple`` >= 1)."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ChunkLayout:
    """Where each parameter sits.

    Attributes:
        members: per chunk, the parameter indices (into the input list) in offset order.
        offsets: per chunk, the element offset of each member inside the chunk.
        chunk_numels: per chunk, its padded numel (a multiple of ``world_size``).
        used_numels: per chunk, the elements that hold parameters (the rest is padding).
    """

    members: list[list[int]]
    offsets: list[list[int]]
    chunk_numels: list[int]
    used_numels: list[int]

    @property
    def num_chunks(self) -> int:
        return len(self.members)

    @property
    def padding_numel(self) -> int:
        return sum(self.chunk_numels) - sum(self.used_numels)


def pack_chunks(numels: list[int], chunk_size_numel: int, world_size: int = 1,
                align_numel: int = 1, bucket_packing: bool = False) -> ChunkLayout:
    """Pack parameters (given by numel, in packing order) greedily into chunks.

    Every chunk has ``round_up(chunk_size_numel, world_size)`` elements except the last, which is
    trimmed to ``round_up(used, world_size)`` (with ``bucket_packing``: every chunk is). Each parameter
    starts at a multiple of ``align_numel``.

    Args:
        numels: element counts, in the order parameters are packed (zero-sized ones are allowed).
        chunk_size_numel: elements per chunk.
        world_size: ranks the chunk is sharded over; chunk numels are multiples of it.
        align_numel: alignment of each parameter's offset, in elements.
        bucket_packing: pack like DistributedDataParallel's gradient buckets (``bucket_cap_mb``): a
            parameter larger than ``chunk_size_numel`` gets a chunk of its own instead of raising, and every
            chunk is trimmed to the parameters it holds (no padding to all-reduce; the pool charges bytes, so
            chunks need no common size). Whole frozen chunks are packed so too ([Note: whole frozen chunks] in
            ``_frozen_whole.py``). See [Note: replicated buckets].

    Raises:
        ValueError: ``chunk_size_numel`` smaller than the largest parameter (names both numbers), unless
            ``bucket_packing``.
    """
    if chunk_size_numel <= 0:
        raise ValueError(f"chunk_size_numel={chunk_size_numel} must be > 0")
    largest = max(numels, default=0)
    if largest > chunk_size_numel and not bucket_packing:
        raise ValueError(
            f"chunk_size_numel={chunk_size_numel} is smaller than the largest parameter "
            f"({largest} elements); use chunk_size_numel >= {largest} or leave it None to search"
        )
    full_numel = round_up(chunk_size_numel, world_size)
    members: list[list[int]] = [[]]
    offsets: list[list[int]] = [[]]
    used: list[int] = [0]
    for index, numel in enumerate(numels):
        start = round_up(used[-1], align_numel)
        if (start + numel > chunk_size_numel or used[-1] > chunk_size_numel) and members[-1]:
            members.append([])
            offsets.append([])
            used.append(0)
            start = 0
        members[-1].append(index)
        offsets[-1].append(start)
        used[-1] = start + numel
    if not members[-1]:
        members, offsets, used = [], [], []
    if bucket_packing:
        return ChunkLayout(members, offsets, [max(round_up(u, world_size), world_size) for u in used], used)
    chunk_numels = [full_numel] * len(members)
    if chunk_numels:
        chunk_numels[-1] = max(round_up(used[-1], world_size), world_size)
    return ChunkLayout(members, offsets, chunk_numels, used)


#: Replicated chunks are gradient all-reduce buckets: DistributedDataParallel's default bucket (25 MiB).
REPLICATED_BUCKET_BYTES = 25 * 2**20


def replicated_chunk_size(numels: list[int], element_bytes: int) -> int:
    """Chunk size (elements) for "replicated" placement: such chunks are never offloaded, so only the
    all-reduce granularity matters: DDP-sized buckets (``bucket_cap_mb=25``, upstream
    ``torch.nn.parallel.DistributedDataParallel``), at most the model.

    [Note: replicated buckets] Replicated chunks are packed with ``bucket_packing``: a parameter larger than
    the bucket (GPT-2's 38.6M-element tied embedding) gets a chunk of its own, as DDP gives it a bucket of its
    own, instead of raising every chunk to its size, and each chunk is trimmed to what it holds (padding
    would be all-reduced, zeroed and kept on the device for nothing). A chunk's all-reduce starts only once all its gradients
    arrived, so chunks as large as the embedding made the last ~40% of the blocks' gradients (the chunk that
    also holds the position embedding, complete only at the very end of backward) one all-reduce that
    nothing overlapped.
    """
    return max(1, min(sum(numels) or 1, REPLICATED_BUCKET_BYTES // element_bytes))
