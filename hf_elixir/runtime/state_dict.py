"""Model ``state_dict`` / ``load_state_dict`` with full (consolidated) tensors under chunk sharding.

``model.state_dict()`` returns full parameter tensors (collective under torch.distributed: every rank
calls it, chunks are unsharded one module at a time, in module order, which is the same on every rank), under
bf16/fp16 the optimizer's fp32 masters unless ``ElixirConfig.export_dtype="compute"`` ([Note: fp32 exports] in
_exports.py);
``model.load_state_dict(sd)`` unshards each module's chunks before PyTorch copies into the parameters,
marks them dirty, and writes every dirty chunk back into its shard at the end (then refreshes the fp32
masters, from the fp32 values given where there are: [Note: fp32 loads] in _exports.py), so ``save_pretrained`` / ``from_pretrained``-style round trips work on a prepared model.
"""

from __future__ import annotations

import contextlib

import torch

from hf_elixir.chunk._nf4_state_dict import install_nf4_state_dict_names
from hf_elixir.chunk.manager import ChunkManager
from hf_elixir.chunk.strict import host_copies
from hf_elixir.runtime._entry_check import check_model_entry
from hf_elixir.runtime._exports import MasterExport, install_config_dtype, load_fp32_masters
from hf_elixir.runtime._state import get_state

__all__ = ["finishing_load", "full_parameters", "install_state_dict_hooks"]


def _ensure_full(manager: ChunkManager, chunk) -> None:
    _ensure_all_full(manager, [chunk])


def _ensure_all_full(manager: ChunkManager, chunks) -> None:
    """Unshard ``chunks`` together (pinned while the others are made room for), so their parameters are
    current views when this returns; nothing is evicted before the next unshard elsewhere."""
    pinned = []
    try:
        for chunk in chunks:
            if chunk.needs_fill():
                manager.make_room(chunk.fill_bytes_needed(), f"state_dict access of chunk {chunk.chunk_id}",
                                  exclude={c.chunk_id for c in pinned} | {chunk.chunk_id})
            chunk.unshard()  # also points current parameters back at their views
            chunk.pins += 1
            pinned.append(chunk)
    finally:
        for chunk in pinned:
            chunk.pins -= 1


def write_back_dirty(manager: ChunkManager) -> None:
    """After values were copied into gathered chunks (a load): each dirty gathered chunk writes its values back to
    its shard; a dirty chunk no longer gathered has nothing left to write."""
    for chunk in manager.chunks:
        if chunk.dirty:
            if chunk.unsharded:
                chunk.write_back()
            else:
                chunk.dirty = False


