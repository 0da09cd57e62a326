"""The tracer behind :func:`~hf_elixir.profiler._step.profile_step`: the hooks that record each parameter access,
its activation bytes and its compute (see the module docstring of ``_step.py`` for what is recorded and why), and
the access units it shares with the chunk manager's hooks (``hf_elixir.runtime.hooks``)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Mapping

import torch
from torch import nn

from hf_elixir.profiler._step_profile import AccessEvent, canonical_parameters

__all__ = ["_Tracer", "_access_units", "_block_names", "_has_subtree_units", "_param_module_names", "_tensors_in"]


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
