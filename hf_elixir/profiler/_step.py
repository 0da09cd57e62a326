"""One-step tracer: parameter access order, activation memory and compute per access.

:func:`profile_step` runs one forward and one backward pass of a model on a sample batch (with
``forward_only=True``, an inference step: one forward under ``torch.no_grad()``, see
[Note: forward-only step]) and records, as a list of :class:`AccessEvent`, every module call that
touches parameters, in the order the chunk manager will see them:

* forward: a module forward pre-hook fires before the module uses its own (``recurse=False``)
  parameters;
* backward: a hook on the module's forward *outputs* (``torch.autograd.graph.register_multi_grad_hook``
  with ``mode="any"``) fires when the first output gradient is ready, i.e. right before the module's
  backward uses its parameters again (the same trick PyTorch FSDP2 uses for its pre-backward);
* ``Tensor.register_post_accumulate_grad_hook`` on each parameter tells when its gradient is complete
  (the last firing wins: tied parameters accumulate twice).

Each event carries the compute that follows it until the next event: measured seconds when run for
real, FLOPs (``torch.utils.flop_counter``) always. Activation memory is the bytes of tensors autograd
saves for backward (``torch.autograd.graph.saved_tensors_hooks``), excluding parameters, counted once
per tensor, and attributed to the innermost module running.

On the meta device (``accelerate.init_empty_weights()``) nothing is materialised and no time is
measured; FLOPs still are, so the cost model can turn them into seconds with a measured throughput.

[Note: forward-only step] A model prepared without an optimizer (``hf_elixir.prepare(model, None, ...)``)
runs forwards under ``torch.no_grad()`` (evaluation, ``generate``): its hooks unshard for the forward
only, no gradient buffer or optimizer state exists, and autograd saves nothing. ``profile_step(...,
forward_only=True)`` profiles that step: the model in eval mode, one forward under ``torch.no_grad()``, no
loss (the batch needs no labels) and no backward. The profile has only ``"fwd"`` events, trains no
parameter (``param_requires_grad`` all ``False``, ``grad_ready_event`` all ``-1``), saves no activation
(``block_activation_bytes`` all 0), and its ``activation_peak_bytes`` is the largest single output: the
forward's transient. ``StepProfile.forward_only`` marks it; the cost model prices it as the runtime runs it
(``hf_elixir/search/_cost.py``, [Note: forward-only pricing]).

Source: PatrickStar (arXiv 2108.05818) section 5 (warm-up iteration trace), Elixir (arXiv 2212.05339)
section 5.2 (profiling the first step); FSDP2 ``_register_pre_backward_hook`` for the backward hook.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from hf_elixir.profiler._expert_flops import _hidden_size, moe_layers, record_moe_layers

__all__ = ["AccessEvent", "NoLossError", "StepProfile", "canonical_parameters", "profile_step", "static_profile"]

logger = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------------------------
def _tensors_in(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """Flatten tensors out of (nested) tuples, lists, dicts and HF ``ModelOutput`` objects."""
    if depth > 6:
        return out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _tensors_in(value, out, depth + 1)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            _tensors_in(value, out, depth + 1)
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _param_module_names(model: nn.Module) -> list[str]:
    """FQNs of the modules that own parameters directly (``named_modules`` order)."""
    return [fqn for fqn, mod in model.named_modules() if any(True for _ in mod.parameters(recurse=False))]


def _block_names(model: nn.Module) -> set[str]:
    """FQNs of the children of every ``nn.ModuleList`` (transformer blocks, experts)."""
    blocks: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for child_name, _ in module.named_children():
                blocks.add(f"{name}.{child_name}" if name else child_name)
    return blocks


class _Tracer:
    """Installs the hooks, collects events; removed by :meth:`close`."""

    def __init__(self, model: nn.Module, timed: bool, count_flops: bool) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.model = model
        self.timed = timed
        self.names, self.index_of_id, self.params = canonical_parameters(model)
        self.events: list[AccessEvent] = []
        self.event_start_s: list[float] = []
        self.event_start_flops: list[float] = []
        self.grad_ready_event = [-1] * len(self.params)
        self.module_act: dict[str, int] = {}
        self.block_act: dict[str, int] = {}
        self.block_in: dict[str, int] = {}
        self.blocks = _block_names(model)
        self.stack: list[str] = []
        self.saved_keys: set[int] = set()
        self.saved_refs: list[torch.Tensor] = []
        self.saved_total = 0
        self.largest_output = 0
        self.phase = "fwd"
        self.call_grad_inputs: dict[str, bool] = {}  # module -> its running forward call had a grad input
        # FlopCounterMode dispatches every op through Python (~20x slower on small models): only when asked
        self.flop_counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
        self.handles: list[Any] = []
        self.param_ids = {id(p) for p in self.params}
        for name, module, own, bwd_access in _access_units(model, self.index_of_id):
            self.handles.append(module.register_forward_pre_hook(self._pre_forward(name, own), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post_forward(name, own, bwd_access),
                                                             with_kwargs=True))
        for index, param in enumerate(self.params):
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._grad_ready(index)))

    def _flops_now(self) -> float:
        counter = self.flop_counter
        return float(counter.get_total_flops()) if hasattr(counter, "get_total_flops") else 0.0

    def _record(self, phase: str, module: str, own: list[int], grad_inputs: bool = True) -> None:
        self.events.append(AccessEvent(phase=phase, module=module, params=list(own), grad_inputs=grad_inputs))
        self.event_start_s.append(time.perf_counter() if self.timed else 0.0)
        self.event_start_flops.append(self._flops_now())

    def _pre_forward(self, name: str, own: list[int]) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.stack.append(name)
            if name in self.blocks:
                self.block_in[name] = sum(_nbytes(t) for t in _tensors_in((args, kwargs), []))
                self.block_act.setdefault(name, 0)
            if own and self.phase == "fwd":  # as ModuleHandle.pre_forward decides bwd_pins / grad_pins
                self.call_grad_inputs[name] = any(t.requires_grad for t in _tensors_in((args, kwargs), []))
            if own:
                # inside backward this is a recompute (activation checkpointing): a forward access
                self._record("fwd" if self.phase == "fwd" else "bwd", name, own)
        return hook

    def _post_forward(self, name: str, own: list[int], bwd_access: bool = True) -> Callable:
        bwd_params = own if bwd_access else []

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            outputs = _tensors_in(output, [])
            if outputs:
                self.largest_output = max(self.largest_output, max(_nbytes(t) for t in outputs))
            if not own or self.phase != "fwd":
                return
            needing = [t for t in outputs if t.requires_grad]
            grad_inputs = self.call_grad_inputs.pop(name, True)
            if needing:
                torch.autograd.graph.register_multi_grad_hook(
                    needing, lambda grads: self._record("bwd", name, bwd_params, grad_inputs), mode="any")
        return hook

    def _grad_ready(self, index: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            self.grad_ready_event[index] = len(self.events) - 1
        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in self.param_ids or id(tensor) in self.param_ids or isinstance(tensor, nn.Parameter):
            return tensor
        key = id(base)
        if key not in self.saved_keys and self.phase == "fwd":
            self.saved_keys.add(key)
            self.saved_refs.append(base)  # keeps ids unique while the step runs
            size = _nbytes(tensor)
            self.saved_total += size
            owner = self.stack[-1] if self.stack else ""
            self.module_act[owner] = self.module_act.get(owner, 0) + size
            for block in self.stack:
                if block in self.blocks:
                    self.block_act[block] = self.block_act.get(block, 0) + size
        return tensor

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.saved_refs.clear()


def _access_units(model: nn.Module, index_of_id: dict[int, int]):
    """Yield ``(name, module, param indices, unshards for backward)`` for every module the chunk manager
    hooks: modules with direct parameters, except that ``nn.MultiheadAttention`` and MoE expert
    containers are one unit over their subtree (the same rule as ``hf_elixir.runtime.hooks``), and an
    ``nn.Embedding``'s backward does not access its weight (its event carries no parameters)."""
    from hf_elixir.runtime.hooks import _SUBTREE_UNITS, _is_routing_container  # noqa: PLC0415

    covered: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in covered:
            continue
        if isinstance(module, _SUBTREE_UNITS) or _is_routing_container(module):
            params = list(module.parameters())
            covered.update(id(m) for m in module.modules())
        else:
            params = list(module.parameters(recurse=False))
        own: list[int] = []
        for p in params:
            if id(p) in index_of_id and index_of_id[id(p)] not in own:
                own.append(index_of_id[id(p)])
        yield name, module, own, not isinstance(module, nn.Embedding)