def install_state_dict_hooks(model: torch.nn.Module, manager: ChunkManager, on_loaded) -> list:
    """Register save/load hooks on every module that owns managed parameters.

    Saves write the fp32 masters or the compute copy as ``ElixirConfig.export_dtype`` says ([Note: fp32
    exports] in _exports.py); loads keep the fp32 values they are given as the masters ([Note: fp32 loads]).

    Args:
        on_loaded: called with the list of parameters a ``load_state_dict`` wrote (the optimizer refreshes
            their fp32 masters there).
    """
    export = MasterExport(model, manager)
    load = _Load(manager, lambda: get_state(model).optimizer, on_loaded)

    def begin_save(*args):
        check_model_entry("model.state_dict()", get_state(model))  # [Note: collective entry check] in _entry_check.py
        load.finish_abandoned()  # a direct nn.Module.load_state_dict that raised ([Note: a load that raises])
        export.begin()

    removables = [model.register_state_dict_pre_hook(begin_save)]

    # PyTorch copies the (host) state-dict tensors into the unsharded chunks between the root's load pre-hooks and
    # its post-hook: a manager copy path ([Note: strict device]). Registered first: it runs before the root's own.
    def enter_copies(state_dict, prefix, local_metadata, *args):
        check_model_entry("model.load_state_dict(...)", get_state(model))
        _refuse_assign(local_metadata)
        load.begin(model)

    removables.append(model._register_load_state_dict_pre_hook(enter_copies))
    removables.extend(_install_commits(model, load))

    for module in model.modules():
        own = {name: p for name, p in module._parameters.items() if p is not None and p in manager.slot_of}
        if not own:
            continue

        own_chunks = sorted({manager.chunk_of[p] for p in own.values()}, key=lambda c: c.chunk_id)

        def save_pre_hook(mod, prefix, keep_vars, _chunks=own_chunks):
            _ensure_all_full(manager, _chunks)  # Module._save_to_state_dict detaches the parameters next

        def save_hook(mod, destination, prefix, local_metadata, _own=own):
            for name, param in _own.items():
                key = prefix + name
                if key not in destination:
                    continue
                _ensure_full(manager, manager.chunk_of[param])
                destination[key] = export.value(param)  # host memory, as on CUDA

        def load_pre_hook(state_dict, prefix, local_metadata, strict, missing, unexpected, errors, _own=own):
            load.commit()  # the module before this one is copied by now
            given = {p: state_dict[prefix + name] for name, p in _own.items() if prefix + name in state_dict}
            load.in_flight.update((p, v) for p, v in given.items() if _copied(v, manager.slot_of[p].shape))
            chunks = {manager.chunk_of[p] for p in given}
            _ensure_all_full(manager, sorted(chunks, key=lambda c: c.chunk_id))  # Module copies into them next
            for chunk in chunks:
                chunk.dirty = True

        removables.append(module.register_state_dict_pre_hook(save_pre_hook))
        removables.append(module._register_state_dict_hook(save_hook))
        removables.append(module._register_load_state_dict_pre_hook(load_pre_hook))

    # [Note: tied entries share one tensor] Each module's save_hook above writes a fresh host copy of each of its
    # parameters, so a parameter under two names (GPT-2's lm_head.weight tied to transformer.wte.weight) got two
    # unrelated copies. PyTorch's state_dict gives both names one storage, and Hugging Face's save_pretrained
    # (remove_tied_weights_from_state_dict) and accelerate's safetensors save find tied weights by storage: with two
    # copies they wrote lm_head.weight too (a larger file than plain transformers writes, one embedding more). The
    # root's hook, run after every module's, points every name of one parameter at the first name's copy.
    tied = _tied_names(model, manager)
    if tied:
        def share_tied_hook(mod, destination, prefix, local_metadata):
            for names in tied:
                keys = [prefix + name for name in names if prefix + name in destination]
                for key in keys[1:]:
                    destination[key] = destination[keys[0]]

        removables.append(model._register_state_dict_hook(share_tied_hook))
    removables.extend(install_nf4_state_dict_names(model))  # [Note: NF4 state_dict names] in chunk/_nf4_state_dict.py
    removables.append(model._register_state_dict_hook(lambda *args: export.end()))  # after every module's
    config_dtype = install_config_dtype(model, export)
    if config_dtype is not None:
        removables.append(config_dtype)

    def load_post_hook(mod, incompatible_keys):
        load.finish()

    removables.append(model.register_load_state_dict_post_hook(load_post_hook))
    _finish_on_error(model, load)
    return removables


class _Load:
    """One ``model.load_state_dict`` in progress: the copy sanction, the parameters it wrote, their fp32 values.

    [Note: a load that raises] PyTorch copies a module's parameters right after that module's load pre-hooks run,
    then goes on to its children; a pre-hook that raises (a wrong NF4 shape, [Note: NF4 state_dict names]) stops
    the load there, with the modules before it loaded and the root's post-hook never run. :meth:`commit` takes the
    module whose pre-hook ran last as written when the next one starts (or the load ends), so after an error the
    modules before the failing one count as loaded, as in plain PyTorch, and the failing one does not; it runs
    first among every module's load hooks (:func:`_install_commits`), so a hook registered before ``prepare`` that
    raises, or one on a module without parameters, still finds it run. PyTorch also reports a tensor it cannot copy
    (a size mismatch) and goes on: such a parameter is not taken as loaded (:func:`_copied`). A submodule's own
    ``load_state_dict`` is a load too, begun and finished by that submodule's hooks; a direct
    ``nn.Module.load_state_dict(model, ...)`` that raised is finished by the next load or ``state_dict``.
    :meth:`finish` runs on success (the root's post-hook) and on error (:func:`_finish_on_error`): it ends the copy
    sanction (else every later uncounted copy in the thread would pass strict mode), writes the dirty chunks back
    into their shards and refreshes the masters of the loaded parameters only: a partial load (``strict=False``)
    leaves the other masters as they were instead of rounding them to the compute dtype."""

    def __init__(self, manager: ChunkManager, optimizer, on_loaded):
        self.manager, self.optimizer, self.on_loaded = manager, optimizer, on_loaded
        self.copies: list = []
        self.in_flight: dict[torch.nn.Parameter, object] = {}  # the module whose copies may not have run yet
        self.loaded: dict[torch.nn.Parameter, object] = {}
        self.root: torch.nn.Module | None = None  # the module whose load_state_dict runs

    def begin(self, root: torch.nn.Module) -> None:
        self.finish_abandoned()
        self.root = root
        self.copies.append(host_copies())
        self.copies[-1].__enter__()

    def commit(self) -> None:
        self.loaded.update(self.in_flight)
        self.in_flight.clear()

    def finish_abandoned(self) -> None:
        """Finish, as one that raised, a load still open here: ``nn.Module.load_state_dict(model, ...)`` called
        directly bypasses :func:`_finish_on_error`; what it copied before it raised must still reach the masters."""
        if self.copies:
            self.finish(failed=True)

    def end_copies(self) -> None:
        while self.copies:
            self.copies.pop().__exit__(None, None, None)

    def finish(self, failed: bool = False) -> None:
        if not (self.copies or self.in_flight or self.loaded):
            return  # finished already (the post-hook ran, then torch raised for missing keys), or never begun
        self.end_copies()
        self.root = None
        if not failed:
            self.commit()
        self.in_flight.clear()
        loaded, self.loaded = self.loaded, {}
        write_back_dirty(self.manager)
        optimizer = self.optimizer()
        if loaded:  # (nothing copied into a parameter: a buffers-only submodule, a load refused at once)
            self.on_loaded(list(loaded))
        # values the compute dtype cannot hold (fp32; fp16 or float64 into bf16): the masters take them as given
        wider = {p: v for p, v in loaded.items()
                 if torch.is_tensor(v) and v.is_floating_point() and v.dtype != self.manager.chunk_of[p].dtype}
        if wider and optimizer is not None:
            load_fp32_masters(self.manager, optimizer, wider)
        if optimizer is not None:
            optimizer.release_disk_pages()


