"""Which features of a tensor-parallel split each rank holds: DTensor's rule, also for sizes the ranks do not divide.

[Note: uneven tensor-parallel slices] A dim of ``full`` features split over ``size`` ranks gives rank ``r`` the
features ``[r * c, min((r + 1) * c, full))`` with ``c = ceil(full / size)``: every rank but the last holds ``c``,
the last one the rest (GPT-2's 50257 tokens at tp 2: 25129 and 25128). This is ``torch.chunk`` and DTensor's
``Shard(dim)`` (``Shard._local_shard_size_and_offset``), which transformers' tensor parallel builds its
parameters with, so a vocabulary after ``resize_token_embeddings`` (32001, 128257) or an odd MLP width splits as
it does there. A packed tensor (GPT-2's ``q|k|v``, ``gate|up``) splits each of its equal parts by this rule. Every
split, merge, gather and streamed read of a tensor-parallel parameter in hf_elixir goes through
:func:`tp_slice`, so they agree; a split that leaves a rank no feature is refused where placements are resolved.

What differs between the ranks of a tp group: their parameters' shapes, hence their chunk layouts. The ranks that
share a chunk (its data-parallel group) share a tp rank, so their chunks match; tp rank 0 holds the longest slice
of every parameter, so what ``prepare`` takes from rank 0 (the chunk size, a searched plan and the counts it is
checked against) fits every rank. Gathers pad each slice to the longest and trim after (collectives take equal
sizes).
"""

from __future__ import annotations

__all__ = ["tp_slice", "tp_slice_sizes"]


def tp_slice(full: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s features of a dim of ``full`` split over ``size`` ranks (see
    [Note: uneven tensor-parallel slices]); ``length`` is 0 when the ceil-sized pieces run out first."""
    assert 0 <= rank < size, f"tp rank {rank} outside a group of {size}"
    step = -(-full // size)
    start = min(rank * step, full)
    return start, min(full, start + step) - start


def tp_slice_sizes(full: int, size: int) -> list[int]:
    """Every rank's number of features (rank order) of a dim of ``full`` split over ``size`` ranks."""
    return [tp_slice(full, r, size)[1] for r in range(size)]
