"""Module and parameter hooks that drive the chunk manager during forward and backward.

* pre-forward: unshard (and pin) the chunks holding the module's parameters; mark which trainable
  parameters this forward uses; wrap the module's grad-requiring inputs in ``_PostBackward`` so that
  the end of the module's backward is observed.
* post-forward: unpin; register a multi-grad hook ("any") on the outputs that runs before the module's
  backward (FSDP2 uses the same pair of hooks) and unshards again for backward.
* post-accumulate-grad (per trainable parameter): copy the gradient into its chunk's gradient buffer and
  let the manager reduce-scatter ready chunks in its fixed order.
* end of backward (queued engine callback): flush remaining reduce-scatters, unpin.
* the outermost forward opens the window in which reads of parameters outside their own module are served
  ([Note: external reads] in ``chunk/_external.py``).

Activation checkpointing re-runs forwards inside backward: the pre-forward hook then unshards
again and pins for the recomputation only, which is all the recomputed forward needs.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_unflatten

from hf_elixir.chunk.chunk import Chunk, ParamSlot
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.chunk.states import TensorState

__all__ = ["ModuleHandle", "install_hooks", "unit_chunks"]

#: module types that read their children's parameters functionally (the children's forward never
#: runs): their unit covers the whole subtree.
_SUBTREE_UNITS: tuple[type, ...] = (torch.nn.MultiheadAttention,)


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward runs once the module's input gradients exist."""

    @staticmethod
    def forward(ctx, handle: "ModuleHandle", *tensors: torch.Tensor):
        ctx.handle = handle
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.handle.post_backward()
        return (None, *grads)


def mark_used(manager: ChunkManager, slots: list[ParamSlot]) -> None:
    """Record that this forward used these trainable parameters (their gradients will be awaited), those
    that still require grad (one frozen after ``prepare`` gets none, as in PyTorch)."""
    chunk_of = manager.chunk_of
    for slot in slots:
        if slot.param.requires_grad:
            chunk_of[slot.param].used_slots.add(slot.index_in_chunk)