def _copied(value, shape) -> bool:
    """Whether PyTorch's ``Module._load_from_state_dict`` copies ``value`` into a parameter of ``shape``: a tensor
    of that shape (or of one dimension into a 0-d parameter); anything else it reports as an error and skips, so
    the parameter, its master included, keeps its value."""
    return torch.is_tensor(value) and (tuple(value.shape) == tuple(shape) or (len(shape) == 0 and value.dim() == 1))


def _refuse_assign(local_metadata) -> None:
    """``load_state_dict(sd, assign=True)`` would put the state dict's tensors in place of the managed parameters,
    which then train outside their chunks: refused before anything is loaded."""
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError("model.load_state_dict(..., assign=True) on a model prepared by hf_elixir would replace its "
                         "managed parameters with the state dict's tensors; load with assign=False (the default: "
                         "the values are copied into the chunks), or load with assign=True before hf_elixir.prepare")


def _install_commits(model: torch.nn.Module, load: _Load) -> list:
    """On every module, first among its load pre-hooks and post-hooks: :meth:`_Load.commit`. PyTorch has copied
    the module whose pre-hook ran last by the time any later module's hooks (or its own post-hooks) start, whoever
    registered them and whenever: a hook registered before ``prepare`` that raises still finds that module counted
    as loaded ([Note: a load that raises])."""
    def enter(module, local_metadata):
        if load.root is None:  # a submodule's own load_state_dict: a load of its parameters
            _refuse_assign(local_metadata)
            load.begin(module)
        load.commit()

    def leave(module):
        load.commit()
        if module is load.root and module is not model:  # (the model's own ends in its load_post_hook)
            load.finish()

    removables = []
    for module in model.modules():
        pairs = [(module._load_state_dict_post_hooks, module.register_load_state_dict_post_hook(
            lambda mod, keys: leave(mod)))]
        if module is not model:  # the root's first pre-hook begins the load (what it would commit is not copied)
            pairs.append((module._load_state_dict_pre_hooks, module._register_load_state_dict_pre_hook(
                lambda state_dict, prefix, local_metadata, *args, _module=module: enter(_module, local_metadata))))
        for hooks, handle in pairs:
            hooks.move_to_end(handle.id, last=False)
            removables.append(handle)
    return removables


def _finish_on_error(model: torch.nn.Module, load: _Load) -> None:
    """Wrap ``model.load_state_dict`` so a load that raises part-way still ends ([Note: a load that raises])."""
    setattr(model, _LOAD_ATTR, load)
    previous = model.load_state_dict
    model.load_state_dict = finishing_load(model, previous)
    model.load_state_dict.__doc__ = previous.__doc__


_LOAD_ATTR = "_hf_elixir_load"  # the prepared model's _Load


def finishing_load(model: torch.nn.Module, load_fn):
    """``load_fn`` (a load of ``model``'s parameters, e.g. one that reaches ``nn.Module.load_state_dict`` past the
    prepared model's own: ``hf_elixir.parallel.load_full_state_dict``), wrapped so that if it raises part-way the
    load still ends ([Note: a load that raises]); ``load_fn`` itself on a model not prepared."""
    load = getattr(model, _LOAD_ATTR, None)
    if load is None:
        return load_fn

    def load_state_dict(*args, **kwargs):
        try:
            return load_fn(*args, **kwargs)
        except BaseException:
            load.finish(failed=True)
            raise

    return load_state_dict


