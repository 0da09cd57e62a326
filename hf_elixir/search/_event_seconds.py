"""Each event's compute seconds in the cost model ([Note: time model] in ``_cost.py``): measured where the profile
ran on this kind of device, else counted FLOPs at the device's rate. Below both the step's event list
(``_chunked_step.py``) and the rates (``_rates.py``, which re-exports it).
"""

from __future__ import annotations

from hf_elixir.profiler import HardwareProfile, StepProfile

__all__ = ["event_seconds"]


def event_seconds(profile: StepProfile, events: list, hardware: HardwareProfile, precision: str) -> list[float]:
    """Per-event compute seconds: measured (rescaled per phase to the untraced step time) when the
    profile ran on this kind of device, else counted FLOPs at the device's matmul rate
    (:meth:`HardwareProfile.flops_rate` for ``precision``).

    Raises:
        ValueError: the profile ran on another device than ``hardware`` describes and counted no FLOPs
            (``profile_step(..., count_flops=True)`` fixes it), so its compute cannot be priced there.
    """
    measured = all(e.compute_s is not None for e in events) and profile.device == hardware.device_kind
    if not measured:
        if events and not any(e.flops for e in events):
            raise ValueError(
                f"StepProfile(device={profile.device!r}) counted no FLOPs, so its compute cannot be priced on "
                f"HardwareProfile(device_kind={hardware.device_kind!r}); profile with "
                "profile_step(model, batch, count_flops=True) (or on device='meta')")
        rate = hardware.flops_rate(precision) or 1e12
        return [e.flops / rate for e in events]
    scale = {"fwd": 1.0, "bwd": 1.0}
    if profile.plain_forward_s and profile.forward_s:
        scale["fwd"] = profile.plain_forward_s / profile.forward_s
    if profile.plain_backward_s and profile.backward_s:
        scale["bwd"] = profile.plain_backward_s / profile.backward_s
    traced = {ph: sum(e.compute_s for e in profile.events if e.phase == ph) for ph in scale}
    wall = {"fwd": profile.forward_s, "bwd": profile.backward_s}
    # events sum to the traced wall time; rescale so that they sum to the plain one
    factor = {ph: (scale[ph] * (wall[ph] or 0.0) / traced[ph]) if traced[ph] else 1.0 for ph in scale}
    return [e.compute_s * factor.get(e.phase, 1.0) for e in events]