def _has_subtree_units(model: nn.Module) -> bool:
    """Whether some access unit covers a subtree (MoE expert containers, ``nn.MultiheadAttention``; see
    :func:`_access_units`): the chunk manager then keeps every all-gather in the hooks ([Note: gather
    prefetch] in ``hf_elixir/chunk/_prefetch.py``)."""
    from hf_elixir.runtime.hooks import _SUBTREE_UNITS, _is_routing_container  # noqa: PLC0415

    return any(isinstance(m, _SUBTREE_UNITS) or _is_routing_container(m) for m in model.modules()
               if any(True for _ in m.parameters()))


class NoLossError(ValueError):
    """The profiled model's output holds no loss (no ``.loss``, no ``"loss"`` key, not a tensor): the integrations,
    which cannot take a ``loss_fn``, turn it into their own message."""


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor):
        loss = output.float().mean() if output.dim() else output
    if loss is None:
        raise NoLossError(
            "profile_step could not find a loss in the model output; pass labels in sample_batch "
            "or give loss_fn=callable(output) -> scalar tensor"
        )
    return loss


@contextlib.contextmanager
def _meta_nonzero_assumption(enabled: bool):
    """MoE routers call ``nonzero`` (data-dependent); on meta assume every element is non-zero."""
    if not enabled:
        yield
        return
    try:
        from torch.fx.experimental import _config as fx_config
    except ImportError:  # pragma: no cover - older torch
        yield
        return
    old = getattr(fx_config, "meta_nonzero_assume_all_nonzero", None)
    if old is None:
        yield
        return
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = old


