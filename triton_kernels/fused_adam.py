"""Fused Adam / AdamW update of one chunk shard: kernel, launcher, PyTorch reference, dispatcher.

One pass reads ``param, grad, exp_avg, exp_avg_sq`` and writes ``param, exp_avg, exp_avg_sq`` (and,
optionally, the low-precision compute copy), instead of the ~10 passes of the unfused PyTorch ops.
Math (per element ``i`` in segment ``s``; ``t`` = ``step``, 1-based), as in
``torch.optim.Adam/AdamW(foreach=False)`` (Kingma & Ba 2015; Loshchilov & Hutter 2019)::

    g      = grad[i] * grad_scale
    if decoupled:  p = p * (1 - lr[s] * wd[s])          # AdamW
    else:          g = g + wd[s] * p                      # Adam with L2 penalty
    m      = m + (1 - beta1) * (g - m)                    # exp_avg.lerp_(g, 1 - beta1)
    v      = v * beta2 + (1 - beta2) * g * g
    denom  = sqrt(v) / sqrt(1 - beta2**t) + eps
    p      = p - (lr[s] / (1 - beta1**t)) * (m / denom)
    out_lowp[i] = p.to(out_lowp.dtype)

[Note: segment lookup]
A chunk shard may hold parameters of several param groups. The caller describes the shard as ``S``
contiguous segments: ``seg_bounds`` (int64, ``S+1``) holds their element boundaries, ``seg_lr`` and
``seg_weight_decay`` (fp32, ``S``) their hyper-parameters. Each element finds its segment with a
branchless binary search over ``seg_bounds``: ``ceil(log2(S))`` steps, a compile-time constant, each a
gather from a table of a few dozen bytes that stays in L1. With ``S == 1`` (the common case) the
search is compiled out and lr / weight decay are two scalar loads per program. Consecutive
parameters of the same group should be merged into one segment by the caller to keep ``S`` small.

[Note: overflow skip]
``found_inf`` (a 1-element fp32 device tensor, e.g. set by ``unscale_norm_``) is read by every
program; when it is nonzero the program branches past the whole update (a uniform branch, no
divergence), so the step costs one launch and touches no shard memory, and the host never has to
read the flag. (Folding the flag into the element mask also works and still compiles to 128-bit
accesses, but would issue every masked-off instruction; the branch issues none.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._dispatch import HAS_TRITON, check_1d_contiguous, scalar_operand, use_triton

__all__ = ["fused_adamw_", "fused_adamw_reference"]

_LOWP_DTYPES = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZE = 2048
NUM_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _adam_block(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_lowp_ptr, seg_bounds_ptr, seg_lr_ptr, seg_wd_ptr,
        grad_scale_ptr, n_elements, num_segments, grad_scale, beta1, beta2, eps, bias_correction1,
        bias_correction2_sqrt, SEARCH_STEPS: tl.constexpr, DECOUPLED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
        HAS_LOWP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        """Update the BLOCK_SIZE elements of this program (math: module docstring)."""
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_elements
        if HAS_SCALE_PTR:
            scale = tl.load(grad_scale_ptr)
        else:
            scale = grad_scale

        if SEARCH_STEPS == 0:
            lr = tl.load(seg_lr_ptr)
            wd = tl.load(seg_wd_ptr)
        else:
            # largest s < num_segments with seg_bounds[s] <= offs (see [Note: segment lookup])
            seg = tl.zeros([BLOCK_SIZE], dtype=tl.int64)
            for i in tl.static_range(SEARCH_STEPS):
                cand = seg + (1 << (SEARCH_STEPS - 1 - i))
                lower = tl.load(seg_bounds_ptr + cand, mask=mask & (cand < num_segments), other=n_elements)
                seg = tl.where(lower <= offs, cand, seg)
            lr = tl.load(seg_lr_ptr + seg, mask=mask, other=0.0)
            wd = tl.load(seg_wd_ptr + seg, mask=mask, other=0.0)

        p = tl.load(param_ptr + offs, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

        if DECOUPLED:
            p = p * (1.0 - lr * wd)
        else:
            g = g + wd * p
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        step_size = tl.div_rn(lr, bias_correction1)
        p = p - step_size * tl.div_rn(m, denom)

        tl.store(param_ptr + offs, p, mask=mask)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if HAS_LOWP:
            tl.store(out_lowp_ptr + offs, p.to(out_lowp_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fused_adam_kernel(
        param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_lowp_ptr, seg_bounds_ptr, seg_lr_ptr, seg_wd_ptr,
        grad_scale_ptr, found_inf_ptr, n_elements, num_segments, grad_scale, beta1, beta2, eps, bias_correction1,
        bias_correction2_sqrt, SEARCH_STEPS: tl.constexpr, DECOUPLED: tl.constexpr, HAS_SCALE_PTR: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr, HAS_LOWP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):
        """Grid: one program per BLOCK_SIZE elements. A uniform branch on found_inf skips the whole
        block (see [Note: overflow skip])."""
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) == 0.0:
                _adam_block(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_lowp_ptr, seg_bounds_ptr,
                            seg_lr_ptr, seg_wd_ptr, grad_scale_ptr, n_elements, num_segments, grad_scale, beta1,
                            beta2, eps, bias_correction1, bias_correction2_sqrt, SEARCH_STEPS, DECOUPLED,
                            HAS_SCALE_PTR, HAS_LOWP, BLOCK_SIZE)
        else:
            _adam_block(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_lowp_ptr, seg_bounds_ptr,
                        seg_lr_ptr, seg_wd_ptr, grad_scale_ptr, n_elements, num_segments, grad_scale, beta1,
                        beta2, eps, bias_correction1, bias_correction2_sqrt, SEARCH_STEPS, DECOUPLED,
                        HAS_SCALE_PTR, HAS_LOWP, BLOCK_SIZE)


def _launch_fused_adam(param, grad, exp_avg, exp_avg_sq, seg_bounds, seg_lr, seg_wd, *, beta1, beta2, eps,
                       step, grad_scale, found_inf, out_lowp, decoupled) -> None:
    n = param.numel()
    if n == 0:
        return
    num_segments = seg_lr.numel()
    scale_value, scale_tensor = scalar_operand(grad_scale, "grad_scale", param.device)
    search_steps = 0 if num_segments == 1 else math.ceil(math.log2(num_segments))
    grid = (triton.cdiv(n, BLOCK_SIZE),)
    _fused_adam_kernel[grid](
        param, grad, exp_avg, exp_avg_sq,
        out_lowp if out_lowp is not None else param,
        seg_bounds, seg_lr, seg_wd,
        scale_tensor if scale_tensor is not None else param,
        found_inf if found_inf is not None else param,
        n, num_segments, scale_value, float(beta1), float(beta2), float(eps),
        1.0 - beta1**step, math.sqrt(1.0 - beta2**step),
        SEARCH_STEPS=search_steps,
        DECOUPLED=bool(decoupled),
        HAS_SCALE_PTR=scale_tensor is not None,
        HAS_FOUND_INF=found_inf is not None,
        HAS_LOWP=out_lowp is not None,
        BLOCK_SIZE=BLOCK_SIZE,
        num_warps=NUM_WARPS,
    )


def fused_adamw_reference(param, grad, exp_avg, exp_avg_sq, seg_bounds, seg_lr, seg_wd, *, beta1, beta2, eps,
                          step, grad_scale, found_inf, out_lowp, decoupled) -> None:
    """PyTorch reference of the fused update (same arguments as ``fused_adamw_``, already validated).

    Uses the same in-place ops as ``torch.optim.adam._single_tensor_adam``, with per-element
    lr / weight decay expanded from the segment table. Reads ``found_inf`` on the host (free on CPU).
    """
    if found_inf is not None and bool(found_inf.reshape(-1)[0].item() != 0):
        return
    n = param.numel()
    lengths = (seg_bounds[1:] - seg_bounds[:-1]).to(param.device)
    lr = torch.repeat_interleave(seg_lr.to(param.device), lengths, output_size=n)
    wd = torch.repeat_interleave(seg_wd.to(param.device), lengths, output_size=n)
    if isinstance(grad_scale, torch.Tensor):
        grad_scale = grad_scale.reshape(()).to(device=param.device, dtype=torch.float32)
    g = grad.to(torch.float32) * grad_scale
    if decoupled:
        param.mul_(1 - lr * wd)
    else:
        g = g.add(param * wd)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.sub_(step_size * (exp_avg / denom))
    if out_lowp is not None:
        out_lowp.copy_(param)


def _as_table(value, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).contiguous()
    if isinstance(value, Sequence):
        return torch.tensor(list(value), dtype=dtype, device=device)
    raise TypeError(f"{name} must be a 1-D tensor or a sequence of numbers, got {type(value).__name__}")


def fused_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    seg_bounds,
    seg_lr,
    seg_weight_decay,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
    out_lowp: torch.Tensor | None = None,
    decoupled_weight_decay: bool = True,
    force_triton: bool = False,
    validate_bounds: bool = True,
) -> None:
    """Adam / AdamW step on one chunk shard, in place, in one fused pass (math: module docstring).

    Args:
        param: fp32 master shard, contiguous 1-D, ``N`` elements; updated in place.
        grad: gradient shard, 1-D ``N``, fp32 / bf16 / fp16 (read only; upcast to fp32 in registers).
        exp_avg, exp_avg_sq: fp32 Adam moments, 1-D ``N``; updated in place.
        seg_bounds: int64 ``S+1`` element boundaries of the shard's segments, non-decreasing,
            ``seg_bounds[0] == 0`` and ``seg_bounds[-1] == N`` (see [Note: segment lookup]).
        seg_lr: fp32 ``S`` learning rate per segment (read every step so schedulers apply).
        seg_weight_decay: fp32 ``S`` weight decay per segment.
        beta1, beta2, eps: Adam hyper-parameters, as in ``torch.optim.AdamW``.
        step: the step number of this update, 1-based (bias correction ``1 - beta**step``).
        grad_scale: factor applied to ``grad`` first (inverse loss scale times clip coefficient);
            a float, or a 1-element tensor read on the device (no host sync).
        found_inf: optional 1-element fp32 tensor; when nonzero nothing is read or written.
        out_lowp: optional bf16 / fp16 1-D ``N`` tensor that receives the updated ``param`` cast
            to its dtype (the compute copy) in the same pass.
        decoupled_weight_decay: True = AdamW (``p *= 1 - lr*wd``), False = Adam (``g += wd*p``).
        force_triton: run the Triton kernel even on CPU tensors (tests, under ``TRITON_INTERPRET=1``).
        validate_bounds: check ``seg_bounds`` when it is a CPU tensor (three reads of it); callers that
            build the table once and checked it then (``ElixirOptimizer``) pass ``False``, so a step on
            the simulated device reads nothing back, as on CUDA, where the check never runs.

    Raises:
        ValueError / TypeError: shapes, dtypes, devices or ``step`` are wrong (message names the field).

    AMSGrad, ``maximize`` and complex tensors are not supported.
    """
    check_1d_contiguous("param", param, dtypes=(torch.float32,))
    n = param.numel()
    check_1d_contiguous("grad", grad, n, _GRAD_DTYPES)
    check_1d_contiguous("exp_avg", exp_avg, n, (torch.float32,))
    check_1d_contiguous("exp_avg_sq", exp_avg_sq, n, (torch.float32,))
    if out_lowp is not None:
        check_1d_contiguous("out_lowp", out_lowp, n, _LOWP_DTYPES + (torch.float32,))
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (1-based, like torch.optim.AdamW), got {step!r}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out_lowp", out_lowp),
                    ("found_inf", found_inf)):
        if t is not None and t.device != param.device:
            raise ValueError(f"{name} is on {t.device} but param is on {param.device}; move it to the shard's device")
    if found_inf is not None and (found_inf.numel() != 1 or found_inf.dtype != torch.float32):
        raise ValueError(f"found_inf must be a 1-element fp32 tensor, got {found_inf.dtype} {tuple(found_inf.shape)}")
    seg_bounds = _as_table(seg_bounds, "seg_bounds", torch.int64, param.device)
    seg_lr = _as_table(seg_lr, "seg_lr", torch.float32, param.device)
    seg_wd = _as_table(seg_weight_decay, "seg_weight_decay", torch.float32, param.device)
    num_segments = seg_lr.numel()
    if num_segments < 1 or seg_wd.numel() != num_segments or seg_bounds.numel() != num_segments + 1:
        raise ValueError(
            f"segment tables disagree: seg_lr has {seg_lr.numel()}, seg_weight_decay {seg_wd.numel()}, "
            f"seg_bounds {seg_bounds.numel()} entries; need S >= 1, S and S+1"
        )
    if validate_bounds and seg_bounds.device.type == "cpu":  # checking costs a host sync elsewhere, so only here
        if int(seg_bounds[0]) != 0 or int(seg_bounds[-1]) != n or bool((seg_bounds[1:] < seg_bounds[:-1]).any()):
            raise ValueError(f"seg_bounds must be non-decreasing from 0 to N={n}, got {seg_bounds.tolist()}")

    kwargs = dict(beta1=beta1, beta2=beta2, eps=eps, step=step, grad_scale=grad_scale, found_inf=found_inf,
                  out_lowp=out_lowp, decoupled=decoupled_weight_decay)
    if use_triton(param, force_triton):
        _launch_fused_adam(param, grad, exp_avg, exp_avg_sq, seg_bounds, seg_lr, seg_wd, **kwargs)
    else:
        fused_adamw_reference(param, grad, exp_avg, exp_avg_sq, seg_bounds, seg_lr, seg_wd, **kwargs)
