"""Undo one Adam/AdamW step in place by its inverse update (the host lane's rollback without snapshots).

[Note: inverse rollback] The host lane ([Note: host lane] in ``_overlap.py``) steps a chunk speculatively during
backward; when the step's validation refuses the update (clipping triggered, fp16 overflow, a gradient
accumulation misprediction, a state read before ``step()``), the update has to be undone. For Adam/AdamW the
lane does not keep a copy of the chunk's state: it applies the inverse of the update with the same gradient
(still in the gradient shard) and the hyperparameters the speculation used, as DeepSpeed's SuperOffload does
(``DeepSpeedCPUAdam.rollback_subgroup``; arXiv 2509.21271, section 4). ``torch.optim``'s step at step count
``t`` (``bc1 = 1 - b1^t``, ``bc2 = 1 - b2^t``; ``maximize``: ``g <- -g``; Adam's L2 decay: ``g <- g + wd p``)::

    m <- lerp(m, g, 1 - b1);  v <- b2 v + (1 - b2) g^2;  p <- p (1 - lr wd)   (AdamW, decoupled)
    p <- p - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)

is undone in reverse order: ``p`` with the NEW ``m``, ``v`` first, then ``p / (1 - lr wd)`` (AdamW); with L2
decay the gradient the moments saw is rebuilt from the recovered ``p``; then ``m <- (m - (1 - b1) g) / b1``,
``v <- max(0, (v - (1 - b2) g^2) / b2)``, and the step count goes back by one. A step that was a view's first
(``t = 1``) leaves no state behind: the entry is dropped as before that step (torch creates it again, zero).

Error: not bitwise. ``p`` and ``m`` come back within about one ulp of their magnitude after the update
(``p``: one fused add and one division; ``m``: a subtraction whose result is divided by ``b1``, so the error is
``ulp(m_new) / b1``, large relative to ``m_old`` only when the gradient dwarfs the moment, ``|g| >> |m_old| b1 /
(1 - b1)``). ``v`` loses relative precision when ``v_old << (1 - b2) g^2``: the absolute error is about
``ulp(v_new) / b2``, i.e. a relative error on ``v_old`` of ``2^-24 (1 + (1 - b2) g^2 / (b2 v_old))``: with the
default ``b2 = 0.999`` a gradient 30x the running RMS gives ~1e-7 relative, 1000x gives ~6e-5 (a gradient spike,
which is when clipping triggers). The redone update reads ``sqrt(v)``, so half that reaches one update, scaled
by ``lr``. Measured on tiny GPT-2 (AdamW, 2 param groups, LR schedule, 6 steps, ``tests/test_host_overlap.py``):

* every step clipped hard (max norm 0.1, coefficient ~0.03-0.08; all 78 speculative chunk steps undone and
  redone): model vs plain PyTorch 3.3e-7 relative L2 (lane off: 2.1e-7; lane on vs off: 2.8e-7);
* clipping in the first steps only (half the chunk steps undone): 2.5e-6 vs PyTorch, as the lane off (2.5e-6);
* fp16, an overflow after 11 chunks were stepped: after the skipped step the masters are 4.4e-9, ``exp_avg``
  3.7e-8, ``exp_avg_sq`` 1.6e-8 (relative L2) from their values before it.

Where the compute runs in fp16, a master one ulp off flips an fp16 rounding now and then, and the fp16 forward
amplifies that: after 6 fp16 steps with clipping the lane-on model is ~7e-4 (relative L2) from the lane-off one,
the spread of fp16 training itself; the exact snapshot path (AMSGrad) stays bitwise there.
``max(0, .)`` guards the rounding of an all-but-zero ``v_old``.

Not invertible or not covered, kept on the snapshot path (``_overlap.py``): AMSGrad (the running max forgets
what it replaced), ``b1`` or ``b2`` of 0 or 1, ``lr * wd = 1`` (AdamW), ``capturable`` / ``differentiable``,
other optimizer classes; and fp16 with a loss scale or scaling policy that is not a power of two (the lane
unscales the gradient in place; multiplying a power-of-two scale back is exact, fp32 subnormals aside). Which
path a chunk takes is fixed when the lane is built (``HostLane.inverse_chunks``, so the snapshot room is
reserved once); an inverse chunk whose hyperparameters later stop being invertible is not speculated on (stepped
in ``step()``), and tensor hyperparameters stop all speculation, as before.
"""

from __future__ import annotations

import math

import torch

__all__ = ["group_invertible", "power_of_two", "undo_adam_step"]


def power_of_two(value: float) -> bool:
    """Whether ``value`` is a (positive) power of two: dividing and multiplying by it is exact in floats."""
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


def group_invertible(cls: type, group: dict) -> bool:
    """Whether a step of ``cls`` (the inner optimizer's class) with the param group ``group``'s hyperparameters
    can be undone by :func:`undo_adam_step` ([Note: inverse rollback])."""
    if cls not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
        return False
    beta1, beta2 = group["betas"]
    scalars = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])
    if any(torch.is_tensor(v) or not math.isfinite(float(v)) for v in scalars):
        return False
    if not (0.0 < beta1 < 1.0 and 0.0 < beta2 < 1.0):
        return False
    return not (_decoupled(cls, group) and group["lr"] * group["weight_decay"] == 1.0)


def _decoupled(cls: type, group: dict) -> bool:
    return bool(group.get("decoupled_weight_decay", cls is torch.optim.AdamW))


@torch.no_grad()
def undo_adam_step(cls: type, group: dict, step: int, params: list[torch.Tensor], grads: list[torch.Tensor],
                   exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor]) -> None:
    """Undo, in place, the Adam/AdamW step number ``step`` of tensors stepped together ([Note: inverse rollback]).

    Args:
        cls: ``torch.optim.Adam`` or ``torch.optim.AdamW`` (with ``group``: :func:`group_invertible`).
        group: the hyperparameters the step used (``lr``, ``betas``, ``eps``, ``weight_decay``, ``maximize``,
            ``decoupled_weight_decay``).
        step: the step count the step used (>= 1; the state's ``step`` after it). For ``step == 1`` only the
            parameters are restored (the caller drops the moments).
        params, grads, exp_avgs, exp_avg_sqs: fp32 tensors of equal shapes per index (a view's master slice,
            the gradient the step read, its moments after the step), on one device.
    """
    assert step >= 1 and group_invertible(cls, group), f"step {step}, group {group}"
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    decoupled = _decoupled(cls, group)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1.0 - beta2**step))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=lr / (1.0 - beta1**step))
    del denom
    if wd and decoupled:
        torch._foreach_div_(params, 1.0 - lr * wd)
    if step == 1:
        return
    g = torch._foreach_neg(grads) if group.get("maximize") else grads
    if wd and not decoupled:
        g = torch._foreach_add(g, params, alpha=wd)
    torch._foreach_add_(exp_avgs, g, alpha=-(1.0 - beta1))
    torch._foreach_div_(exp_avgs, beta1)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=-(1.0 - beta2))
    torch._foreach_div_(exp_avg_sqs, beta2)
    torch._foreach_clamp_min_(exp_avg_sqs, 0.0)
