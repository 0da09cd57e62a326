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
from typing import Any, Callable, Mapping

import torch
from torch import nn

from hf_elixir.profiler._expert_flops import _hidden_size, moe_layers, record_moe_layers
# the profile's types and the tracer live in their own files; importable from here as before
from hf_elixir.profiler._step_profile import AccessEvent, StepProfile, canonical_parameters
from hf_elixir.profiler._tracer import (_Tracer, _access_units, _block_names, _has_subtree_units,
                                        _param_module_names, _tensors_in)

__all__ = ["AccessEvent", "NoLossError", "StepProfile", "canonical_parameters", "profile_step", "static_profile"]

logger = logging.getLogger(__name__)


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