def _tied_names(model: torch.nn.Module, manager: ChunkManager) -> list[list[str]]:
    """Names (relative to ``model``, in ``named_parameters`` order) of each managed parameter that ``model`` holds
    under more than one name; parameters with one name are left out."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param in manager.slot_of:
            names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


@contextlib.contextmanager
def full_parameters(model: torch.nn.Module, *, writeback: bool = False):
    """Unshard every chunk so parameters can be read (and, with ``writeback=True``, written) outside
    forward/backward. Collective under torch.distributed (every rank enters).

    With ``writeback=False`` (as FSDP's ``summon_full_params``) in-place edits are discarded on exit:
    the gathered copies are marked stale, so the next use gathers the shards again and parameters are
    stale placeholders until then. Where the chunk *is* the optimizer's fp32 parameter storage (kept
    whole on the device: one rank, or replicated placement), it is copied to the host on entry and
    restored on exit (host memory for those chunks, for the duration of the context).

    Between steps a parameter whose chunk is resharded, offloaded or stale is a placeholder that raises
    :class:`~hf_elixir.chunk.params.StaleParameterError` on any read or write ([Note: stale placeholder]
    in chunk/params.py). Use this, or ``model.state_dict()``, to look at weights. Same role as FSDP's
    ``summon_full_params`` and DeepSpeed's ``GatheredParameters``.

    Args:
        model: a model prepared by :func:`hf_elixir.prepare`.
        writeback: copy in-place edits of the parameters back into the shards (and the fp32 masters).

    Raises:
        DeviceBudgetExceededError: the whole model does not fit the device budget at once.
        CollectiveEntryError: some rank of the model did not enter it within ``HF_ELIXIR_COLLECTIVE_TIMEOUT_S``
            seconds ([Note: collective entry check] in _entry_check.py).
    """
    state = get_state(model)
    manager = state.manager
    check_model_entry("hf_elixir.full_parameters(model)", state)
    # writes made through current parameters before the context: in the shards and masters, so that
    # writeback=False discards only what is written inside it ([Note: parameter writes] in chunk/_chunk_params.py)
    manager.take_param_writes()
    pinned = []
    try:
        for chunk in manager.chunks:
            _ensure_full(manager, chunk)
            chunk.pins += 1
            pinned.append(chunk)
        snapshots = {} if writeback else _snapshot_parameter_storage(manager, state.optimizer)
        yield model
        if writeback:
            for chunk in manager.chunks:
                chunk.write_back()
            if state.optimizer is not None:  # element by element: the masters of what was not edited stay as they were
                state.optimizer.merge_param_writes(list(manager.chunks))
                state.optimizer.release_disk_pages()
        else:
            _discard_edits(manager, state.optimizer, snapshots)
    finally:
        for chunk in pinned:
            chunk.pins -= 1
    if not writeback:
        manager.hide_stale()


def _masters(optimizer) -> dict[int, torch.Tensor]:
    """Chunk id -> the optimizer's fp32 master shard (none without an optimizer)."""
    return getattr(optimizer, "masters", {}) if optimizer is not None else {}


def _snapshot_parameter_storage(manager: ChunkManager, optimizer) -> dict[int, torch.Tensor]:
    """Host copies of the chunks that are themselves the parameters' only copy (whole on the device,
    no separate shard or master), and of shards that live inside the gathered copy, so
    ``writeback=False`` can restore them."""
    masters = _masters(optimizer)

    def only_copy(chunk) -> bool:
        master = masters.get(chunk.chunk_id)
        return chunk.full_alias and (master is None or master is chunk.full)

    snapshots = {c.chunk_id: c.full.detach().to("cpu", copy=True) for c in manager.chunks if only_copy(c)}
    # a resident sharded chunk's shard is a view into its gathered copy (Chunk.shard_in_full): keep it too
    snapshots.update({c.chunk_id: c.shard.detach().to("cpu", copy=True) for c in manager.chunks if c.shard_in_full})
    return snapshots


def _discard_edits(manager: ChunkManager, optimizer, snapshots: dict[int, torch.Tensor]) -> None:
    """Forget whatever was written into the gathered copies (``full_parameters(writeback=False)``)."""
    masters = _masters(optimizer)
    with torch.no_grad(), host_copies():
        for chunk in manager.chunks:
            # the edits are forgotten, not taken later ([Note: parameter writes] in chunk/_chunk_params.py)
            chunk.stamp_params()
            if chunk.shard_in_full:
                chunk.shard.copy_(snapshots[chunk.chunk_id])
                chunk.full_version = -1  # the other ranks' slices: gathered again at the next use
            elif chunk.chunk_id in snapshots:
                chunk.full.copy_(snapshots[chunk.chunk_id])
            elif not chunk.full_alias:
                chunk.full_version = -1  # stale: the next use refills from the untouched shard
                chunk.host_full_version = -1  # and not from a rank-local host copy of the edited buffer
            elif masters.get(chunk.chunk_id) is not None:
                chunk.full.copy_(masters[chunk.chunk_id])  # the fp32 master is the untouched copy
