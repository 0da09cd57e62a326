"""``torch.compile`` of a prepared model, one transformer block at a time (``ElixirConfig.compile``).

[Note: compiled blocks]

Compiling the whole prepared model fails: dynamo traces into Elixir's module hooks (all-gathers, host copies,
chunk state changes, Python bookkeeping) and into parameters that are stale placeholders between uses
([Note: stale placeholder] in ``chunk/params.py``). FSDP2 and torchtitan compile each transformer block
instead and keep the sharding hooks out of the compiled code; hf_elixir does the same:

* the blocks are :func:`~hf_elixir.runtime.activations.transformer_blocks` (the outermost children of the
  model's ``nn.ModuleList`` s). Each compiled block is one hook *unit* ([Note: compiled units] in
  ``runtime/hooks.py``): its forward pre-hook unshards the chunks of every parameter in the block, its forward
  hook and the backward hooks on its inputs/outputs do the rest, and none of its submodules has a hook of its
  own. Layout and budget floor follow, since ``prepare`` lays chunks out per unit: a compiled block needs all
  its chunks on the device at once (FSDP2's unit is the block too).
* only ``block.forward`` is compiled (``torch.compile(block.forward)`` set on the instance), never
  ``block.__call__``: ``nn.Module.__call__`` runs the block's hooks eagerly around the compiled forward, so
  no collective, host copy or storage resize (``untyped_storage().resize_``) is ever traced. Inside the
  forward every parameter of the block is current (unsharded, the plain managed class), which is all dynamo
  sees: parameters are graph inputs (``inline_inbuilt_nn_modules``), guarded on their metadata, not their
  storage, so one compiled graph serves every block of the same shape and refilling a resharded chunk needs
  no recompile. Autograd saves views into the chunk storage as in eager, and the backward pre-hook refills
  that storage before the compiled backward reads it ([Note: parameters as views] in ``chunk/chunk.py``).
* the activation policy wraps the compiled forward (recompute replays it inside ``torch.utils.checkpoint``).

A block is left eager, with a warning that names why, when its forward is data-dependent in a way the unit
cannot follow: an MoE expert container (``_is_routing_container``: only the experts that got tokens run, and
each of them marks its own use) or ``nn.MultiheadAttention`` (its children's parameters are read
functionally). Graph breaks are counted from ``torch._dynamo.utils.counters["graph_break"]`` around each
block's first call: ``memory_stats`` reports ``num_compiled_blocks`` and ``compile_graph_breaks``, and a log
line on the main rank names them once the first step has compiled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from hf_elixir._logging import info_on_main_rank, is_main_rank
from hf_elixir.runtime.activations import transformer_blocks

__all__ = ["COMPILED_UNIT_ATTR", "apply_compile", "compile_blocks", "compiled_units", "compile_kwargs", "compile_stats",
           "mark_compiled_blocks"]

logger = logging.getLogger(__name__)

#: instance attribute marking a block that is one compiled hook unit (read by ``runtime/hooks.py``'s ``_units``)
COMPILED_UNIT_ATTR = "_hf_elixir_compiled_unit"

COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")


def compile_kwargs(setting: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments of an ``ElixirConfig.compile`` value, or ``None`` (off).

    ``False``/``None``: off; ``True``: ``torch.compile``'s defaults (inductor); a string: that backend
    (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...); a mapping: keyword arguments among :data:`COMPILE_KEYS`.
    """
    if setting is None or setting is False:
        return None
    if setting is True:
        return {}
    if isinstance(setting, str):
        return {"backend": setting}
    return dict(setting)


def _why_not(block: torch.nn.Module) -> str | None:
    """Why ``block`` stays eager, or ``None`` when it can be one compiled unit."""
    from hf_elixir.runtime.hooks import _SUBTREE_UNITS, _is_routing_container  # noqa: PLC0415

    for name, module in block.named_modules():
        if _is_routing_container(module):
            return (f"{type(module).__name__} at {name!r} routes tokens to some experts only (data-dependent: each "
                    "expert marks its own use, a hook inside the compiled forward)")
        if isinstance(module, _SUBTREE_UNITS):
            return f"{type(module).__name__} at {name!r} reads its children's parameters functionally"
    return None


def mark_compiled_blocks(model: torch.nn.Module, setting: Any, warn: bool = True) -> list[str]:
    """Mark the transformer blocks of ``model`` that will be compiled (``setting``: ``ElixirConfig.compile``);
    with ``warn``, warn (main rank) for each block left eager, naming why, and when the model has no blocks.

    Returns:
        The FQNs of the marked blocks (``[]`` when compile is off).
    """
    if compile_kwargs(setting) is None:
        return []
    modules = dict(model.named_modules())
    blocks = transformer_blocks(model)
    warn = warn and is_main_rank()
    if not blocks and warn:
        logger.warning("ElixirConfig.compile: %s has no nn.ModuleList of transformer blocks to compile one by one; it "
                       "runs eagerly (hf_elixir compiles per block so that its unshard/reshard hooks stay outside "
                       "the compiled code)", type(model).__name__)
    chosen = []
    for name in blocks:
        why = _why_not(modules[name])
        if why is not None:
            if warn:
                logger.warning("ElixirConfig.compile: block %r runs eagerly: %s", name, why)
            continue
        setattr(modules[name], COMPILED_UNIT_ATTR, True)
        chosen.append(name)
    return chosen


