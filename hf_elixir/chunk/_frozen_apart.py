"""Frozen parameters never share a chunk with trained ones: the one bucketing rule both the chunks ``prepare``
builds (``_build.comm_buckets``) and the search's packing of a profile (``search/_chunked_step._pack``) follow, so
the runtime lays out the chunks the plan priced.

[Note: frozen chunks apart] A chunk with any trained parameter carries, for its whole shard, a gradient buffer, the
reduce-scatter of it, fp32 masters and the optimizer's state (the optimizer steps the frozen elements with ``lr`` 0).
Packed in model order, every layer's LoRA adapters share chunks with that layer's frozen base weights, so plain LoRA
paid full fine-tuning's gradients, masters and AdamW state for the whole frozen base (and QLoRA's masters rewrote the
NF4 bytes that read as NaN: [Note: carriers in frozen chunks] in ``_nf4.py``). With frozen parameters in buckets of
their own, the base's chunks are gathered only (no gradients, masters, optimizer state or reduce-scatters) and the
adapters fill a few chunks of their own, which the search keeps resident (they are used by every layer): the
layout ``hf-elixir plan --lora-rank`` prices. Within each bucket the given order (model order, or the plan's) is kept; buckets come
in the order of their first parameter. A model wholly trained or wholly frozen gets one bucket per key, exactly the
layout it had before the split: the split only ever separates parameters whose ``requires_grad`` differ.
"""

from __future__ import annotations

from typing import Hashable, Iterable, TypeVar

__all__ = ["frozen_apart"]

K = TypeVar("K", bound=Hashable)


def frozen_apart(keys: Iterable[K], trained: Iterable[bool]) -> list[tuple[K, list[int]]]:
    """Indices of the parameters grouped by ``(key, trained)``, order kept, buckets in the order of their first index.

    Args:
        keys: per parameter, what else separates buckets (its process group, its gradient-norm replicas, whether
            it is replicated or an expert's); equal keys of a trained and a frozen parameter still split.
        trained: per parameter, whether it is trained (``requires_grad``).

    Returns:
        ``[(key, indices), ...]``.
    """
    buckets: dict[tuple[K, bool], list[int]] = {}
    for index, (key, is_trained) in enumerate(zip(keys, trained, strict=True)):
        buckets.setdefault((key, bool(is_trained)), []).append(index)
    return [(key, indices) for (key, _), indices in buckets.items()]
