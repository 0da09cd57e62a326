"""Gradient norms of a chunk's gradient shard, block by block.

[Note: blockwise norms] The global gradient norm (``ElixirOptimizer.clip_grad_norm``, and the host lane's
squared norm of each host chunk, ``hf_elixir/optim/_overlap.py``) is accumulated in fp64, as
``torch.nn.utils.clip_grad_norm_`` would be on a plain model at this precision. An fp64 copy of a whole fp32
gradient shard is twice its bytes: 33 MiB for a big chunk, on the host for host-optimizer chunks, on the
device for the others, at the step, where memory peaks. :func:`pow_sum` and :func:`max_abs` read the shard in
blocks of :data:`NORM_BLOCK_NUMEL` elements (1 Mi: an 8 MiB fp64 temporary at most) into one fp64
accumulator, so the extra memory is one block whatever the chunk size. The result equals the whole-shard fp64
computation up to fp64 rounding (the sum is split at block boundaries; ``max_abs`` is exact).
"""

from __future__ import annotations

import torch

__all__ = ["NORM_BLOCK_NUMEL", "max_abs", "pow_sum"]

#: elements read per block (fp64 temporary: 8 bytes each)
NORM_BLOCK_NUMEL = 1 << 20


def _blocks(grad: torch.Tensor, block_numel: int | None):
    size = NORM_BLOCK_NUMEL if block_numel is None else block_numel
    if size < 1:
        raise ValueError(f"block_numel={size} must be >= 1 (elements per block of the norm)")
    flat = grad.reshape(-1)
    for start in range(0, flat.numel(), size):
        yield flat[start:start + size]


def pow_sum(grad: torch.Tensor, norm_type: float, block_numel: int | None = None) -> torch.Tensor:
    """``sum(|grad| ** norm_type)`` accumulated in fp64, one block at a time ([Note: blockwise norms]).

    Args:
        grad: any shape and floating dtype (a chunk's gradient shard: fp32 ``[shard_numel]``), host or device.
        norm_type: the norm's ``p`` (finite, > 0).
        block_numel: elements per block; ``None``: :data:`NORM_BLOCK_NUMEL`.

    Returns:
        fp64 0-d tensor on ``grad.device`` (0 for an empty ``grad``); equal to
        ``grad.double().norm(norm_type) ** norm_type`` up to fp64 rounding.

    Raises:
        ValueError: ``block_numel`` < 1.
    """
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for block in _blocks(grad, block_numel):
        total += block.double().norm(norm_type) ** norm_type
    return total


def max_abs(grad: torch.Tensor, block_numel: int | None = None) -> torch.Tensor:
    """``max(|grad|)`` as fp64, one block at a time (NaN if any element is NaN; 0 for an empty ``grad``).

    Args:
        grad: any shape and floating dtype, host or device.
        block_numel: elements per block; ``None``: :data:`NORM_BLOCK_NUMEL`.

    Returns:
        fp64 0-d tensor on ``grad.device``; exactly ``grad.abs().max().double()`` for a non-empty ``grad``.

    Raises:
        ValueError: ``block_numel`` < 1.
    """
    result = torch.zeros((), dtype=torch.float64, device=grad.device)
    for block in _blocks(grad, block_numel):
        result = torch.maximum(result, block.abs().max().double())
    return result
