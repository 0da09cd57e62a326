"""What a prepared model exports under mixed precision: the optimizer's fp32 masters, or the compute copy.

[Note: fp32 exports] Under ``precision="bf16"``/``"fp16"`` the chunks hold the compute copy (8 or 11 bits of
mantissa) and the optimizer holds the trained values, the fp32 masters, one shard per rank. PyTorch AMP, the
Trainer's ``bf16=True`` and FSDP2's ``MixedPrecisionPolicy`` keep fp32 parameters and save them; a bf16 export
of a fine-tuned model loses every update smaller than the bf16 rounding step of its weight. So
``model.state_dict()`` (and everything built on it: ``save_pretrained``, the Trainer's ``save_model``,
``accelerator.get_state_dict``, ``hf_elixir.save_checkpoint``, ``hf_elixir.parallel.gather_full_state_dict``)
writes the masters by default (``ElixirConfig.export_dtype="fp32"``):

* a trainable parameter's value is its slice of the chunk's master, all-gathered over the chunk's group (a
  collective, in module order like the unshards ``state_dict`` already does; masters on the host go to the
  device for it, as NCCL needs) and copied to the host, one fp32 chunk at a time, cached for the one
  ``state_dict()`` call;
* a managed parameter without a master (frozen: LoRA's base weights) is its compute copy upcast (exact), so
  the file has one floating dtype and ``config.json`` can name it;
* a model prepared without an optimizer has no masters: it writes its compute copy (an upcast would double
  the file and add nothing), as ``export_dtype="compute"`` does.

``save_pretrained`` sets ``config.json``'s ``dtype`` from ``model.dtype``, the dtype of the first parameter
(the compute copy): the instance's ``save_pretrained`` is wrapped to write the dtype of what it wrote
(the ``state_dict=`` it was given, else this export dtype) into ``config.json`` after it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_elixir._compat import all_gather_single
from hf_elixir.chunk._carriers import is_carrier_name
from hf_elixir.chunk.strict import host_copies, register_host, to_device, to_host
from hf_elixir.runtime._entry_check import checked_call
from hf_elixir.runtime._state import get_state

__all__ = ["MasterExport", "exports_masters", "install_config_dtype", "load_fp32_masters"]


def exports_masters(state) -> bool:
    """Does ``state``'s model write fp32 masters ([Note: fp32 exports])? Needs an optimizer (the masters'
    owner), a low compute precision and ``export_dtype="fp32"``."""
    config = state.config
    return state.optimizer is not None and config.precision != "fp32" and config.export_dtype == "fp32"


def _full_master(manager, chunk, master: torch.Tensor) -> torch.Tensor:
    """The whole chunk's fp32 master (``[chunk_numel]``, a host copy); a collective over ``chunk.group`` when the
    chunk is sharded over several ranks."""
    if chunk.world_size == 1:  # one rank, or replicated: the master covers the whole chunk
        return to_host(master)
    full = torch.empty(chunk.chunk_numel, dtype=torch.float32, device=manager.compute_device)
    all_gather_single(full, to_device(master.detach(), manager.compute_device), group=chunk.group)
    return to_host(full)


class MasterExport:
    """The values ``model.state_dict()`` writes for a prepared model's managed parameters ([Note: fp32 exports]).

    One per prepared model. :meth:`begin` / :meth:`end` bracket a root ``state_dict()`` call (its root pre- and
    post-hooks): inside, each chunk's master is gathered once; a submodule's ``state_dict()`` gathers per call.
    """

    def __init__(self, model: torch.nn.Module, manager) -> None:
        self._model = model
        self._manager = manager
        self._cache: dict[int, torch.Tensor] | None = None

    def _state(self):
        try:
            return get_state(self._model)
        except ValueError:  # being prepared: the state is attached after the hooks
            return None

    def _settle(self, state) -> None:
        # masters as the optimizer's next step sees them: speculative host steps undone, parameter writes merged
        state.optimizer.settle_host_steps()
        self._manager.take_param_writes()

    def begin(self) -> None:
        state = self._state()
        self._cache = None
        if state is not None and exports_masters(state):
            self._settle(state)
            self._cache = {}

    def end(self) -> None:
        state = self._state()
        if self._cache and state is not None:
            state.optimizer.release_disk_pages()  # and what read faults mapped around them meanwhile
        self._cache = None

    def value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s exported value: a new host tensor of its shape (the chunk must be unsharded, as the
        ``state_dict`` pre-hook leaves it)."""
        state = self._state()
        if state is None or not exports_masters(state):
            return to_host(param.detach())
        manager = self._manager
        chunk = manager.chunk_of[param]
        master = state.optimizer.masters.get(chunk.chunk_id)
        if master is None and is_carrier_name(manager.slot_of[param].name, False):
            # packed NF4 bytes, never upcast: fp32 -> bf16 would rewrite their NaN patterns ([Note: NF4 in chunks])
            return to_host(param.detach())
        if master is None:  # frozen: no master, the compute copy upcast exactly
            return register_host(to_host(param.detach()).float())
        cache = self._cache
        full = cache.get(chunk.chunk_id) if cache is not None else None
        if full is None:
            if cache is None:
                self._settle(state)
            full = _full_master(manager, chunk, master)
            state.optimizer.release_disk_pages(chunk.chunk_id)  # a master read from the disk tier: out again
            if cache is not None:
                cache[chunk.chunk_id] = full
        slot = manager.slot_of[param]
        # a copy per parameter: tensors sharing a storage read as tied weights to save_pretrained and safetensors
        return register_host(full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone())

    def dtype(self) -> torch.dtype:
        """The floating dtype :meth:`value` writes."""
        state = self._state()
        if state is not None and exports_masters(state):
            return torch.float32
        chunks = self._manager.chunks
        return chunks[0].dtype if chunks else torch.float32