def _call(model: nn.Module, sample_batch: Any) -> Any:
    if isinstance(sample_batch, Mapping):
        return model(**sample_batch)
    if isinstance(sample_batch, tuple):
        return model(*sample_batch)
    return model(sample_batch)


def _run_untraced(model: nn.Module, sample_batch: Any, loss_fn: Callable | None,
                  sync: Callable[[], None] = lambda: None, forward_only: bool = False) -> tuple[float, float]:
    """One plain forward + backward (``forward_only``: one forward under ``torch.no_grad()``, backward 0 s);
    returns its (forward, backward) wall seconds."""
    sync()
    start = time.perf_counter()
    if forward_only:
        with torch.no_grad():
            _call(model, sample_batch)
        sync()
        return time.perf_counter() - start, 0.0
    loss = (loss_fn or _default_loss)(_call(model, sample_batch))
    sync()
    mid = time.perf_counter()
    loss.backward()
    sync()
    end = time.perf_counter()
    for param in model.parameters():
        param.grad = None
    return mid - start, end - mid


def profile_step(model: nn.Module, sample_batch: Mapping[str, Any] | tuple | torch.Tensor, *,
                 device: str = "cpu", loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 static_fallback: bool = True, warmup_steps: int = 1,
                 count_flops: bool | None = None, repeats: int = 1, forward_only: bool = False) -> StepProfile:
    """Run one forward + backward of ``model`` on ``sample_batch`` (``forward_only``: one forward under
    ``torch.no_grad()``) and record what it touches.

    Args:
        model: any ``nn.Module``; a Hugging Face ``PreTrainedModel`` returning ``.loss`` works as is.
            Its parameters must already be on ``device`` (``"meta"``: built under
            ``accelerate.init_empty_weights()``). Gradients it accumulates are cleared afterwards.
        sample_batch: keyword arguments (dict), positional arguments (tuple) or one tensor; tensors on
            the model's device (on meta: meta tensors of the right shape and dtype).
        device: ``"cpu"``, ``"cuda"`` or ``"meta"``; on meta no time is measured.
        loss_fn: turns the model output into a scalar loss; default: ``output.loss``.
        static_fallback: on meta, if the model cannot run (data-dependent ops), build a static trace
            with :func:`static_profile` instead of raising.
        warmup_steps: untraced forward+backward passes run first when timing for real (first calls
            pay one-off allocation and dispatch costs that would skew the per-event times).
        count_flops: count FLOPs per event (``torch.utils.flop_counter.FlopCounterMode``); default only on
            meta. When timing for real, the FLOPs come from one extra traced step run after the timed ones
            (the counter dispatches every op through Python, which would spoil the measured times). Needed
            when the step is priced on another device than the one it was profiled on (a model still on
            the CPU, a hardware profile of a GPU): the cost model then turns FLOPs into seconds with the
            device's rate (see ``hf_elixir.search._cost._event_seconds``).
        repeats: traced steps to run when timing for real; the fastest one's times are kept (a
            busy machine makes single timings noisy).
        forward_only: profile an inference step ([Note: forward-only step]): the model in eval mode, one
            forward under ``torch.no_grad()``, no loss (``loss_fn`` unused; the batch need not carry labels)
            and no backward (``backward_s`` 0 when timed).

    Returns:
        :class:`StepProfile` (``forward_only`` as asked).

    Raises:
        ValueError: ``device`` is not one of the three, or no loss can be found (not with ``forward_only``).
    """
    if device not in ("cpu", "cuda", "meta"):
        raise ValueError(f"profile_step(device={device!r}) must be 'cpu', 'cuda' or 'meta'")
    timed = device != "meta"
    was_training = model.training
    model.train(not forward_only)  # inference runs in eval mode (dropout off), as evaluation and generate do
    try:
        plain: tuple[float, float] | None = None
        if timed:
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            for i in range(max(0, warmup_steps) + (max(1, repeats) if warmup_steps > 0 else 0)):
                times = _run_untraced(model, sample_batch, loss_fn, sync, forward_only)
                if i >= 1 and (plain is None or sum(times) < sum(plain)):
                    plain = times  # the first call pays one-off costs
        best: StepProfile | None = None
        runs: list[StepProfile] = []
        for _ in range(max(1, repeats) if timed else 1):
            result = _profile_once(model, sample_batch, device, loss_fn, static_fallback,
                                   False if timed else count_flops, forward_only)
            runs.append(result)
            if best is None or (result.forward_s or 0) + (result.backward_s or 0) < \
                    (best.forward_s or 0) + (best.backward_s or 0):
                best = result
        # a busy machine spikes single events: keep each event's fastest time over the repeats
        if timed and len(runs) > 1 and all([e.module for e in r.events] == [e.module for e in best.events]
                                           for r in runs):
            for i, event in enumerate(best.events):
                event.compute_s = min(r.events[i].compute_s or 0.0 for r in runs)
        if timed and count_flops and best is not None:
            counted = _profile_once(model, sample_batch, device, loss_fn, static_fallback, True, forward_only)
            _copy_flops(counted, best)
    finally:
        model.train(was_training)
    assert best is not None
    if plain is not None:
        best.plain_forward_s, best.plain_backward_s = plain
    return best


