"""Dynamic loss scaling for fp16 (the ``torch.amp.GradScaler`` rule, with a stop on repeated minima)."""

from __future__ import annotations

from hf_elixir.config import LossScalePolicy

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Scale the loss by ``scale``; on overflow skip the step and back off; grow after clean intervals.

    Raises:
        FloatingPointError: (from :meth:`update`) the scale sat at ``policy.min_scale`` and still
            overflowed ``policy.max_consecutive_min_scale_overflows`` times in a row: the model is
            diverging and further steps would silently not learn.
    """

    def __init__(self, policy: LossScalePolicy, enabled: bool) -> None:
        self.policy = policy
        self.enabled = enabled
        self.scale = float(policy.init_scale) if enabled else 1.0
        self._growth_tracker = 0
        self._min_scale_overflows = 0
        self.num_skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        policy = self.policy
        if found_inf:
            self.num_skipped_steps += 1
            self._growth_tracker = 0
            if self.scale <= policy.min_scale:
                self._min_scale_overflows += 1
                if self._min_scale_overflows >= policy.max_consecutive_min_scale_overflows:
                    raise FloatingPointError(
                        f"fp16 gradients overflowed {self._min_scale_overflows} steps in a row at the minimum "
                        f"loss scale {policy.min_scale}; training is diverging. Lower the learning rate, use "
                        "precision='bf16', or lower LossScalePolicy.min_scale"
                    )
            self.scale = max(self.scale * policy.backoff_factor, policy.min_scale)
            return
        self._min_scale_overflows = 0
        self._growth_tracker += 1
        if self._growth_tracker >= policy.growth_interval:
            self.scale *= policy.growth_factor
            self._growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "min_scale_overflows": self._min_scale_overflows, "num_skipped_steps": self.num_skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._min_scale_overflows = int(state.get("min_scale_overflows", 0))
        self.num_skipped_steps = int(state.get("num_skipped_steps", 0))
