"""Cast/copy of a chunk between dtypes (fp32 master -> bf16/fp16 compute copy, or back).

``fused_adamw_(out_lowp=...)`` already refreshes the compute copy during the optimizer step; this op
is for the other moments that need a copy: initial packing, loading a checkpoint, host-updated shards
onloaded as fp32. ``dst[i] = src[i].to(dst.dtype)`` with round-to-nearest-even.
"""

from __future__ import annotations

import torch

from ._dispatch import HAS_TRITON, check_1d_contiguous, use_triton

__all__ = ["cast_"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZE = 4096
NUM_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cast_kernel(src_ptr, dst_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
        """dst[i] = src[i] cast to dst's element type, BLOCK_SIZE elements per program."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_elements
        x = tl.load(src_ptr + offs, mask=mask)
        tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _launch_cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.numel()
    if n == 0:
        return
    _cast_kernel[(triton.cdiv(n, BLOCK_SIZE),)](src, dst, n, BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS)


def cast_(src_fp32: torch.Tensor, dst_lowp: torch.Tensor, *, force_triton: bool = False) -> torch.Tensor:
    """Copy ``src_fp32`` into ``dst_lowp`` converting the dtype; returns ``dst_lowp``.

    Args:
        src_fp32: contiguous 1-D source (fp32, bf16 or fp16; usually the fp32 master shard).
        dst_lowp: contiguous 1-D destination of the same numel and device (fp32, bf16 or fp16).
        force_triton: run the Triton kernel on CPU tensors (tests, under ``TRITON_INTERPRET=1``).

    Raises:
        ValueError / TypeError: shapes, dtypes or devices differ from the above.
    """
    check_1d_contiguous("src_fp32", src_fp32, dtypes=_DTYPES)
    check_1d_contiguous("dst_lowp", dst_lowp, src_fp32.numel(), _DTYPES)
    if src_fp32.device != dst_lowp.device:
        raise ValueError(f"src_fp32 is on {src_fp32.device} but dst_lowp on {dst_lowp.device}; cast_ does not move data")
    if use_triton(src_fp32, force_triton):
        _launch_cast(src_fp32, dst_lowp)
    else:
        dst_lowp.copy_(src_fp32)
    return dst_lowp
