"""Block-wise activation policy: per transformer block, keep, recompute or offload what autograd saves.

The blocks are the outermost children of the model's ``nn.ModuleList`` s (GPT-2's ``transformer.h.<i>``,
OPT's ``model.decoder.layers.<i>``, Switch's ``encoder.block.<i>``), the same blocks the profiler measures
(``StepProfile.block_activation_bytes``) and the search prices. Each gets one of:

* ``"keep"``: nothing changes; the block's saved tensors stay on the device until its backward.
* ``"recompute"``: activation checkpointing of that block only (non-reentrant
  ``torch.utils.checkpoint.checkpoint``): only its inputs are kept, its forward re-runs inside backward (the
  chunk hooks of its submodules unshard again there, see ``runtime/hooks.py``). Hugging Face blocks
  (``transformers.modeling_layers.GradientCheckpointingLayer``) use their own per-layer switch, which also
  turns off the KV cache for the replay; other blocks get their ``forward`` wrapped on the instance.
* ``"offload"``: the block's saved tensors are copied to host memory as autograd saves them
  (``torch.autograd.graph.saved_tensors_hooks`` entered by the block's forward pre-hook, left by its forward
  hook) and copied back when its backward first needs one of them (:class:`_OffloadedBlock`).

[Note: activation offload] What the runtime does, and what the cost model (``search/_activation_cost.py``,
[Note: activation policy]) prices:

* forward: each saved device tensor (not a chunk's storage: parameters are re-gathered, not offloaded) is
  copied into a new host tensor registered as host memory (``strict.register_host``) inside
  ``strict.host_copies()``, so strict mode accepts it, and counted in ``d2h_bytes``. On CUDA the copy is
  non-blocking into pinned memory on the manager's activation stream, after that stream waits for the
  compute stream; the device tensor is ``record_stream``-ed there so its memory is not reused before the
  copy ends. Compute goes on: the copy overlaps the rest of the forward. Off CUDA it is the same
  non-blocking copy into a host buffer (synchronous there; nothing waits for a device, so it is no host sync).
* backward: *all* of a block call's tensors come back in one batch (``h2d_bytes``), either ahead of its
  backward ([Note: activation onload ahead]) or at the first unpack of any of them, when the compute stream
  waits for the copies on the activation stream (``num_blocking_act_onloads``). Each restored tensor is
  charged to the pool's activation bytes while it lives (``ChunkManager._pack_saved``), and handed to
  autograd without a reference kept here, so it dies with the backward node that uses it. A second backward
  through a retained graph copies again from the host copy, which lives as long as autograd's packed handle.
* the activation accounting (``ChunkManager.saved_tensors_accounting``) never sees the offloaded tensors:
  their bytes leave the device at pack time. Tensors the hook does not offload go to the enclosing context
  (the accounting), which charges them as before.

[Note: activation onload ahead] (the prefetch of FSDP2's and ProTrain's swapping.) When the
backward of an offloaded block call first unpacks a tensor, the copies of the call made just before it in
forward (the next backward in line, by :class:`_CallOrder`) start at once: on CUDA on the activation stream,
after it waited for the compute stream, with an event recorded after them that the first unpack of that call
waits on (then ``record_stream`` of the restored tensors on the compute stream), so the copies overlap this
block's backward; off CUDA the copies run then, on the compute thread, and the later unpack finds them done
(``num_prefetched_act_onloads``). Both calls' tensors are on the device meanwhile (the peak the cost model
prices is one block more of restored activations). With a budget that covers activations the copies ahead
go only into free room (no chunk is evicted for them: that would be a rank-local eviction ahead of need);
otherwise the call comes back at its first unpack as before. The decision touches no collective.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch

from hf_elixir._logging import info_on_main_rank
from hf_elixir.chunk import strict
from hf_elixir.chunk._activations import _active_saved_tensors_hooks
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.config import ElixirConfig
from hf_elixir.plan import ACTIVATION_POLICIES, ElixirPlan

__all__ = ["ACTIVATION_POLICIES", "apply_activation_policy", "enable_activation_checkpointing", "hf_checkpointing_off",
           "install_activation_policy", "model_activation_policy", "outermost", "resolve_activation_policy",
           "transformer_blocks"]

logger = logging.getLogger(__name__)


def outermost(names) -> list[str]:
    """The names in ``names`` not nested in another one (``"a.0"`` is dropped when ``"a"`` is there), in
    their given order."""
    names = list(names)
    chosen = set(names)
    return [n for n in names if not any(n.startswith(o + ".") for o in chosen if o != n)]


def transformer_blocks(model: torch.nn.Module) -> list[str]:
    """FQNs of the outermost children of every ``nn.ModuleList`` in ``model`` (its transformer blocks), in
    ``named_modules`` order (the forward order of stock Hugging Face models)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            for child_name, _ in module.named_children():
                found.append(f"{name}.{child_name}" if name else child_name)
    return outermost(found)