class _RestoreAttribute:
    """A removable handle that deletes an instance attribute it set (the class method shows again)."""

    def __init__(self, obj, name: str, value) -> None:
        self._obj, self._name, self._value = obj, name, value

    def remove(self) -> None:
        if self._obj.__dict__.get(self._name) is self._value:
            del self._obj.__dict__[self._name]


def _written_dtype(state_dict) -> torch.dtype | None:
    """The dtype of the first floating tensor of ``state_dict`` (how ``PreTrainedModel.dtype`` reads a model)."""
    for value in (state_dict or {}).values():
        if torch.is_tensor(value) and value.is_floating_point():
            return value.dtype
    return None


def install_config_dtype(model: torch.nn.Module, export: MasterExport):
    """Wrap ``model.save_pretrained`` (an instance attribute over whatever is there, e.g. the parallel save guard)
    so that ``config.json``'s ``dtype`` names the dtype written ([Note: fp32 exports]). Returns a removable handle,
    or ``None`` for a model without ``save_pretrained``."""
    original = getattr(model, "save_pretrained", None)
    if not callable(original) or getattr(model, "config", None) is None:
        return None

    collective = getattr(original, "collective", False)  # the parallel save guard: ends in a barrier

    def save_pretrained(save_directory, *args, state_dict=None, is_main_process=True, **kwargs):
        with checked_call("model.save_pretrained(...)", label=True):  # names it in a collective entry error
            result = original(save_directory, *args, state_dict=state_dict, is_main_process=is_main_process,
                              **kwargs)
        written = _written_dtype(state_dict) or export.dtype()
        on_this_rank = getattr(model, "should_save_on_this_rank", lambda main: main)(is_main_process)
        if on_this_rank and os.path.isfile(os.path.join(save_directory, "config.json")):
            model.config.dtype = str(written).split(".")[1]
            model.config.save_pretrained(save_directory)
        if collective and state_dict is None and dist.is_available() and dist.is_initialized():
            # [Note: fp32 exports] the guard's barrier came before this rewrite of config.json: without a second
            # one, another rank may read the folder (from_pretrained) while rank 0 is still writing it
            dist.barrier()
        return result

    save_pretrained.__doc__ = getattr(original, "__doc__", None)
    model.save_pretrained = save_pretrained
    return _RestoreAttribute(model, "save_pretrained", save_pretrained)


@torch.no_grad()
def load_fp32_masters(manager, optimizer, loaded: dict) -> None:
    """[Note: fp32 loads] ``model.load_state_dict(sd)`` copies ``sd`` into the compute copy (rounding fp32 values
    to bf16/fp16), and the optimizer then refreshes its masters from that copy; an fp32 ``sd`` (what
    [Note: fp32 exports] writes) would come back rounded. After that refresh, this writes each fp32 value of
    ``loaded`` (parameter -> its fp32 tensor from ``sd``) into this rank's part of the parameter's master, so a
    save and load round trip keeps the masters bit for bit. Other floating values the compute dtype cannot hold
    (an fp16 or float64 checkpoint into a bf16 model) are written the same way, cast to fp32 as PyTorch's fp32
    parameters take them. The compute copy already holds the same values
    rounded (the same round-to-nearest cast). Local: each rank writes its own shard."""
    for param, value in loaded.items():
        chunk = manager.chunk_of[param]
        master = optimizer.masters.get(chunk.chunk_id)
        compute = chunk.full if chunk.full_alias else chunk.shard
        if master is None or master.dtype != torch.float32 or master is compute:
            continue  # frozen, or the compute copy is the master (fp32): the load wrote it already
        slot = manager.slot_of[param]
        begin = chunk.shard_begin if master.numel() == chunk.shard_numel else 0
        lo, hi = max(slot.offset, begin), min(slot.offset + slot.numel, begin + master.numel())
        if hi <= lo:
            continue
        flat = value.detach().reshape(-1)[lo - slot.offset:hi - slot.offset]
        with host_copies():
            master[lo - begin:hi - begin].copy_(flat)
