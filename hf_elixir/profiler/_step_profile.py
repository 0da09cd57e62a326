"""What one profiled step is: :class:`AccessEvent` (one module call touching parameters) and :class:`StepProfile`
(the events, parameter table, activation and compute figures), with the canonical parameter order both the profiler
and the chunk packing use (:func:`canonical_parameters`). Recorded by :func:`~hf_elixir.profiler._step.profile_step`
(the module docstring of ``_step.py`` says how)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from torch import nn

__all__ = ["AccessEvent", "StepProfile", "canonical_parameters"]

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def canonical_parameters(model: nn.Module) -> tuple[list[str], dict[int, int], list[nn.Parameter]]:
    """Canonical parameter names: the first FQN of each parameter in
    ``model.named_parameters(remove_duplicate=False)`` order (tied parameters once).

    Returns:
        ``(names, index_of_id, params)``: names in registration order, a map ``id(param) -> index``
        covering every alias, and the parameters themselves.
    """
    names: list[str] = []
    params: list[nn.Parameter] = []
    index_of_id: dict[int, int] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in index_of_id:
            index_of_id[id(param)] = len(names)
            names.append(name)
            params.append(param)
    return names, index_of_id, params


@dataclass
class AccessEvent:
    """One module call that uses parameters.

    Attributes:
        phase: ``"fwd"`` or ``"bwd"``.
        module: FQN of the module (``""`` for the root).
        params: indices into :attr:`StepProfile.param_names` this call uses.
        compute_s: measured seconds from this event to the next one (``None`` on meta).
        flops: floating-point operations from this event to the next one (0 unless counted).
        grad_inputs: ``"bwd"`` events: whether the module's forward call had a tensor input that requires
            grad. The runtime then releases the backward access when the input gradients exist; without one,
            once the unit's trainable parameters have their gradients, leaving its frozen parameters in
            ``COMPUTE`` until the end of backward ([Note: dead chunks] in ``hf_elixir/chunk/_eviction.py``).
            ``True`` in profiles saved before it was recorded.
    """

    phase: str
    module: str
    params: list[int]
    compute_s: float | None = None
    flops: float = 0.0
    grad_inputs: bool = True


@dataclass
class StepProfile:
    """What one training step of a model does, as seen by the chunk manager.

    Attributes:
        model_type: ``model.config.model_type`` (``""`` if the model has no HF config).
        param_names: canonical parameter names (tied parameters once), in first-use order; parameters
            the step never touched come last, in registration order.
        param_numels: element count of each parameter (same order).
        param_requires_grad: whether each parameter is trained.
        events: every access, forward then backward (see :class:`AccessEvent`).
        grad_ready_event: per parameter, the index into ``events`` after which its gradient is complete
            (``-1``: no gradient this step).
        module_activation_bytes: module FQN -> bytes saved for backward while it was the innermost
            module running (exclusive of children).
        block_activation_bytes: FQN of each repeated block (a child of an ``nn.ModuleList``) -> bytes
            saved inside it (inclusive); used to model activation checkpointing.
        block_input_bytes: block FQN -> bytes of its tensor inputs (what checkpointing keeps).
        activation_peak_bytes: bytes saved for backward at the end of forward plus the largest single
            output (the transient on top of it).
        forward_s / backward_s: measured wall time of the traced step (``None`` on meta).
        plain_forward_s / plain_backward_s: fastest wall time of untraced warm-up steps (``None`` on meta
            or without warm-up); the tracer's own hooks slow the traced step down, so the cost model
            rescales the per-event times to these.
        forward_flops / backward_flops: counted FLOPs.
        activation_dtype_bytes: element size of the activations profiled (to rescale for other precisions).
        device: ``"cpu"``, ``"cuda"`` or ``"meta"``; ``static`` marks a trace built without running.
        param_modules: FQNs of every module that owns parameters directly (tied aliases included), in
            ``named_modules`` order: the keys of ``ElixirPlan.placements`` (empty in profiles saved before
            it was recorded).
        subtree_units: the model has access units over a subtree (MoE expert containers,
            ``nn.MultiheadAttention``), whose all-gathers the chunk manager never issues ahead.
        forward_only: an inference step ([Note: forward-only step]): forward events only, nothing trained,
            nothing saved for backward.
        moe_layers: each MoE layer's expert container ([Note: MoE layers in a profile] in ``_expert_flops.py``).
        tokens: tokens in the sample batch (numel of ``input_ids``, or of the first tensor); 0 in profiles saved
            before it was recorded.
        hidden_size: the model config's ``hidden_size`` (``d_model``; 0 without one). With ``tokens`` they size
            the activations tensor-parallel collectives move (``hf_elixir/search/_tensor_parallel.py``).
    """

    model_type: str = ""
    param_names: list[str] = field(default_factory=list)
    param_numels: list[int] = field(default_factory=list)
    param_requires_grad: list[bool] = field(default_factory=list)
    events: list[AccessEvent] = field(default_factory=list)
    grad_ready_event: list[int] = field(default_factory=list)
    module_activation_bytes: dict[str, int] = field(default_factory=dict)
    block_activation_bytes: dict[str, int] = field(default_factory=dict)
    block_input_bytes: dict[str, int] = field(default_factory=dict)
    activation_peak_bytes: int = 0
    forward_s: float | None = None
    backward_s: float | None = None
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    activation_dtype_bytes: int = 4
    device: str = "cpu"
    static: bool = False
    plain_forward_s: float | None = None
    plain_backward_s: float | None = None
    param_modules: list[str] = field(default_factory=list)
    subtree_units: bool = False
    forward_only: bool = False
    moe_layers: dict[str, dict[str, int]] = field(default_factory=dict)
    tokens: int = 0
    hidden_size: int = 0

    @property
    def num_params(self) -> int:
        """Total parameter elements (tied parameters once)."""
        return sum(self.param_numels)

    @property
    def largest_param_numel(self) -> int:
        return max(self.param_numels, default=0)

    def model_data_bytes(self, precision: str, world_size: int = 1) -> dict[str, int]:
        """Model-data bytes per rank for ``precision`` (``"fp32" | "bf16" | "fp16"``).

        Returns a dict with ``params`` (compute copy), ``grads`` (fp32 gradient shards),
        ``optimizer`` (Adam: two fp32 moments, plus an fp32 master copy for low precisions) and
        ``total``; each divided by ``world_size`` (ZeRO-3 shards everything).

        Raises:
            ValueError: unknown precision.
        """
        if precision not in _DTYPE_BYTES:
            raise ValueError(f"precision={precision!r} must be one of {tuple(_DTYPE_BYTES)}")
        numel = self.num_params
        trained = sum(n for n, g in zip(self.param_numels, self.param_requires_grad) if g)
        params = numel * _DTYPE_BYTES[precision]
        grads = trained * 4
        optim = trained * (8 + (0 if precision == "fp32" else 4))
        out = {"params": params // world_size, "grads": grads // world_size, "optimizer": optim // world_size}
        out["total"] = sum(out.values())
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "StepProfile":
        values = dict(values)
        values["events"] = [AccessEvent(**e) for e in values.get("events", [])]
        return cls(**values)