def resolve_activation_policy(blocks: list[str], plan_policy: dict[str, str], checkpointing: bool,
                              user_policy=None, already_recomputed: frozenset[str] = frozenset()) -> dict[str, str]:
    """Every block's policy: the user's (``ElixirConfig.activation_policy``: one policy for every block, or a
    mapping of block-FQN globs to policies, the first matching glob wins) over the plan's
    (``ElixirPlan.activation_policy``) over the plan's uniform switch (``activation_checkpointing``: True
    means ``"recompute"``, False ``"keep"``) over the model's own (``already_recomputed``: blocks whose
    Hugging Face ``gradient_checkpointing`` the user switched on before ``prepare``).

    Raises:
        ValueError: a plan entry or a user glob names no block of the model (naming it and the blocks).
    """
    import fnmatch  # noqa: PLC0415

    unknown = [b for b in plan_policy if b not in blocks]
    if unknown:
        raise ValueError(f"ElixirPlan.activation_policy names blocks this model lacks: {unknown[:5]}; its blocks are "
                         f"{_short(blocks)}. Re-run the search for this model or fix the plan")
    out = {b: plan_policy.get(b, "recompute" if checkpointing or b in already_recomputed else "keep")
           for b in blocks}
    if user_policy is None:
        return out
    if isinstance(user_policy, str):
        return {b: user_policy for b in blocks}
    for pattern in user_policy:
        if not any(fnmatch.fnmatchcase(b, pattern) for b in blocks):
            raise ValueError(f"ElixirConfig.activation_policy[{pattern!r}] matches no block of this model; its "
                             f"blocks are {_short(blocks)} (globs such as 'transformer.h.*' work)")
    for b in blocks:
        for pattern, policy in user_policy.items():
            if fnmatch.fnmatchcase(b, pattern):
                out[b] = policy
                break
    return out


def _short(names: list[str]) -> str:
    return f"{names[:4]}{f' ... {names[-1]!r} ({len(names)} in all)' if len(names) > 4 else ''}" if names else "none"


