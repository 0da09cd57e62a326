"""Unscale + overflow check + squared L2 norm of a gradient chunk: kernel, launcher, reference, dispatcher.

Math (``g`` the gradient, ``s`` = ``inv_scale``)::

    g[i]      <- round_to_dtype(g[i] * s)                       # in place
    found_inf <- 1  if any g[i] is inf or nan (after scaling)    # else left as it was
    sq_norm   += sum_i float32(g[i])**2                          # of the stored (rounded) values

This is ``torch._amp_foreach_non_finite_check_and_unscale_`` plus the squared norm that gradient
clipping needs, in one pass and with no host sync: ``found_inf`` and the norm stay on the device and
feed ``fused_adamw_`` (``found_inf=...``, ``grad_scale = clip_coef``) directly.

[Note: deterministic partial sums]
Each program writes its block's partial sum to a small fp32 buffer (one entry per program) and the
buffer is summed with ``torch.sum`` afterwards, instead of ``atomic_add`` into one scalar: the result is
then bitwise reproducible run to run, at the cost of one tiny extra launch. ``found_inf`` is written
only by programs that saw a non-finite value, all writing the same 1.0, so that race is benign.

[Note: padding]
Chunk padding must not enter the norm. Padding has zero gradient, so it adds nothing to the sum, but
callers should still pass the unpadded slice (``grad[:valid_numel]``) so the kernel does no useless
work and a stray value in padding can never raise ``found_inf``.
"""

from __future__ import annotations

import torch

from ._dispatch import HAS_TRITON, check_1d_contiguous, scalar_operand, use_triton

__all__ = ["unscale_norm_", "unscale_norm_reference"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZE = 4096
NUM_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _unscale_norm_kernel(
        grad_ptr,
        partial_ptr,
        found_inf_ptr,
        inv_scale_ptr,
        inv_scale,
        n_elements,
        HAS_SCALE_PTR: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        """One program scales BLOCK_SIZE elements in place and writes their squared sum to partial[pid]."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_elements
        if HAS_SCALE_PTR:
            scale = tl.load(inv_scale_ptr)
        else:
            scale = inv_scale
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        g_stored = g.to(grad_ptr.dtype.element_ty)
        tl.store(grad_ptr + offs, g_stored, mask=mask)
        g = g_stored.to(tl.float32)
        # inf - inf and nan - nan are nan, finite - finite is 0: one compare catches both
        non_finite = tl.max(((g - g) != 0.0).to(tl.int32), axis=0)
        tl.store(found_inf_ptr, 1.0, mask=non_finite > 0)
        tl.store(partial_ptr + pid, tl.sum(g * g, axis=0))


def _launch_unscale_norm(grad, inv_scale, found_inf) -> torch.Tensor:
    n = grad.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=grad.device)
    scale_value, scale_tensor = scalar_operand(inv_scale, "inv_scale", grad.device)
    num_programs = triton.cdiv(n, BLOCK_SIZE)
    partial = torch.empty(num_programs, dtype=torch.float32, device=grad.device)
    _unscale_norm_kernel[(num_programs,)](
        grad, partial, found_inf,
        scale_tensor if scale_tensor is not None else partial,
        scale_value, n,
        HAS_SCALE_PTR=scale_tensor is not None,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )
    return partial.sum()


def unscale_norm_reference(grad, inv_scale, found_inf) -> torch.Tensor:
    """PyTorch reference: scale ``grad`` in place, raise ``found_inf``, return the squared norm (0-d fp32)."""
    if isinstance(inv_scale, torch.Tensor):
        inv_scale = inv_scale.reshape(()).to(device=grad.device, dtype=torch.float32)
    grad.copy_(grad.to(torch.float32) * inv_scale)
    g = grad.to(torch.float32)
    non_finite = (~torch.isfinite(g)).any().to(torch.float32)
    found_inf.copy_(torch.maximum(found_inf, non_finite.reshape(found_inf.shape)))
    return g.square().sum()


def unscale_norm_(
    grad: torch.Tensor,
    *,
    inv_scale: float | torch.Tensor,
    found_inf: torch.Tensor,
    out_sq_norm: torch.Tensor | None = None,
    force_triton: bool = False,
) -> torch.Tensor:
    """Unscale a gradient chunk in place, flag overflow and return its squared L2 norm, without a host sync.

    Args:
        grad: contiguous 1-D gradient (fp32 / bf16 / fp16), the *unpadded* part of a chunk's shard
            (see [Note: padding]); multiplied in place by ``inv_scale`` (math in fp32, stored in
            ``grad.dtype``).
        inv_scale: float, or 1-element tensor on ``grad``'s device (e.g. ``1 / loss_scale``).
        found_inf: 1-element fp32 tensor on ``grad``'s device; set to 1.0 if any scaled element is
            inf / nan, otherwise left unchanged (so one flag can be shared by many chunks).
        out_sq_norm: optional 0-d or 1-element fp32 tensor on ``grad``'s device; the squared norm is
            *added* to it (accumulate over chunks) and it is returned.
        force_triton: run the Triton kernel on CPU tensors (tests, under ``TRITON_INTERPRET=1``).

    Returns:
        The squared L2 norm of the scaled gradient as an fp32 device tensor: ``out_sq_norm`` after
        accumulation when given, else a new 0-d tensor. Never read on the host here.

    Raises:
        ValueError / TypeError: wrong shapes, dtypes or devices (the message names the argument).
    """
    check_1d_contiguous("grad", grad, dtypes=_GRAD_DTYPES)
    for name, t in (("found_inf", found_inf), ("out_sq_norm", out_sq_norm)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a 1-element fp32 tensor, got {t!r:.80}")
        if t.device != grad.device:
            raise ValueError(f"{name} is on {t.device} but grad is on {grad.device}; allocate it on grad's device")
    if found_inf is None:
        raise ValueError("found_inf is required: pass torch.zeros(1, device=grad.device)")
    if use_triton(grad, force_triton):
        if not found_inf.is_contiguous():
            raise ValueError("found_inf must be contiguous")
        sq_norm = _launch_unscale_norm(grad, inv_scale, found_inf)
    else:
        sq_norm = unscale_norm_reference(grad, inv_scale, found_inf)
    if out_sq_norm is None:
        return sq_norm
    out_sq_norm.add_(sq_norm.reshape(out_sq_norm.shape))
    return out_sq_norm
