"""Streamed init: read only the byte ranges a rank needs from a Hugging Face folder's safetensors files.

[Note: streamed init] ``prepare(model_on_meta, ..., checkpoint=folder)`` never materialises the whole
model on any rank (what DeepSpeed's ``zero.Init`` and FSDP2's meta-device init avoid too). Each rank
fills its own shard of each chunk from the files: a chunk shard ``[lo, hi)`` (chunk elements) covers
parts of one or more parameters, possibly starting or ending mid-tensor. For each covered parameter
the reader asks ``safetensors`` for the rows that cover the flat range
(``safe_open(...).get_slice(name)[row_begin:row_end]``, a view of the memory-mapped file: only the
touched pages are read) and cuts the flat range out of them. So a rank reads its shard's bytes plus at
most one row on each side of each cut, never a whole parameter it does not own.

Names: a parameter the folder stores in another layout (today's MoE experts, written per expert) is built
by transformers' own weight converters one expert at a time ([Note: converted tensors] in
``_converted_load.py``). Otherwise a parameter is looked up under its canonical name, then its aliases (tied weights: the same
``nn.Parameter`` under two names, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``; a
file written by ``save_pretrained`` keeps only one), then each of those with the model's
``base_model_prefix`` added or removed (a base-model checkpoint loaded into a head model, or back).

Model side (:class:`StreamedInit`): every parameter's tensor is found and its shape checked before
anything moves; parameters on the meta device are swapped (``torch.utils.swap_tensors``, so their
identity, which optimizers and tied modules hold, is kept) for memory-less CPU placeholders the chunks
then re-point at views (tied weights are re-tied first: :func:`retie`); buffers still on the meta
device are read from the files when persistent and saved, and otherwise rebuilt by the model's own
``_init_weights`` (a Hugging Face model recomputes rotary ``inv_freq`` there), as ``from_pretrained`` does for keys missing from a checkpoint.

[Note: streamed tensor-parallel shards] A model rewritten for tensor parallel before ``prepare`` (on the meta
device: ``parallelize`` splits meta tensors, no data) holds this rank's slice of some parameters, while the
folder holds the full tensors transformers wrote. ``prepare`` passes each split parameter's
:class:`TensorShard` (the dim, the fused parts, this rank's index, the tp size and the full size, which the
ranks need not divide: [Note: uneven tensor-parallel slices] in ``_tp_slices.py``); the reader maps a
flat range of the local slice back to the file: a split along dim 0 is a contiguous range of the full
tensor (one per fused part), and a split along a later dim keeps dim 0, so the rows covering the range
are read and this rank's columns cut out of them. A rank reads its own rows, never the whole tensor.

Source: the safetensors format (a little-endian u64 header size, a JSON header with dtype, shape and
data offsets per tensor, then the raw bytes) and its ``safe_open``/``get_slice`` API; Hugging Face's
sharded layout (``model.safetensors.index.json`` with a ``weight_map`` from tensor name to file).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_elixir.chunk._converted_load import check_converted, converted_sources
from hf_elixir.chunk._load_report import initial_values, mismatch_error, missing_error, warn_unexpected
from hf_elixir.chunk._tp_slices import tp_slice

__all__ = ["EXPERT_ROWS_ATTR", "CheckpointReader", "SlotSource", "StreamedInit", "TensorShard",
           "meta_parameter_names", "read_chunk_range", "read_local", "resolve_sources", "retie"]

logger = logging.getLogger(__name__)

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorShard:
    """A parameter that holds one tensor-parallel rank's slice of the tensor in the folder.

    Attributes:
        dim: the split dim. parts: the full tensor is ``parts`` equal pieces along ``dim``, each split over
            the ranks (GPT-2's fused q|k|v: 3). rank / size: this rank's index in the tp group and its size.
        full_size: the full tensor's size along ``dim`` (all parts); the ranks need not divide it (see
            [Note: uneven tensor-parallel slices] in ``_tp_slices.py``).
    """

    dim: int
    parts: int
    rank: int
    size: int
    full_size: int

    def part_slice(self) -> tuple[int, int]:
        """``(start, length)`` of this rank's features inside one packed part."""
        return tp_slice(self.full_size // self.parts, self.rank, self.size)

    def full_shape(self, local: torch.Size) -> torch.Size:
        shape = list(local)
        shape[self.dim] = self.full_size
        return torch.Size(shape)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a whole tensor, or whole rows of it for ``dim >= 1``)."""
        start, length = self.part_slice()
        pieces = full.chunk(self.parts, dim=self.dim)
        return torch.cat([p.narrow(self.dim, start, length) for p in pieces], dim=self.dim)


@dataclass(frozen=True)
class SlotSource:
    """One parameter's place in a chunk and the tensor in the folder it is read from.

    Attributes:
        key: the tensor's name in the folder's files.
        offset / numel: element range ``[offset, offset + numel)`` inside the chunk.
        base: the parameter's first element inside the file's tensor (``0`` unless it holds a slice of it).
    """

    key: str
    offset: int
    numel: int
    shard: TensorShard | None = None
    base: int = 0  # first element of the tensor this parameter holds (an expert-parallel slice: its first expert)


class CheckpointReader:
    """Reads tensors, or flat element ranges of them, from a Hugging Face folder's safetensors files.

    Args:
        folder: a folder with ``model.safetensors``, or with ``model.safetensors.index.json`` and the
            shard files it names (``save_pretrained`` writes either).

    Attributes:
        bytes_read: bytes of tensor data requested so far (the rows covering each requested range).

    Raises:
        FileNotFoundError: the folder is missing, or holds no safetensors weights (e.g. only
            ``pytorch_model.bin``: re-save it with ``save_pretrained(folder, safe_serialization=True)``).

    Use as a context manager (or call :meth:`close`): open files stay memory-mapped until then.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"checkpoint={str(folder)!r} is not a folder; pass a Hugging Face model folder "
                                    "(written by save_pretrained) holding model.safetensors")
        index = self.folder / _INDEX
        self._handles: dict[Path, object] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"checkpoint file {str(index)!r} is not a safetensors index (JSON with a "
                                 f"'weight_map': {type(err).__name__}: {err}); re-save the model with "
                                 "save_pretrained(folder)") from err
            self._file_of = {key: self.folder / name for key, name in weight_map.items()}
        elif (self.folder / _SINGLE).is_file():
            self._file_of = {key: self.folder / _SINGLE for key in self._open(self.folder / _SINGLE).keys()}
        else:
            found = sorted(p.name for p in self.folder.iterdir())[:10]
            raise FileNotFoundError(
                f"checkpoint={str(folder)!r} holds neither {_SINGLE} nor {_INDEX} (found {found}); streamed "
                "loading reads safetensors only: re-save the model with save_pretrained(folder) "
                "(safe_serialization is the default)")
        self.bytes_read = 0
        #: target name -> ConvertedSource: tensors built by transformers' converters ([Note: converted tensors])
        self.converted: dict = {}
        #: target name -> the key it is stored under (a transformers ``WeightRenaming``)
        self.renamed: dict[str, str] = {}
        #: key -> a value the folder lacks, given in memory (a missing parameter's initial value)
        self.given: dict[str, torch.Tensor] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop every open file (their memory maps go with the last tensor viewing them)."""
        self._handles.clear()

    def keys(self) -> set[str]:
        """The tensor names in the folder's files (not the converted targets)."""
        return set(self._file_of)

    def _open(self, path: Path):
        """``safe_open(path)``, kept open until :meth:`close`; an unreadable file raises naming it."""
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import SafetensorError, safe_open  # noqa: PLC0415 (optional dependency of this path)

            try:
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ValueError(f"checkpoint file {str(path)!r} cannot be read as safetensors ({err}): it is "
                                 "missing, truncated or corrupt; re-save the model with save_pretrained(folder) or "
                                 "copy the file again") from err
        return handle

    def _handle(self, key: str):
        return self._open(self._file_of[key])

    def file_name(self, key: str) -> str:
        """The file (name inside the folder) that holds ``key``; for a converted tensor, its first source's."""
        if key in self.converted:
            key = next(iter(self.converted[key].sources.values()))[0]
        path = self._file_of.get(key)
        return path.name if path is not None else "memory"

    def resolve(self, names: list[str], prefix: str = "") -> str | None:
        """The first of ``names`` (then each with ``prefix + "."`` added or removed) the files hold."""
        candidates = list(names)
        if prefix:
            dotted = prefix + "."
            candidates += [n[len(dotted):] if n.startswith(dotted) else dotted + n for n in names]
        found = next((n for n in candidates if n in self._file_of or n in self.converted or n in self.renamed), None)
        return self.renamed.get(found, found)

    def shape(self, key: str) -> torch.Size:
        if key in self.given:
            return self.given[key].shape
        if key in self.converted:
            return self.converted[key].shape
        return torch.Size(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a copy in its file dtype; for buffers and small tensors)."""
        if key in self.given:
            return self.given[key].clone()
        if key in self.converted:
            return self.read_flat(key, 0, math.prod(self.shape(key))).reshape(self.shape(key)).clone()
        tensor = self._handle(key).get_tensor(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.clone()

    def read_block(self, key: str, row_begin: int, row_end: int, col_begin: int, col_end: int) -> torch.Tensor:
        """Rows ``[row_begin, row_end)`` x columns ``[col_begin, col_end)`` of the 2-D tensor ``key`` (file dtype)."""
        block = self._handle(key).get_slice(key)[row_begin:row_end, col_begin:col_end]
        self.bytes_read += block.numel() * block.element_size()
        return block

    def read_flat(self, key: str, begin: int, end: int) -> torch.Tensor:
        """Elements ``[begin, end)`` of tensor ``key`` flattened in row-major order.

        Reads only the rows (slices along dim 0) that cover the range, then cuts it out.

        Returns:
            a 1-D tensor of ``end - begin`` elements in the file's dtype, viewing the memory-mapped
            file (copy it where it must outlive the reader).
        """
        if key in self.converted:  # built expert by expert ([Note: converted tensors])
            return self.converted[key].read_flat(self._read_whole, begin, end)
        if key in self.given:
            return self.given[key].reshape(-1)[begin:end]
        view = self._handle(key).get_slice(key)
        shape = view.get_shape()
        numel = math.prod(shape)
        assert 0 <= begin <= end <= numel, f"range [{begin}, {end}) outside {key!r} of {numel} elements"
        if begin == end:
            return torch.empty(0)
        if len(shape) == 0:
            rows, first = view[...].reshape(-1), 0
        else:
            row_numel = numel // shape[0] if shape[0] else 1
            first, last = begin // row_numel, -(-end // row_numel)
            rows = view[first:last].reshape(-1)
            first *= row_numel
        self.bytes_read += rows.numel() * rows.element_size()
        return rows[begin - first:end - first]


    def _read_whole(self, key: str) -> torch.Tensor:
        """File tensor ``key`` (a view of the memory-mapped file), counted in :attr:`bytes_read`."""
        tensor = self._handle(key).get_tensor(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def add_converted(self, model: torch.nn.Module, wanted: dict[str, torch.Size]) -> None:
        """Register the parameters of ``wanted`` (name -> shape) that ``model``'s transformers conversion
        mapping builds from this folder's tensors, or finds under another name (see ``_converted_load.py``).

        Raises:
            ValueError: as :func:`~hf_elixir.chunk._converted_load.check_converted`.
        """
        converted, renamed = converted_sources(model, self.keys(), wanted)
        for target, source in converted.items():
            check_converted(source, lambda key: torch.empty(self.shape(key), device="meta"))  # shapes: no read
            self.converted[target] = source
        self.renamed.update(renamed)


def _read_shard_flat(reader: CheckpointReader, key: str, begin: int, end: int, shard: TensorShard) -> torch.Tensor:
    """Elements ``[begin, end)`` of this rank's slice of tensor ``key``, flattened (see [Note: streamed
    tensor-parallel shards])."""
    full_shape = reader.shape(key)
    start, length = shard.part_slice()
    if shard.dim == 0:  # each fused part's slice is one contiguous range of the full tensor
        inner = math.prod(full_shape[1:])
        block = length * inner  # this rank's elements of one part
        out = []
        for part in range(begin // block, -(-end // block)):
            lo, hi = max(begin, part * block), min(end, (part + 1) * block)
            first = (part * (full_shape[0] // shard.parts) + start) * inner
            out.append(reader.read_flat(key, first + lo - part * block, first + hi - part * block))
        return torch.cat(out) if len(out) > 1 else out[0]
    local = list(full_shape)
    local[shard.dim] = length * shard.parts
    row_numel = math.prod(local[1:])  # dim 0 is not split: local row i is full row i
    first, last = begin // row_numel, -(-end // row_numel)
    if shard.parts == 1 and len(full_shape) == 2:  # a row-parallel weight: only this rank's columns are read
        mine = reader.read_block(key, first, last, start, start + length).reshape(-1)
    else:
        rows = reader.read_flat(key, first * math.prod(full_shape[1:]), last * math.prod(full_shape[1:]))
        mine = shard.cut(rows.reshape(last - first, *full_shape[1:])).reshape(-1)
    return mine[begin - first * row_numel:end - first * row_numel]


def read_chunk_range(reader: CheckpointReader, sources: list[SlotSource], begin: int, end: int,
                     out: torch.Tensor) -> None:
    """Fill ``out`` (1-D, ``end - begin`` elements, any dtype/device) with chunk elements ``[begin, end)``.

    Elements no source covers (chunk padding) are set to zero; every covered element is read from the
    file (cast to ``out.dtype`` as ``Tensor.copy_`` does, which is what ``prepare`` does to a loaded
    parameter).
    """
    assert out.numel() == end - begin, f"out has {out.numel()} elements for range [{begin}, {end})"
    out.zero_()
    for src in sources:
        lo, hi = max(begin, src.offset), min(end, src.offset + src.numel)
        if lo >= hi:
            continue
        if src.shard is None:
            values = reader.read_flat(src.key, src.base + lo - src.offset, src.base + hi - src.offset)
        else:
            values = _read_shard_flat(reader, src.key, lo - src.offset, hi - src.offset, src.shard)
        out[lo - begin:hi - begin].copy_(values)


def meta_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s parameters on the meta device (tied ones once)."""
    seen: set[int] = set()
    names = []
    for name, param in model.named_parameters():
        if param.is_meta and id(param) not in seen:
            seen.add(id(param))
            names.append(name)
    return names