@contextlib.contextmanager
def compiled_units(model: torch.nn.Module, setting: Any):
    """The blocks ``prepare`` would compile marked as units for the block (``min_device_budget_bytes`` lays chunks
    out per unit as ``prepare`` does), unmarked afterwards unless they were marked before."""
    before = {id(m) for m in model.modules() if getattr(m, COMPILED_UNIT_ATTR, False)}
    marked = mark_compiled_blocks(model, setting, warn=False)
    try:
        yield
    finally:
        modules = dict(model.named_modules())
        for name in marked:
            if id(modules[name]) not in before:
                modules[name].__dict__.pop(COMPILED_UNIT_ATTR, None)


class _CompiledForward:
    """``block.forward`` compiled, counting the graph breaks of its first call (when dynamo compiles it)."""

    def __init__(self, block: torch.nn.Module, name: str, kwargs: dict[str, Any], report) -> None:
        self.name = name
        self.eager = block.forward
        self.compiled = torch.compile(block.forward, **kwargs)
        self.graph_breaks: int | None = None  # known after the first call
        self._report = report

    def __call__(self, *args, **kwargs):
        if self.graph_breaks is not None:
            return self.compiled(*args, **kwargs)
        from torch._dynamo.utils import counters  # noqa: PLC0415

        before = sum(counters["graph_break"].values())
        out = self.compiled(*args, **kwargs)
        self.graph_breaks = sum(counters["graph_break"].values()) - before
        self._report()
        return out


def compiled_any(model: torch.nn.Module) -> bool:
    return any(getattr(m, COMPILED_UNIT_ATTR, False) for m in model.modules())


def _training_without_cache(model: torch.nn.Module) -> list:
    """A root forward pre-hook that passes ``use_cache=False`` to a Hugging Face model's training forwards that
    leave it unset ([Note: no KV cache in compiled training]); returns its handle (``[]`` when the model takes no
    ``use_cache``).

    [Note: no KV cache in compiled training] A Hugging Face decoder builds a ``DynamicCache`` in every forward
    whose config says ``use_cache=True`` (the default), training included, and each block's forward updates its
    own layer of it. Dynamo guards on that layer's state, so every block recompiled (GPT-2: one graph per block)
    until ``torch._dynamo.config.recompile_limit`` (8) ran the later blocks eagerly. Training never reads the
    cache; with ``use_cache=False`` one graph serves every block. Transformers does the same for gradient
    checkpointing (it sets ``use_cache=False`` in training). Evaluation and ``generate`` keep the cache.
    """
    if not getattr(getattr(model, "config", None), "use_cache", False):
        return []
    import inspect  # noqa: PLC0415

    try:
        takes_it = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_it = False
    if not takes_it:
        return []

    def no_cache(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is None:
            return args, {**kwargs, "use_cache": False}
        return None

    return [model.register_forward_pre_hook(no_cache, with_kwargs=True)]


class _Undo:
    """Removable: puts the block's eager forward back (with the hooks, when the model is released)."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.block = block

    def remove(self) -> None:
        self.block.__dict__.pop("forward", None)
        self.block.__dict__.pop(COMPILED_UNIT_ATTR, None)


def compile_blocks(model: torch.nn.Module, setting: Any) -> tuple[list[_CompiledForward], list[_Undo]]:
    """Compile the forward of every block :func:`mark_compiled_blocks` marked (after the hooks are installed,
    before the activation policy wraps the forwards).

    Returns:
        ``(compiled, removables)``: one :class:`_CompiledForward` per block, and handles that undo them.
    """
    kwargs = compile_kwargs(setting)
    if kwargs is None:
        return [], []
    compiled: list[_CompiledForward] = []

    def report() -> None:
        if all(c.graph_breaks is not None for c in compiled):
            stats = compile_stats(compiled)
            info_on_main_rank(logger, "hf_elixir: torch.compile(%s) of %d blocks: %d graph breaks",
                              kwargs.get("backend", "inductor"), stats["num_compiled_blocks"],
                              stats["compile_graph_breaks"])

    removables = [] if not compiled_any(model) else _training_without_cache(model)
    for name, module in model.named_modules():
        if getattr(module, COMPILED_UNIT_ATTR, False):
            forward = _CompiledForward(module, name, kwargs, report)
            module.forward = forward
            compiled.append(forward)
            removables.append(_Undo(module))
    return compiled, removables


def compile_stats(compiled: list[_CompiledForward]) -> dict[str, int]:
    """``num_compiled_blocks`` and ``compile_graph_breaks`` (graph breaks dynamo reported while compiling the
    blocks' first calls; ``-1`` before every block has run once)."""
    if not compiled:
        return {}
    pending = any(c.graph_breaks is None for c in compiled)
    return {"num_compiled_blocks": len(compiled),
            "compile_graph_breaks": -1 if pending else sum(c.graph_breaks for c in compiled)}


def apply_compile(model: torch.nn.Module, setting: Any, handles: list) -> list[_CompiledForward]:
    """:func:`compile_blocks`, its undo handles kept with the hooks' (``handles[0].removables``), for ``prepare``."""
    compiled, removables = compile_blocks(model, setting)
    if handles:
        handles[0].removables += removables
    return compiled
