"""Cast/copy of a chunk between dtypes (fp32 master -> bf16/fp16 compute copy, or back).

``fused_adamw_(out_lowp=...)`` already refreshes the compute copy during the optimizer step; this op
is for the other moments that need a copy: initial packing, loading a checkpoint, host-updated shards
onloaded as fp32, and the optimizer's refresh of the compute copies (``_refresh_compute_copies``).
``dst[i] = src[i].to(dst.dtype)`` with round-to-nearest-even: bitwise what ``Tensor.copy_`` gives.

[Note: bf16 rounding]
A downcast to bf16 is done in integer arithmetic (add ``0x7FFF`` plus the lowest kept bit, keep the
top 16 bits; NaN stays a quiet NaN), the rounding PyTorch's ``c10::BFloat16`` uses. ``x.to(tl.bfloat16)``
compiles to a round-to-nearest-even ``cvt`` on CUDA, but Triton's interpreter (``TRITON_INTERPRET=1``,
what CPU tests run) truncates, so the kernel would differ from the hardware it simulates; the integer
form is the same on both, and costs a few ALU operations in a memory-bound kernel. An upcast from bf16
is a 16-bit shift for the same reason (the interpreter flushes bf16 subnormals to zero).
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
    def _fp32_to_bf16_rne(x):
        """fp32 -> bf16 rounded to nearest even in integer arithmetic (see [Note: bf16 rounding])."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = tl.where(x != x, 0x7FC00000, bits)  # NaN -> quiet NaN (the carry could reach the sign)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _bf16_to_fp32(x):
        """bf16 -> fp32, exact (the bf16 bits are the fp32's top half; subnormals included)."""
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _cast_kernel(src_ptr, dst_ptr, n_elements, FROM_BF16: tl.constexpr, TO_BF16: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
        """dst[i] = src[i] cast to dst's element type, BLOCK_SIZE elements per program."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_elements
        x = tl.load(src_ptr + offs, mask=mask)
        if FROM_BF16:
            x = _bf16_to_fp32(x)
        if TO_BF16:
            y = _fp32_to_bf16_rne(x.to(tl.float32))
        else:
            y = x.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + offs, y, mask=mask)


def _launch_cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.numel()
    if n == 0:
        return
    from_bf16 = src.dtype == torch.bfloat16 and dst.dtype != torch.bfloat16
    to_bf16 = dst.dtype == torch.bfloat16 and src.dtype != torch.bfloat16
    _cast_kernel[(triton.cdiv(n, BLOCK_SIZE),)](src, dst, n, FROM_BF16=from_bf16, TO_BF16=to_bf16,
                                                BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS)


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