def retie(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Re-tie a Hugging Face model's weights (``model.tie_weights()``, as ``from_pretrained`` does after
    loading): accelerate's ``init_empty_weights()`` re-creates each registered parameter, so a model built
    under it has ``lm_head.weight`` and the input embedding as two meta parameters. The optimizer's
    param groups are pointed at the tied parameter (each parameter once)."""
    tie = getattr(model, "tie_weights", None)
    if tie is None:
        return
    before = dict(model.named_parameters(remove_duplicate=False))
    tie()
    after = dict(model.named_parameters(remove_duplicate=False))
    replaced = {id(before[n]): after[n] for n in before if n in after and after[n] is not before[n]}
    if not replaced or optimizer is None:
        return
    seen: set[int] = set()
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            p = replaced.get(id(p), p)
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        group["params"] = params


#: set by expert parallel on a parameter holding rows ``[first, first + len)`` of a fused expert tensor, and on
#: each piece of split fused experts (``hf_elixir/parallel/_expert_units.py``, one row):
#: ``(first, number of rows of the full tensor)``
EXPERT_ROWS_ATTR = "_hf_elixir_expert_rows"


def _expert_rows(param: torch.nn.Parameter) -> tuple[int, torch.Size]:
    """``(first row, full shape)`` of the tensor ``param`` is read from: an expert-parallel slice of a fused
    expert tensor (``hf_elixir.parallel._fused_experts.shard_fused_experts``) reads its rows of
    the full tensor; any other parameter, all of it."""
    rows = getattr(param, EXPERT_ROWS_ATTR, None)
    if rows is None:
        return 0, param.shape
    first, full = rows
    return first, torch.Size((full, *param.shape[1:]))


def _tied_sources(model: torch.nn.Module) -> dict[str, str]:
    """Hugging Face ``_tied_weights_keys`` as ``{tied name: source name}`` (transformers 5 form; older
    list forms give nothing, the shared ``nn.Parameter`` already names both)."""
    tied = getattr(model, "_tied_weights_keys", None)
    return dict(tied) if isinstance(tied, dict) else {}


_MISSING_FIX = ("build the model from the folder's config.json (AutoConfig.from_pretrained(folder)) or load the "
                "folder this model was saved to")


def resolve_sources(reader: CheckpointReader, model: torch.nn.Module, names: dict,
                    shards: dict[torch.nn.Parameter, TensorShard], *, expected: Iterable[str] = (),
                    missing_ok: bool = False, missing_fix: str = _MISSING_FIX) -> tuple[dict, dict]:
    """Find every parameter's tensor in ``reader``'s folder and check its shape, before anything is read; warn
    about the folder's tensors the model does not use ([Note: strict loads] in ``_load_report.py``).

    Args:
        reader: the folder.
        model: the model (its ``base_model_prefix``, ``_tied_weights_keys`` and transformers conversion mapping).
        names: parameter -> its names (canonical first, then aliases).
        shards: parameter -> :class:`TensorShard` for parameters holding a tensor-parallel slice of the file's
            tensor; a parameter with ``EXPERT_ROWS_ATTR`` holds expert rows of it.
        expected: more names the model expects (the unmodified model's, under tensor/expert parallel): the
            folder's tensors under them are not unexpected here.
        missing_ok: leave parameters without a tensor out of the result instead of raising.
        missing_fix: the fix the missing-parameters error names.

    Returns:
        ``(keys, bases)``: parameter -> the file tensor's name, and parameter -> its first element in that
        tensor (non-zero for an expert-parallel slice).

    Raises:
        ValueError: a parameter has no tensor in the folder (unless ``missing_ok``), or one of another shape (names
            the tensor, its file and both shapes).
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    tied = _tied_sources(model)
    absent = {fqns[0]: _expert_rows(param)[1] for param, fqns in names.items()
              if reader.resolve(list(fqns), prefix) is None}
    if absent:  # stored in another layout (e.g. per-expert): transformers' own converters build them
        reader.add_converted(model, absent)
    keys, bases = {}, {}
    missing, mismatched = [], []
    for param, fqns in names.items():
        key = reader.resolve(list(fqns) + [tied[n] for n in fqns if n in tied], prefix)
        if key is None:
            missing.append(fqns[0])
            continue
        shape = reader.shape(key)
        shard = shards.get(param)
        first, full_shape = _expert_rows(param)
        if shard is not None:
            full_shape = shard.full_shape(param.shape)
        if shape != full_shape:
            mismatched.append((fqns[0], key, reader.file_name(key), shape, full_shape))
        keys[param] = key
        bases[param] = first * math.prod(full_shape[1:])
    folder = str(reader.folder)
    if mismatched:
        raise mismatch_error(folder, model, mismatched)
    if missing and not missing_ok:
        raise missing_error(folder, missing, len(names), missing_fix)
    warn_unexpected(reader, model, [n for fqns in names.values() for n in fqns] + list(expected))
    return keys, bases


def read_local(reader: CheckpointReader, key: str, shape: torch.Size, shard: TensorShard | None = None,
               base: int = 0) -> torch.Tensor:
    """This rank's part of file tensor ``key`` as a new tensor of ``shape`` in the file's dtype: the whole tensor,
    its tensor-parallel slice (``shard``, reading only this rank's rows/columns), or the ``numel(shape)`` elements
    from element ``base`` on (expert-parallel rows)."""
    numel = math.prod(shape)
    if shard is None:
        flat = reader.read_flat(key, base, base + numel)
    else:
        flat = _read_shard_flat(reader, key, 0, numel, shard)
    return flat.reshape(shape).clone()


class StreamedInit:
    """Prepare a model (on the meta device or not) to take its values from a Hugging Face folder.

    Args:
        model: the model ``prepare`` got.
        folder: the checkpoint folder (see :class:`CheckpointReader`).
        names: every managed parameter -> its names (canonical first, then aliases).
        device: where rebuilt or loaded buffers go (the compute device).
        shards: parameter name -> :class:`TensorShard` for parameters holding a tensor-parallel slice of the
            folder's tensor (see [Note: streamed tensor-parallel shards]); any of a parameter's names.
        expected: the unmodified model's names under tensor/expert parallel (``ParallelState.full_shapes``): the
            folder's tensors under them are not reported as unexpected.
        allow_missing: parameters the folder lacks start from their own values, or (on the meta device) from the
            model's ``_init_weights``, with a warning, instead of raising (``ElixirConfig.allow_missing_keys``).

    Raises:
        FileNotFoundError: as :class:`CheckpointReader`.
        ValueError: a parameter has no tensor in the folder (unless ``allow_missing``), or one of another shape
            (names them); a folder file that is not safetensors (names it);
            a buffer on the meta device can be neither loaded nor rebuilt; a meta parameter has gradient
            hooks (e.g. Switch-Transformers experts under expert parallel).
    """

    def __init__(self, model: torch.nn.Module, folder: str | Path, names: dict, device: torch.device,
                 shards: dict[str, TensorShard] | None = None, *, expected: Iterable[str] = (),
                 allow_missing: bool = False) -> None:
        self.reader = CheckpointReader(folder)
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.keys: dict[torch.nn.Parameter, str] = {}
        self.shards: dict[torch.nn.Parameter, TensorShard] = {}
        for param, fqns in names.items():
            shard = next((shards[n] for n in fqns if n in shards), None) if shards else None
            if shard is not None:
                self.shards[param] = shard
        self.bases: dict[torch.nn.Parameter, int] = {}
        try:
            for param in names:  # before anything changes: a refusal leaves the model as it was
                if param.is_meta and param._backward_hooks:
                    raise ValueError(
                        f"parameter {names[param][0]!r} is on the meta device with gradient hooks "
                        "(Tensor.register_hook), which streamed loading would drop (torch.utils.swap_tensors): "
                        "load the model with from_pretrained and call prepare without checkpoint=")
            self._resolve(model, names, expected, allow_missing)
            self._materialize_buffers(model, device)
            for param in names:
                if param.is_meta:
                    placeholder = torch.zeros(1, dtype=param.dtype).expand(param.shape)
                    torch.utils.swap_tensors(param, torch.nn.Parameter(placeholder, requires_grad=param.requires_grad))
        except BaseException:
            self.close()
            raise

    def _resolve(self, model: torch.nn.Module, names: dict, expected: Iterable[str], allow_missing: bool) -> None:
        fix = ("build the model from the folder's config.json (AutoConfig.from_pretrained(folder)), or pass "
               "ElixirConfig(allow_missing_keys=True) to start them from the model's _init_weights as "
               "from_pretrained does")
        self.keys, self.bases = resolve_sources(self.reader, model, names, self.shards, expected=expected,
                                                missing_ok=allow_missing, missing_fix=fix)
        missing = [p for p in names if p not in self.keys]
        if not missing:
            return
        name_of = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for param in missing:  # values given in memory, this rank's whole local tensor
            key = f"<initial value of {name_of[id(param)]}>"
            shard = self.shards.get(param)
            part = shard.rank if shard is not None else _expert_rows(param)[0]
            self.reader.given[key] = initial_values(model, name_of[id(param)], param, part)
            self.keys[param], self.bases[param] = key, 0
            self.shards.pop(param, None)  # base 0, no shard: the value is this rank's part (its slice, its rows)
        logger.warning("checkpoint=%r has no tensor for %d parameters %s: they start from %s (ElixirConfig("
                       "allow_missing_keys=True); train them before relying on the model", str(self.reader.folder),
                       len(missing), [names[p][0] for p in missing][:10],
                       "the model's _init_weights where on the meta device, else their own values")

    def _materialize_buffers(self, model: torch.nn.Module, device: torch.device) -> None:
        rebuild: list[tuple[torch.nn.Module, str]] = []
        for module_name, module in model.named_modules():
            for name, buf in list(module._buffers.items()):
                if buf is None or not buf.is_meta:
                    continue
                fqn = f"{module_name}.{name}" if module_name else name
                key = None if name in module._non_persistent_buffers_set else self.reader.resolve([fqn], self.prefix)
                if key is not None:
                    module._buffers[name] = self.reader.read(key).to(device, buf.dtype)
                else:
                    module._buffers[name] = torch.empty_like(buf, device=device)
                    rebuild.append((module, fqn))
        if not rebuild:
            return
        init = getattr(model, "_init_weights", None)
        if init is None:
            raise ValueError(f"buffers {[f for _, f in rebuild][:5]} are on the meta device and not in checkpoint="
                             f"{str(self.reader.folder)!r}, and {type(model).__name__} has no _init_weights to "
                             "rebuild them: build the model with real buffers (accelerate's init_empty_weights() "
                             "keeps buffers off the meta device)")
        with torch.no_grad():
            for module in dict.fromkeys(m for m, _ in rebuild):
                init(module)  # the model's own code (e.g. rotary inv_freq); meta parameters are left alone

    def fill_for(self, chunk):
        """``fill(begin, end, out)`` for ``chunk``: its elements ``[begin, end)`` read from the folder."""
        sources = [SlotSource(self.keys[slot.param], slot.offset, slot.numel, self.shards.get(slot.param),
                              self.bases[slot.param])
                   for slot in chunk.slots]

        def fill(begin: int, end: int, out: torch.Tensor) -> None:
            read_chunk_range(self.reader, sources, begin, end, out)
            self.reader.close()  # unmap: the file pages read for this chunk leave the process's RSS

        return fill

    def close(self) -> None:
        self.reader.close()
