"""TRL's reference/teacher synchronisation (``SyncRefModelCallback``) for a model under hf_elixir.

[Note: reference and teacher syncs between steps]

TRL keeps a second model in step with the trained one between optimizer steps: ``sync_ref_model=True`` in
``DPOConfig`` / ``GRPOConfig`` / ``RLOOConfig`` / ``KTOConfig`` (TR-DPO) adds a ``trl.trainer.callbacks.
SyncRefModelCallback``, and the experimental ``SDPOTrainer`` (by default) and ``SDFTTrainer`` (with
``teacher_model_kind="ema"``) add its subclass ``SyncTeacherModelCallback``. At ``on_step_end`` they call
``self.sync_target_model(model, target, alpha)``, which runs
``target_param.data.mul_(1 - alpha).add_(param.data, alpha=alpha)`` over
``zip(target.parameters(), model.parameters(), strict=True)`` (gathering everything at once under DeepSpeed
ZeRO-3). Between steps a parameter under hf_elixir is a placeholder that raises ``StaleParameterError``
([Note: stale placeholder] in chunk/params.py), so the step ended in that error.

``ElixirCallback`` gives each such callback an instance ``sync_target_model`` that reads the trained model's
values from ``model.state_dict()`` instead: a collective on every rank (TRL calls the sync on every rank outside
DeepSpeed) that gathers one module's chunks at a time under the device budget and hands back host copies (one
full host copy of the weights while the sync runs, as ``trainer.save_model()`` makes). The update is TRL's own,
the same two in-place operations on the same values, in ``model.named_parameters()`` order, the order of
``model.parameters()`` (tied weights once). A model not under hf_elixir keeps TRL's function.
"""

from __future__ import annotations

import torch

from hf_elixir.runtime._state import get_state

__all__ = ["serve_target_syncs"]


def serve_target_syncs(callbacks) -> int:
    """Give every TRL ``SyncRefModelCallback``-like callback in ``callbacks`` (a class-level
    ``sync_target_model(model, target_model, alpha)`` and a ``ref_model``) the hf_elixir-aware sync; returns how
    many were found."""
    found = 0
    for callback in callbacks:
        original = getattr(type(callback), "sync_target_model", None)
        if original is None or not hasattr(callback, "ref_model") or "sync_target_model" in vars(callback):
            continue
        callback.sync_target_model = _sync_from_state_dict(original)
        found += 1
    return found


def _sync_from_state_dict(original):
    def sync_target_model(model: torch.nn.Module, target_model: torch.nn.Module, alpha: float) -> None:
        try:
            get_state(model)
        except ValueError:  # not under hf_elixir: TRL's own update
            return original(model, target_model, alpha)
        full = model.state_dict()  # collective, module by module under the budget ([Note: reference and ...])
        names = [name for name, _ in model.named_parameters()]
        targets = list(target_model.parameters())
        if len(names) != len(targets):
            raise ValueError(
                f"the reference/teacher model has {len(targets)} parameters and the trained model {len(names)}: TRL "
                "syncs them one to one (sync_ref_model / an EMA teacher); give it a reference of the same "
                "architecture, or turn the sync off")
        with torch.no_grad():
            for name, target in zip(names, targets):
                target.data.mul_(1.0 - alpha).add_(full[name].to(target.device, target.dtype), alpha=alpha)
        return None

    return sync_target_model