class ModuleHandle:
    """The hooks of one module with managed parameters (its unit: direct params, or the subtree)."""

    def __init__(self, name: str, module: torch.nn.Module, slots: list[ParamSlot], chunks: list[Chunk],
                 manager: ChunkManager) -> None:
        self.name = name
        self.module = module
        self.slots = slots
        self.trainable_slots = [s for s in slots if s.trainable]
        self.chunks = chunks
        self.manager = manager
        self.subtree = False  # the unit covers a subtree (its children mark their own use)
        self.bwd_pins = 0  # released by _PostBackward (the module's input gradients exist)
        self.grad_pins = 0  # released when the unit's trainable parameters have their gradients
        self._call_has_grad_inputs = False
        # [Note: embedding backward] nn.Embedding's backward reads only the indices and the output
        # gradient, never the weight, so its chunk need not be unsharded for backward.
        self.unshard_for_backward = not isinstance(module, torch.nn.Embedding)
        self.removables: list = []

    def _set_states(self, new: TensorState, only_from: tuple[TensorState, ...] | None = None) -> None:
        for slot in self.slots:
            if only_from is None or slot.state in only_from:
                slot.set_state(new)

    # -- forward -------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        self.manager.access(self.chunks)
        self._set_states(TensorState.COMPUTE)
        if not torch.is_grad_enabled():
            return None
        if not self.subtree:
            mark_used(self.manager, self.trainable_slots)
        if all(tree_is_leaf(a) for a in args) and all(tree_is_leaf(v) for v in kwargs.values()):
            return self._wrap_flat_inputs(args, kwargs)
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        self._call_has_grad_inputs = bool(positions)
        if not positions:
            return None
        wrapped = _PostBackward.apply(self, *[flat[i] for i in positions])
        for i, tensor in zip(positions, wrapped):
            flat[i] = tensor
        return tree_unflatten(flat, spec)

    def _wrap_flat_inputs(self, args: tuple, kwargs: dict):
        """``pre_forward`` without ``tree_flatten`` when no argument is a container (the usual case):
        torch's Python ``tree_flatten`` builds a self-referencing closure per call, cyclic garbage that
        makes the interpreter run full garbage collections (~0.2 s on a large heap) every ~100 steps."""
        arg_pos = [i for i, t in enumerate(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        kw_keys = [k for k, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        self._call_has_grad_inputs = bool(arg_pos or kw_keys)
        if not self._call_has_grad_inputs:
            return None
        wrapped = _PostBackward.apply(self, *[args[i] for i in arg_pos], *[kwargs[k] for k in kw_keys])
        new_args, new_kwargs = list(args), dict(kwargs)
        for i, tensor in zip(arg_pos, wrapped):
            new_args[i] = tensor
        for k, tensor in zip(kw_keys, wrapped[len(arg_pos):]):
            new_kwargs[k] = tensor
        return tuple(new_args), new_kwargs

    def post_forward(self, module, args, kwargs, output):
        self.manager.release(self.chunks)
        self._set_states(TensorState.HOLD_AFTER_FWD if torch.is_grad_enabled() else TensorState.HOLD,
                         only_from=(TensorState.COMPUTE,))
        if not torch.is_grad_enabled():
            return output
        # [Note: backward is rank-local] a unit whose outputs need no gradient on this rank (an MoE
        # expert container whose experts got no tokens returns zeros) simply does not unshard for
        # backward here; backward unshards never all-gather (Chunk notes), so ranks cannot diverge.
        if tree_is_leaf(output):
            leaves = [output]
        elif type(output) in (tuple, list) and all(tree_is_leaf(o) for o in output):
            leaves = list(output)
        else:
            leaves = tree_flatten(output)[0]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(tensors) == 1:  # one tensor hook: a fraction of register_multi_grad_hook's Python objects
            tensors[0].register_hook(self._pre_backward_with_inputs if self._call_has_grad_inputs
                                     else self._pre_backward_without_inputs)
        elif tensors:
            hook = functools.partial(self.pre_backward, has_grad_inputs=self._call_has_grad_inputs)
            register_multi_grad_hook(tensors, hook, mode="any")
        return output

    # -- backward ------------------------------------------------------------------------------
    def _pre_backward_with_inputs(self, grad) -> None:
        self.pre_backward(grad, has_grad_inputs=True)

    def _pre_backward_without_inputs(self, grad) -> None:
        self.pre_backward(grad, has_grad_inputs=False)

    def pre_backward(self, grad, has_grad_inputs: bool = True) -> None:
        self.manager.start_backward()
        if not self.unshard_for_backward:
            return
        self.manager.access(self.chunks)
        if has_grad_inputs:
            self.bwd_pins += 1
        else:
            self.grad_pins += 1
        self._set_states(TensorState.COMPUTE, only_from=(TensorState.HOLD, TensorState.HOLD_AFTER_FWD,
                                                         TensorState.HOLD_AFTER_BWD, TensorState.COMPUTE))

    def post_backward(self) -> None:
        if self.bwd_pins == 0:
            return
        self.bwd_pins -= 1
        # states first: the release may reshard a chunk backward uses no more ([Note: dead chunks])
        self._set_states(TensorState.HOLD_AFTER_BWD, only_from=(TensorState.COMPUTE,))
        self.manager.release(self.chunks)

    def on_param_grad(self) -> None:
        """A trainable parameter of this unit got its gradient: release grad pins once all have."""
        if not self.grad_pins:
            return
        arrived = self.manager.flags.arrived
        if all(s.flag_index in arrived for s in self.trainable_slots if s.param.requires_grad):
            while self.grad_pins:
                self.grad_pins -= 1
                self.manager.release(self.chunks)

    def end_backward(self) -> None:
        while self.bwd_pins:
            self.post_backward()
        while self.grad_pins:
            self.grad_pins -= 1
            self.manager.release(self.chunks)

    def remove(self) -> None:
        for handle in self.removables:
            handle.remove()
        self.removables.clear()


def _is_routing_container(module: torch.nn.Module) -> bool:
    """A ModuleDict/ModuleList with its own forward (an MoE expert container such as HF Switch's
    ``SwitchTransformersExperts``) runs only some children, chosen by the data. Its whole subtree is
    one unit, unsharded at the container's pre-forward, so every rank gathers the same chunks."""
    if not isinstance(module, (torch.nn.ModuleDict, torch.nn.ModuleList)):
        return False
    return type(module).forward is not torch.nn.ModuleDict.forward and type(module).forward is not torch.nn.ModuleList.forward


def _units(model: torch.nn.Module, managed: set[torch.nn.Parameter]):
    """Yield ``(name, module, params)`` for every module that owns managed parameters in its unit."""
    covered: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in covered:
            continue
        subtree = isinstance(module, _SUBTREE_UNITS) or _is_routing_container(module)
        # [Note: compiled units] a block compiled by ElixirConfig.compile (runtime/compile.py) is one dense unit:
        # its hooks cover every parameter below it, and its submodules get none (they run inside compiled code)
        if subtree or getattr(module, "_hf_elixir_compiled_unit", False):
            params = [p for p in module.parameters() if p in managed]
            covered.update(id(m) for m in module.modules())
        else:
            params = [p for p in module.parameters(recurse=False) if p in managed]
        if params:
            yield name, module, params, subtree


def mark_subtree_chunks(model: torch.nn.Module, manager: ChunkManager) -> None:
    """Set each chunk's ``subtree_only`` and ``host_copy_required`` from the model's units (no hooks
    needed: ``prepare`` places chunks, which reads ``host_copy_required``, before it installs hooks).

    [Note: idle experts] a chunk holding only parameters of subtree units (MoE experts), none of
    them used by this forward, gets no gradient this backward (children mark their own use; expert
    parameters are not used outside their expert). Such a chunk is ready for its (zero) reduce at once,
    so it does not hold up the reduce order and keep every later chunk's gradient buffer alive.
    """
    in_subtree = {id(manager.slot_of[p]) for _, _, params, subtree in _units(model, set(manager.slot_of))
                  if subtree for p in params}
    for chunk in manager.chunks:
        chunk.subtree_only = bool(chunk.slots) and all(id(s) in in_subtree for s in chunk.slots)
        # whether a rank uses such a chunk in backward depends on its data: re-gathering it there could
        # differ between ranks, so it keeps a rank-local host copy ([Note: rank-local refill])
        chunk.host_copy_required = any(id(s) in in_subtree for s in chunk.slots)


def install_hooks(model: torch.nn.Module, manager: ChunkManager) -> list[ModuleHandle]:
    """Register forward/backward hooks on every unit and grad hooks on every trainable parameter."""
    handles: list[ModuleHandle] = []
    managed = set(manager.slot_of)
    for name, module, params, subtree in _units(model, managed):
        seen: set[int] = set()
        slots = []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                slots.append(manager.slot_of[p])
        chunks = sorted({manager.chunk_of[s.param].chunk_id for s in slots})
        handle = ModuleHandle(name, module, slots, [manager.chunks[c] for c in chunks], manager)
        handle.subtree = subtree
        if subtree:  # children that actually run mark their own parameters as used
            for child in module.modules():
                own = [manager.slot_of[p] for p in child.parameters(recurse=False)
                       if p in managed and manager.slot_of[p].trainable]
                if own:
                    def mark(mod, args, _own=own):
                        if torch.is_grad_enabled():
                            mark_used(manager, _own)
                    handle.removables.append(child.register_forward_pre_hook(mark))
        handle.removables.append(module.register_forward_pre_hook(handle.pre_forward, with_kwargs=True))
        handle.removables.append(module.register_forward_hook(handle.post_forward, with_kwargs=True))
        handles.append(handle)

    def on_backward_end() -> None:
        for handle in handles:
            handle.end_backward()
        manager.release_backward_holds()  # [Note: external reads] in chunk/_external.py
        for slot in manager.slot_of.values():
            if slot.state is TensorState.COMPUTE:
                slot.set_state(TensorState.HOLD_AFTER_BWD)

    manager.on_backward_end = on_backward_end
    # tensor-parallel split parameters hold a slice: a read outside their module is refused by name
    pstate = getattr(model, "_hf_elixir_parallel", None)  # parallel/_state.py (an upper layer: read, not imported)
    manager.split_names = frozenset(getattr(pstate, "tp_layouts", None) or ())
    mark_subtree_chunks(model, manager)
    owners: dict[torch.nn.Parameter, list[ModuleHandle]] = {}
    for handle in handles:
        for slot in handle.trainable_slots:
            owners.setdefault(slot.param, []).append(handle)
    # The gradient hooks reach the manager and the handles through weak references: a parameter's
    # post-accumulate-grad hooks are held by its C++ TensorImpl, which the garbage collector cannot
    # traverse, so a strong reference here would keep the manager and every chunk alive after the model
    # is dropped. The model holds the manager (its ElixirState), the manager the handles
    # (``on_backward_end``), so the referents live as long as the model does.
    manager_ref = weakref.ref(manager)
    for param, slot in manager.slot_of.items():
        if slot.trainable:
            def hook(p, _owners=tuple(weakref.ref(h) for h in owners.get(param, ()))):
                _grad_ready(manager_ref(), p, _owners)
            hook_handle = param.register_post_accumulate_grad_hook(hook)
            if handles:
                handles[0].removables.append(hook_handle)
    if handles:
        handles[0].removables += _install_activation_accounting(model, manager)
    return handles


def _grad_ready(manager: ChunkManager | None, param: torch.nn.Parameter, owners: tuple) -> None:
    """``param``'s gradient is accumulated: start the backward pass, hand the gradient to its chunk and
    tell the modules that own ``param`` (``owners``: weak references to :class:`ModuleHandle`)."""
    assert manager is not None, "a gradient hook ran after its ChunkManager was collected"
    manager.start_backward()
    manager.on_grad(param)
    manager.release_external(param)
    for owner in owners:
        owner().on_param_grad()


def _install_activation_accounting(model: torch.nn.Module, manager: ChunkManager) -> list:
    """Around the outermost forward with grad enabled, charge what autograd saves for backward
    (:meth:`ChunkManager.saved_tensors_accounting`); around every outermost forward, tell the manager where it
    starts and ends (:meth:`ChunkManager.begin_forward` / :meth:`~ChunkManager.end_forward`, [Note: forward
    steps] in ``chunk/_steps.py``). The post-hook runs also when forward raises."""
    depth, active = [0], []

    def enter(module, args):
        if depth[0] == 0:
            manager.begin_forward()
            manager.open_reads_window()  # [Note: external reads] in chunk/_external.py
            if torch.is_grad_enabled():
                active.append(manager.saved_tensors_accounting())
                active[-1].__enter__()
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1
        if depth[0] == 0:
            if active:
                active.pop().__exit__(None, None, None)
            manager.close_reads_window()
            manager.end_forward()

    return [model.register_forward_pre_hook(enter, prepend=True),
            model.register_forward_hook(leave, always_call=True)]


def unit_chunks(model: torch.nn.Module, chunk_of: dict) -> list[list]:
    """Per unit ``install_hooks`` will hook, the chunks (or chunk specs) its parameters live in, by id."""
    units = []
    for _, _, params, _ in _units(model, set(chunk_of)):
        by_id = {chunk_of[p].chunk_id: chunk_of[p] for p in params}
        units.append([by_id[c] for c in sorted(by_id)])
    return units