# -- recompute -------------------------------------------------------------------------------------
def _checkpoint(function, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _enable_recompute(block: torch.nn.Module) -> None:
    """Activation checkpointing of ``block`` alone (instance attributes only: ``prepare``'s snapshot undoes
    them, [Note: all-or-nothing prepare])."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: PLC0415
    except ImportError:  # pragma: no cover - transformers is a dependency
        GradientCheckpointingLayer = ()
    if isinstance(block, GradientCheckpointingLayer):
        if block.gradient_checkpointing:
            return  # the user's own gradient_checkpointing_enable() already recomputes it: leave their function
        block.gradient_checkpointing = True  # the HF per-layer switch; it also drops the KV cache for the replay
        block._gradient_checkpointing_func = _checkpoint
        return
    forward = block.forward  # the bound method of the class

    @functools.wraps(forward)
    def forward_with_recompute(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return _checkpoint(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    block.forward = forward_with_recompute


# -- offload ---------------------------------------------------------------------------------------
class _Delegated:
    """A tensor the offload hook passed on to the enclosing saved-tensors context (its packed form)."""

    __slots__ = ("packed",)

    def __init__(self, packed) -> None:
        self.packed = packed


class _Offloaded:
    """One saved tensor: the host copy it comes back from (the whole device buffer, shared by every view of
    it the block saved, or a copy of this tensor alone), its ``(shape, stride, offset)`` in that copy, and
    ``slot``, its index among the block call's restored tensors."""

    __slots__ = ("host", "layout", "call", "slot", "__weakref__")

    def __init__(self, host: torch.Tensor, layout: tuple, call: "_BlockCall", slot: int) -> None:
        self.host, self.layout, self.call, self.slot = host, layout, call, slot


class _BlockCall:
    """The tensors one forward call of an offloaded block saved (weakly: autograd owns the handles).

    ``copies`` finds the host copy of a device buffer saved twice (two ops saving one tensor, or two views of
    it): keyed by the device storage, held weakly, so a freed buffer whose memory a new tensor reuses is never
    mistaken for it. ``started``: its backward has unpacked a tensor (it then onloads its predecessor ahead);
    ``ready_event``: on CUDA, recorded after the copies an onload ahead issued, waited by the first unpack."""

    def __init__(self) -> None:
        self.handles: list[weakref.ref] = []
        self.restored: dict[int, torch.Tensor] = {}
        self.copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.started = False
        self.ready_event = None


class _CallOrder:
    """The calls of every offloaded block of one model in forward order (weakly: a call lives as long as
    autograd holds one of its tensors), to find the call whose backward comes next ([Note: activation onload
    ahead])."""

    def __init__(self) -> None:
        self._calls: list[weakref.ref] = []

    def append(self, call: _BlockCall) -> None:
        self._calls = [r for r in self._calls if r() is not None]
        self._calls.append(weakref.ref(call))

    def previous(self, call: _BlockCall) -> _BlockCall | None:
        """The latest call made before ``call`` whose backward has not started, or ``None``."""
        live = [c for c in (r() for r in self._calls) if c is not None]
        if call not in live:
            return None
        for before in reversed(live[:live.index(call)]):
            if not before.started:
                return before
        return None


class _OffloadedBlock:
    """Saved-tensor hooks moving one block's activations to the host in forward and back in backward
    ([Note: activation offload], [Note: activation onload ahead])."""

    def __init__(self, name: str, manager: ChunkManager, stream, order: _CallOrder) -> None:
        self.name, self.manager, self.stream, self.order = name, manager, stream, order
        self._contexts: list = []  # one per call in flight (None: a call with nothing to offload)

    # forward pre-/post-hooks: enter and leave the saved-tensors context around the block's forward
    def enter(self, module, args) -> None:
        if not (torch.is_grad_enabled() and module.training):
            self._contexts.append(None)
            return
        outer = _active_saved_tensors_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
        call = _BlockCall()
        self.order.append(call)
        context = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, outer_pack, call), functools.partial(self._unpack, outer_unpack))
        context.__enter__()
        self._contexts.append(context)

    def leave(self, module, args, output) -> None:
        context = self._contexts.pop() if self._contexts else None
        if context is not None:
            context.__exit__(None, None, None)

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (tensor.device == self.manager.compute_device and tensor.layout == torch.strided
                and tensor.numel() > 0 and not isinstance(tensor, torch.nn.Parameter)
                and not strict.is_managed_device(tensor) and not strict.is_host(tensor))

    def _pack(self, outer_pack, call: _BlockCall, tensor: torch.Tensor):
        if not self._offloadable(tensor):
            return _Delegated(outer_pack(tensor))
        storage, itemsize = tensor.untyped_storage(), tensor.element_size()
        nbytes = tensor.numel() * itemsize
        # a view of a buffer not much larger than itself shares one copy of the whole buffer with the other
        # views saved from it; a small view of a large buffer is copied alone
        whole = storage.nbytes() <= 2 * nbytes and storage.nbytes() % itemsize == 0
        key = (tensor.dtype,) if whole else (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
                                             tensor.stride())
        known = call.copies.setdefault(storage, {})
        host = known.get(key)
        if host is None:
            with torch.no_grad():
                source = tensor.detach().as_strided((storage.nbytes() // itemsize,), (1,), 0) if whole else tensor
                host = known[key] = self._copy_out(source)
        layout = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset()) if whole else \
            (tuple(tensor.shape), host.stride(), 0)
        handle = _Offloaded(host, layout, call, len(call.handles))
        call.handles.append(weakref.ref(handle))
        return handle

    def _copy_out(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, counted in ``d2h_bytes`` ([Note: activation offload])."""
        if self.stream is not None:  # CUDA: pinned, non-blocking, on the activation stream
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self.stream):
                host = strict.register_host(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True))
                with strict.host_copies():
                    host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
        else:  # the same non-blocking copy (synchronous on the host; the host never waits for a device)
            host = strict.register_host(torch.empty(tensor.shape, dtype=tensor.dtype))
            with strict.host_copies():
                host.copy_(tensor, non_blocking=True)
        self.manager.counters.d2h_bytes += host.numel() * host.element_size()
        return host

    def _unpack(self, outer_unpack, packed):
        if isinstance(packed, _Delegated):
            return outer_unpack(packed.packed)
        call = packed.call
        if packed.slot not in call.restored:
            self._onload(call)  # not (or no longer) copied back ahead: the backward waits for the copy
            self.manager.counters.num_blocking_act_onloads += 1
        elif call.ready_event is not None:  # copied back ahead on the activation stream
            current = torch.cuda.current_stream(self.manager.compute_device)
            current.wait_event(call.ready_event)
            for restored in call.restored.values():
                restored.record_stream(current)
            call.ready_event = None
        if not call.started:
            call.started = True
            self._onload_ahead(self.order.previous(call))
        return call.restored.pop(packed.slot)

    def _onload_ahead(self, call: _BlockCall | None) -> None:
        """[Note: activation onload ahead] Start copying back the tensors of ``call`` (the block call whose
        backward comes next) while this block's backward runs; with a budget that covers activations only
        into free room (never evicting a chunk for it)."""
        if call is None or call.ready_event is not None:
            return
        live = [h for h in (r() for r in call.handles) if h is not None and h.slot not in call.restored]
        if not live:
            return
        nbytes = sum(h.host.numel() * h.host.element_size() for h in {id(h.host): h for h in live}.values())
        if self.manager.pool.charges_activations:
            self.manager.sync_activation_bytes()
            if not self.manager.pool.fits(nbytes):
                return
        self._onload(call, ahead=True)
        self.manager.counters.num_prefetched_act_onloads += 1

    def _onload(self, call: _BlockCall, ahead: bool = False) -> None:
        """Copy every tensor of ``call`` still held by autograd back to the device (one batch); ``ahead``: on
        CUDA record an event after the copies for the first unpack to wait on, instead of waiting now."""
        handles = [h() for h in call.handles]
        todo = [h for h in handles if h is not None and h.slot not in call.restored]
        self.manager.sync_activation_bytes()  # blocks whose backward ended gave their restored tensors back
        hosts = list({id(h.host): h.host for h in todo}.values())  # a shared host copy comes back once
        if self.stream is not None:
            current = torch.cuda.current_stream(self.manager.compute_device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                copies = [self._copy_back(host, non_blocking=True) for host in hosts]
            if ahead:
                call.ready_event = torch.cuda.Event()
                call.ready_event.record(self.stream)
            else:
                current.wait_stream(self.stream)
                for restored in copies:
                    restored.record_stream(current)
        else:
            copies = [self._copy_back(host, non_blocking=False) for host in hosts]
        back = {id(host): restored for host, restored in zip(hosts, copies)}
        for restored in copies:
            self.manager._pack_saved(restored)  # charged while autograd holds it ([Note: activation offload])
        for handle in todo:
            shape, stride, offset = handle.layout
            call.restored[handle.slot] = back[id(handle.host)].as_strided(shape, stride, offset)

    def _copy_back(self, host: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        out = torch.empty(host.shape, dtype=host.dtype, device=self.manager.compute_device)
        with strict.host_copies():
            out.copy_(host, non_blocking=non_blocking)
        self.manager.counters.h2d_bytes += out.numel() * out.element_size()
        return out


def apply_activation_policy(model: torch.nn.Module, policy: dict[str, str], manager: ChunkManager) -> list:
    """Install ``policy`` (block FQN -> ``"keep" | "recompute" | "offload"``) on ``model``'s blocks.

    Returns:
        hook handles to remove (the offload hooks); recompute sets instance attributes only.
    """
    modules = dict(model.named_modules())
    handles: list = []
    stream = None
    order = _CallOrder()  # shared by the offloaded blocks ([Note: activation onload ahead])
    for name, kind in policy.items():
        assert kind in ACTIVATION_POLICIES, f"block {name!r}: activation policy {kind!r}"
        block = modules[name]
        if kind == "recompute":
            _enable_recompute(block)
        elif getattr(block, "gradient_checkpointing", False) is True:
            block.gradient_checkpointing = False  # the HF switch the user turned on, overridden by this policy
        elif kind == "offload":
            if stream is None and manager.compute_device.type == "cuda":
                stream = torch.cuda.Stream(manager.compute_device)
            offload = _OffloadedBlock(name, manager, stream, order)
            handles.append(block.register_forward_pre_hook(offload.enter))
            handles.append(block.register_forward_hook(offload.leave, always_call=True))
    counts = {k: sum(1 for v in policy.values() if v == k) for k in ACTIVATION_POLICIES}
    if counts["recompute"] or counts["offload"]:
        info_on_main_rank(logger, "hf_elixir: activation policy over %d blocks: %s", len(policy),
                          ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    return handles


def model_activation_policy(model, plan: ElixirPlan | None, config: ElixirConfig) -> dict[str, str]:
    """Each transformer block's activation policy: the config's over the plan's.

    Raises:
        ValueError: a plan entry or a config glob names no block of ``model``.
    """
    blocks = transformer_blocks(model)
    modules = dict(model.named_modules())
    own = frozenset(b for b in blocks if getattr(modules[b], "gradient_checkpointing", False) is True)
    if plan is None:
        return resolve_activation_policy(blocks, {}, False, config.activation_policy, own)
    return resolve_activation_policy(blocks, plan.activation_policy, plan.activation_checkpointing,
                                     config.activation_policy, own)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """The plan's memory peak assumes activation checkpointing: turn it on (Hugging Face models)."""
    enable = (getattr(model, "activation_checkpointing_enable", None)
              or getattr(model, "gradient_checkpointing_enable", None))
    if enable is None:
        logger.warning("ElixirConfig.plan assumes activation checkpointing, but %s has no "
                       "gradient_checkpointing_enable(); its activations may not fit the plan's peak",
                       type(model).__name__)
        return
    enable()
    info_on_main_rank(logger, "hf_elixir: activation checkpointing enabled, as the plan assumes")


@contextlib.contextmanager
def hf_checkpointing_off(model: torch.nn.Module):
    """Turn the Hugging Face gradient-checkpointing switches (``module.gradient_checkpointing``, set by
    ``model.gradient_checkpointing_enable()``, which ``Trainer(gradient_checkpointing=True)`` calls before
    ``prepare``) off for the block, back on after it.

    The search profiles every block as kept and prices recompute and offload per block from that profile
    (:mod:`hf_elixir.search._activation_cost`), and ``prepare`` then installs the plan's policy, turning the user's
    switch off on the blocks it keeps (:func:`apply_activation_policy`). A profile
    taken with the switches on measured only the checkpoints' inputs, so "keep" looked nearly free: a tiny GPT-2
    under a 400000-byte budget got "keep" for both blocks priced at 70532 bytes of activations, then ran out of
    the budget in its first forward (263552 bytes saved)."""
    switched = [m for m in model.modules() if getattr(m, "gradient_checkpointing", None) is True]
    for module in switched:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in switched:
            module.gradient_checkpointing = True


def install_activation_policy(model: torch.nn.Module, policy: dict[str, str], activation_checkpointing: bool,
                              manager: ChunkManager, handles: list) -> None:
    """Run each block's ``policy`` (:func:`apply_activation_policy`; its hooks are removed with ``handles``'
    first one), or, for a model without repeated blocks whose plan assumes activation checkpointing, turn on
    the model's own switch (:func:`enable_activation_checkpointing`)."""
    if policy:
        removables = apply_activation_policy(model, policy, manager)
        if handles:  # removed with the other hooks
            handles[0].removables += removables
    elif activation_checkpointing:
        enable_activation_checkpointing(model)