def _copy_flops(counted: StepProfile, timed: StepProfile) -> None:
    """Give ``timed`` the FLOPs of ``counted`` (the same step traced again under the FLOP counter): event by
    event where both traces visit the same modules, else spread each phase's total over its events in
    proportion to their measured seconds (a data-dependent model may take another path)."""
    timed.forward_flops, timed.backward_flops = counted.forward_flops, counted.backward_flops
    if [(e.phase, e.module) for e in counted.events] == [(e.phase, e.module) for e in timed.events]:
        for mine, theirs in zip(timed.events, counted.events):
            mine.flops = theirs.flops
        return
    logger.warning("profile_step: the FLOP-counting pass visited other modules than the timed one; FLOPs are "
                   "spread over the timed events in proportion to their measured time")
    for phase, total in (("fwd", counted.forward_flops), ("bwd", counted.backward_flops)):
        events = [e for e in timed.events if e.phase == phase]
        seconds = sum(e.compute_s or 0.0 for e in events)
        for e in events:
            e.flops = total * ((e.compute_s or 0.0) / seconds if seconds else 1.0 / len(events))


def _profile_once(model: nn.Module, sample_batch: Any, device: str, loss_fn: Callable | None,
                  static_fallback: bool, count_flops: bool | None, forward_only: bool = False) -> StepProfile:
    timed = device != "meta"
    if count_flops is None:
        count_flops = device == "meta"
    tracer = _Tracer(model, timed, count_flops)
    fwd_s = bwd_s = None
    try:
        with _meta_nonzero_assumption(device == "meta"), tracer.flop_counter, \
                torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t), \
                (torch.no_grad() if forward_only else contextlib.nullcontext()):
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            output = _call(model, sample_batch)
            loss = None if forward_only else (loss_fn or _default_loss)(output)
            sync()
            mid = time.perf_counter()
            fwd_end_flops = tracer._flops_now()
            forward_events = len(tracer.events)
            tracer.phase = "bwd"
            tracer.saved_refs.clear()
            if loss is not None:
                loss.backward()
            sync()
            end = time.perf_counter()
            end_flops = tracer._flops_now()
        if timed:
            fwd_s, bwd_s = mid - start, (0.0 if forward_only else end - mid)
    except Exception as exc:  # noqa: BLE001 - meta runs fail in many data-dependent ways
        tracer.close()
        if device == "meta" and static_fallback:
            logger.warning("profile_step on meta failed (%s); using a static trace from module order", exc)
            return static_profile(model, sample_batch, forward_only=forward_only)
        raise
    finally:
        tracer.close()
        for param in tracer.params:
            param.grad = None

    # compute attributed to each event: until the next event (or the end of its phase)
    events = tracer.events
    for i, event in enumerate(events):
        if i + 1 < len(events) and not (i + 1 == forward_events):
            next_flops, next_s = tracer.event_start_flops[i + 1], tracer.event_start_s[i + 1]
        else:
            next_flops = fwd_end_flops if i < forward_events else end_flops
            next_s = mid if i < forward_events else end
        event.flops = max(0.0, next_flops - tracer.event_start_flops[i])
        if timed:
            event.compute_s = max(0.0, next_s - tracer.event_start_s[i])
    # compute before the first event of each phase belongs to that first event
    if events and timed:
        events[0].compute_s += max(0.0, tracer.event_start_s[0] - start)
        if forward_events < len(events):
            events[forward_events].compute_s += max(0.0, tracer.event_start_s[forward_events] - mid)

    order: list[int] = []
    seen: set[int] = set()
    for event in events:
        for index in event.params:
            if index not in seen:
                seen.add(index)
                order.append(index)
    order += [i for i in range(len(tracer.params)) if i not in seen]
    position = {old: new for new, old in enumerate(order)}
    for event in events:
        event.params = [position[i] for i in event.params]
    act_dtype = 4
    if (tracer.saved_total or forward_only) and tracer.params:  # forward only: the outputs' dtype
        act_dtype = tracer.params[0].element_size() if tracer.params[0].is_floating_point() else 4
    profile = StepProfile(
        param_modules=_param_module_names(model),
        subtree_units=_has_subtree_units(model),
        model_type=str(getattr(getattr(model, "config", None), "model_type", "") or ""),
        param_names=[tracer.names[i] for i in order],
        param_numels=[tracer.params[i].numel() for i in order],
        param_requires_grad=[bool(tracer.params[i].requires_grad) and not forward_only for i in order],
        events=events,
        grad_ready_event=[tracer.grad_ready_event[i] for i in order],
        module_activation_bytes=tracer.module_act,
        block_activation_bytes=tracer.block_act,
        block_input_bytes=tracer.block_in,
        activation_peak_bytes=tracer.saved_total + tracer.largest_output,
        forward_s=fwd_s,
        backward_s=bwd_s,
        forward_flops=fwd_end_flops,
        backward_flops=end_flops - fwd_end_flops,
        activation_dtype_bytes=act_dtype,
        device=device,
        forward_only=forward_only,
    )
    tensors = _tensors_in(sample_batch, [])  # [Note: MoE layers in a profile] and [Note: meta expert FLOPs]
    record_moe_layers(model, profile, tensors[0].numel() if tensors else 1, meta_flops=count_flops and device == "meta")
    profile.tokens, profile.hidden_size = (tensors[0].numel() if tensors else 1), _hidden_size(model)
    return profile


