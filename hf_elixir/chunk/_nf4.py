"""QLoRA: a frozen base quantized to NF4 with torchao, stored packed in its chunks and dequantized where it is used.

[Note: NF4 in chunks] A QLoRA user quantizes the frozen base as torchao and torchtune do
(``linear.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)``, or torchao's
``NF4WeightOnlyConfig``), adds adapters with peft (``get_peft_model``) and trains. ``NF4Tensor`` is a wrapper subclass
over five inner tensors (``quantized_data``: two 4-bit codes per byte; ``quantized_scalers``: one int8 absmax per
``block_size`` elements; ``quantization_factor``: one scale of those per ``scaler_block_size`` blocks; ``scaler_mean``;
the 16-value code book ``nf4``), which a chunk (a 1-D buffer of one dtype) cannot hold as a view. So ``prepare``
(:func:`pack_nf4_params`) replaces each NF4 parameter by a frozen **carrier**: a 1-D parameter of the chunks' compute
dtype whose bytes are the packed inner tensors (the first four, each at an 8-byte aligned offset, ``_NF4Layout``),
and registers a ``torch.nn.utils.parametrize`` parametrization on the module (:class:`NF4Weight`), so
``module.weight`` still reads as the same ``NF4Tensor``. The carrier is an ordinary frozen parameter to every layer:
it is packed, sharded, offloaded, all-gathered and placed as bytes (copies of one dtype, and gathers, move bits
unchanged; a frozen chunk has no optimizer, cast or arithmetic), and costs what ``--quantize nf4`` prices
(:func:`nf4_bytes_per_element`, the one formula both read) plus at most 16 bytes per tensor (alignment and the
scales' mean). The code book is a constant of torchao (kept on the parametrization, not in chunks). ``state_dict``
exports a carrier in the compute dtype, never upcast (``hf_elixir/runtime/_exports.py``), for the reason below, and
writes it as the plain model does: the ``NF4Tensor`` under ``<module>.weight`` ([Note: NF4 state_dict names] in
``_nf4_state_dict.py``).

The parametrization runs as a module (``ParametrizationList.__call__``), so the carrier's unit hooks unshard its
chunk exactly when the module reads ``weight``, during forward and during recomputation. It returns an ``NF4Tensor``
over a *copy* of the packed bytes (0.52 B/param): torchao's ``F.linear`` (``LinearNF4``) saves that tensor for
backward and dequantizes it in the forward and again in the backward, as on plain PyTorch, so the adapters'
gradients are peft's QLoRA's bit for bit, and the chunk may be resharded as soon as the read is done (a view into the
chunk would be freed before the backward reads it). The copy lives from the layer's forward to its backward
(activation memory; under activation checkpointing it is made again in the recomputation instead).

[Note: carriers in frozen chunks] A chunk with any trained parameter has fp32 masters for its whole shard, which the
optimizer steps (``lr`` 0 on frozen elements) and casts back into the compute copy. Bytes that read as NaN or inf in the
compute dtype do not survive that: fp32 -> bf16 turns every NaN into the one canonical NaN (``c10::BFloat16``), and
``inf * 0`` is NaN. With bf16 compute, 10 of 14 NF4 weights of the test's Llama came back with other codes after
three steps when carriers shared chunks with the adapters. So carriers, as every frozen parameter, are packed in
communication buckets of their own ([Note: frozen chunks apart] in ``_frozen_apart.py``; the search's packing splits
the same way): their chunks hold no trained parameter, so no master, optimizer step, cast or gradient buffer ever
touches them.

Refused with the parameter's name: an NF4 parameter that requires grad (the base is frozen in QLoRA), one whose inner
tensors do not match its block sizes, one tied under two names, streamed init from a checkpoint, and a tensor- or
expert-parallel model (a split would cut through the packed blocks).
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize

from hf_elixir.chunk._build import COMPUTE_DTYPES

__all__ = ["NF4Weight", "is_nf4", "nf4_bytes_per_element", "nf4_packed_bytes", "pack_nf4_params", "packed_nf4"]

#: torchao's ``to_nf4`` defaults
NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE = 64, 256
#: modules where torchao has defined ``NF4Tensor`` (0.18; older releases)
_NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")
_ALIGN_BYTES = 8
_FIX = ("QLoRA keeps the base frozen: quantize with `module.weight = torch.nn.Parameter(to_nf4(module.weight."
        "detach()), requires_grad=False)` (torchao's defaults block_size=64, scaler_block_size=256) and train the "
        "peft adapters")


def nf4_packed_bytes(numel: int, scale_bytes: int, block_size: int = NF4_BLOCK_SIZE,
                     scaler_block_size: int = NF4_SCALER_BLOCK_SIZE) -> float:
    """Bytes torchao's NF4 storage of ``numel`` elements takes, without the per-tensor constants: ``numel / 2``
    codes, ``numel / block_size`` int8 scales, ``numel / (block_size * scaler_block_size)`` scales of those in the
    weight's dtype (``scale_bytes`` each). [Note: NF4 in chunks]; the planner prices the same ([Note: NF4 pricing]
    in ``hf_elixir/cli/_plan.py``)."""
    return numel / 2 + numel / block_size + numel * scale_bytes / (block_size * scaler_block_size)


def nf4_bytes_per_element(scale_bytes: int, block_size: int = NF4_BLOCK_SIZE,
                          scaler_block_size: int = NF4_SCALER_BLOCK_SIZE) -> float:
    """:func:`nf4_packed_bytes` per element (0.515747 B with bf16 scales at torchao's defaults)."""
    return nf4_packed_bytes(1, scale_bytes, block_size, scaler_block_size)


def _nf4_module():
    """torchao's NF4 module, if something imported it (no NF4 tensor can exist otherwise)."""
    return next((sys.modules[m] for m in _NF4_MODULES if m in sys.modules), None)


def is_nf4(tensor) -> bool:
    """Is ``tensor`` torchao's ``NF4Tensor`` (a parameter of one)?"""
    module = _nf4_module()
    return module is not None and isinstance(tensor, module.NF4Tensor)


def _align(value: int) -> int:
    return -(-value // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass(frozen=True)
class _NF4Layout:
    """Where one NF4 tensor's inner tensors sit in its carrier's bytes, and what rebuilds the ``NF4Tensor``.

    Attributes:
        parts: ``(attribute, byte offset, shape, dtype)`` of ``quantized_data``, ``quantized_scalers``,
            ``quantization_factor``, ``scaler_mean`` in the carrier's bytes.
        packed_bytes: the bytes they end at (the carrier rounds up to its element size).
    """

    parts: tuple
    packed_bytes: int
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype
    block_size: int
    n_blocks: int
    scaler_block_size: int

    @staticmethod
    def of(nf4) -> "_NF4Layout":
        parts, cursor = [], 0
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            inner = getattr(nf4, attr)
            cursor = _align(cursor)
            parts.append((attr, cursor, tuple(inner.shape), inner.dtype))
            cursor += inner.numel() * inner.element_size()
        return _NF4Layout(tuple(parts), cursor, nf4.shape, tuple(nf4.stride()), nf4.dtype, nf4.block_size,
                          nf4.n_blocks, nf4.scaler_block_size)

    def carrier(self, nf4, dtype: torch.dtype) -> torch.Tensor:
        """The packed bytes of ``nf4`` as a 1-D tensor of ``dtype`` (zero padding at the end)."""
        element = torch.empty((), dtype=dtype).element_size()
        raw = torch.zeros(math.ceil(self.packed_bytes / element) * element, dtype=torch.uint8)
        for attr, offset, _, _ in self.parts:
            src = getattr(nf4, attr).detach()
            # dense (torchao's quantization_factor is a strided view)
            inner = torch.empty(src.numel(), dtype=src.dtype).copy_(src.reshape(-1))
            raw[offset:offset + inner.numel() * inner.element_size()] = inner.view(torch.uint8)
        return raw.view(dtype)

    def unpack(self, raw: torch.Tensor, nf4_codes: torch.Tensor):
        """The ``NF4Tensor`` over ``raw`` (the packed bytes, ``uint8``, owned by the result) and ``nf4_codes`` (on
        ``raw``'s device)."""
        module = _nf4_module()
        inner = {}
        for attr, offset, shape, dtype in self.parts:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            inner[attr] = raw[offset:offset + nbytes].view(dtype).view(shape)
        meta = module.SubclassTensorArgs(self.shape, self.stride, 0, self.dtype, raw.device, False)
        return module.NF4Tensor(meta, self.block_size, self.n_blocks, self.scaler_block_size,
                                inner["quantized_scalers"], inner["quantization_factor"], inner["scaler_mean"],
                                inner["quantized_data"], nf4_codes)


class NF4Weight(torch.nn.Module):
    """The parametrization that reads an NF4 weight out of its carrier ([Note: NF4 in chunks]).

    Args:
        layout: where the inner tensors sit in the carrier's bytes.
        nf4_codes: torchao's 16-value code book of the weight (``NF4Tensor.nf4``).
        carrier_dtype: the carrier's dtype (the chunks' compute dtype).
        state_names: the module's parameter names, in order, before the carrier took the weight's place (the order
            of its ``state_dict`` keys on plain PyTorch: [Note: NF4 state_dict names] in ``_nf4_state_dict.py``).
    """

    def __init__(self, layout: _NF4Layout, nf4_codes: torch.Tensor, carrier_dtype: torch.dtype = torch.float32,
                 state_names: tuple = ()) -> None:
        super().__init__()
        self.layout = layout
        self.nf4_codes = nf4_codes.detach().clone()
        self.carrier_dtype = carrier_dtype
        self.state_names = tuple(state_names)
        self._codes_on: dict[torch.device, torch.Tensor] = {}  # the code book on each device read from (one copy)

    def forward(self, carrier: torch.Tensor):
        raw = carrier.detach().view(torch.uint8)[:self.layout.packed_bytes].clone()
        codes = self._codes_on.get(raw.device)
        if codes is None:
            codes = self._codes_on[raw.device] = self.nf4_codes.to(raw.device)
        return self.layout.unpack(raw, codes)


def _check(name: str, param, names: list[str]) -> None:
    """Refuse an NF4 parameter the carrier cannot stand for (names the parameter, the value and the fix)."""
    if param.requires_grad:
        raise ValueError(f"NF4 parameter {name!r} has requires_grad=True: an NF4 weight cannot be trained (its "
                         f"values are 4-bit codes); {_FIX}")
    if len(names) > 1:
        raise ValueError(f"NF4 parameter {name!r} is tied under {names}: hf_elixir stores an NF4 weight packed for "
                         "one module; untie it or keep that weight unquantized")
    numel = param.numel()
    expected = {"quantized_data": numel // 2, "quantized_scalers": numel // max(param.block_size, 1),
                "quantization_factor": numel // max(param.block_size * param.scaler_block_size, 1)}
    for attr, want in expected.items():
        got = getattr(param, attr).numel()
        if got != want or numel % 2 or numel % (param.block_size * param.scaler_block_size):
            raise ValueError(f"NF4 parameter {name!r} (shape {tuple(param.shape)}, block_size={param.block_size}, "
                             f"scaler_block_size={param.scaler_block_size}) has {attr} of {got} elements where "
                             f"{want} are expected: its numel {numel} must be a multiple of block_size * "
                             "scaler_block_size; quantize it again with to_nf4(weight, block_size, scaler_block_size) "
                             "whose product divides the weight's numel, or keep that weight unquantized")


def _refuse_setting(name: str, checkpoint, pstate) -> None:
    if checkpoint is not None:
        raise ValueError(f"NF4 parameter {name!r} with hf_elixir.prepare(checkpoint={str(checkpoint)!r}): streamed "
                         "init reads dense weights; load the model, quantize it, then prepare without checkpoint=")
    if pstate is not None:
        raise ValueError(f"NF4 parameter {name!r} in a model rewritten by hf_elixir.parallel.parallelize: tensor and "
                         "expert parallel would split the packed NF4 blocks; shard it with the default placement "
                         "(ZeRO chunks) or keep tensor-parallel weights unquantized")


def pack_nf4_params(model: torch.nn.Module, config, checkpoint=None, pstate=None):
    """Replace every NF4 parameter of ``model`` by its carrier in ``config.precision``'s dtype and register an
    :class:`NF4Weight` parametrization that reads it ([Note: NF4 in chunks]). All or nothing.

    Returns:
        a callable that undoes it (the NF4 parameters back in place).

    Raises:
        ValueError: an NF4 parameter that requires grad, does not match its block sizes or is tied; NF4 with
            ``checkpoint`` or a parallelized model (each names the parameter and the fix).
    """
    names: dict = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if is_nf4(param):
            names.setdefault(param, []).append(name)
    for param, param_names in names.items():
        _check(param_names[0], param, param_names)
        _refuse_setting(param_names[0], checkpoint, pstate)
    done: list = []

    def undo() -> None:
        for module, attr, param in reversed(done):
            if parametrize.is_parametrized(module, attr):
                parametrize.remove_parametrizations(module, attr, leave_parametrized=False)
            module._parameters[attr] = param
        done.clear()

    dtype = COMPUTE_DTYPES[config.precision]
    try:
        for param, (name, *_) in names.items():
            module = model.get_submodule(name.rpartition(".")[0])
            attr = name.rpartition(".")[2]
            layout = _NF4Layout.of(param)
            state_names = tuple(module._parameters)
            module._parameters[attr] = torch.nn.Parameter(layout.carrier(param, dtype).to(param.device),
                                                          requires_grad=False)
            done.append((module, attr, param))
            parametrize.register_parametrization(module, attr, NF4Weight(layout, param.nf4, dtype, state_names),
                                              unsafe=True)
    except BaseException:
        undo()
        raise
    return undo


@contextlib.contextmanager
def packed_nf4(model: torch.nn.Module, config):
    """``model`` as ``prepare`` lays it out while the block runs: its NF4 parameters as their carriers (what
    ``min_device_budget_bytes`` prices), put back after. Raises as :func:`pack_nf4_params`."""
    undo = pack_nf4_params(model, config)
    try:
        yield
    finally:
        undo()