def static_profile(model: nn.Module, sample_batch: Any = None, *, tokens: int | None = None,
                   forward_only: bool = False) -> StepProfile:
    """A trace built without running the model: forward = modules with parameters in registration
    order, backward = the reverse; FLOPs = 2 (forward) and 4 (backward) per parameter element per
    token; activations = 34 * hidden bytes per token per block (Korthikanti et al. 2022, fp32
    scaled by the parameter element size). Used when the model cannot run on meta.

    Args:
        model: the model (any device).
        sample_batch: used only to count tokens (numel of ``input_ids`` or the first tensor).
        tokens: overrides the token count.
        forward_only: an inference trace ([Note: forward-only step]): the forward only, nothing trained,
            nothing saved; the activation peak is one block's 34 * hidden bytes per token (the transient).
    """
    names, index_of_id, params = canonical_parameters(model)
    if tokens is None:
        tensors = _tensors_in(sample_batch, []) if sample_batch is not None else []
        tokens = tensors[0].numel() if tensors else 1
    fwd: list[AccessEvent] = []
    bwd_access: dict[str, bool] = {}
    for name, module, own, accessed in _access_units(model, index_of_id):
        if own:
            flops = 2.0 * tokens * sum(params[i].numel() for i in own)
            fwd.append(AccessEvent(phase="fwd", module=name, params=own, flops=flops))
            bwd_access[name] = accessed
    bwd = [AccessEvent(phase="bwd", module=e.module, params=list(e.params) if bwd_access[e.module] else [],
                       flops=2 * e.flops) for e in reversed(fwd)]
    events = fwd if forward_only else fwd + bwd
    ready = [-1] * len(params)
    for i, event in enumerate(events):
        if event.phase == "bwd":
            for index in fwd[len(events) - 1 - i].params:  # the mirrored forward event's parameters
                if params[index].requires_grad:
                    ready[index] = i
    order: list[int] = []
    for event in fwd:
        order += [i for i in event.params if i not in order]
    order += [i for i in range(len(params)) if i not in order]
    position = {old: new for new, old in enumerate(order)}
    for event in events:
        event.params = [position[i] for i in event.params]
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "d_model", 0) or 0)
    blocks = sorted(_block_names(model))
    elem = params[0].element_size() if params else 4
    per_block = 34 * hidden * tokens * elem // 2
    return StepProfile(
        param_modules=_param_module_names(model),
        subtree_units=_has_subtree_units(model),
        model_type=str(getattr(config, "model_type", "") or ""),
        param_names=[names[i] for i in order],
        param_numels=[params[i].numel() for i in order],
        param_requires_grad=[bool(params[i].requires_grad) and not forward_only for i in order],
        events=events,
        grad_ready_event=[ready[i] for i in order],
        block_activation_bytes={b: 0 if forward_only else per_block for b in blocks},
        block_input_bytes={b: hidden * tokens * elem for b in blocks},
        activation_peak_bytes=per_block * (1 if forward_only else len(blocks)),
        forward_flops=sum(e.flops for e in fwd),
        backward_flops=0.0 if forward_only else sum(e.flops for e in bwd),
        activation_dtype_bytes=elem,
        device="meta",
        static=True,
        forward_only=forward_only,
        moe_layers=moe_layers(model, tokens),
        tokens=int(tokens),
        hidden_size=hidden,
    )
