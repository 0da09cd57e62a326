"""What a load from a Hugging Face folder found against the model: unexpected, missing and mismatched tensors.

[Note: strict loads] A streamed load (``prepare(checkpoint=)``, ``hf_elixir.parallel.load_full_state_dict`` from a
folder, the Trainer's resume of a parallel or split-experts model) is at least as strict as transformers'
``from_pretrained`` (``utils/loading_report.py``):

- **unexpected** tensors (in the folder, used by no parameter or buffer of the model, e.g. a 3-layer folder loaded
  into a 2-layer model) are logged as a warning naming them, as ``from_pretrained`` logs its UNEXPECTED rows;
  the model's ``_keys_to_ignore_on_load_unexpected`` patterns (searched as regular expressions), its buffers' names
  and the renamed rotary/position-id buffers of older checkpoints are not reported (as there).
  Under tensor/expert parallel the expected names are the unmodified model's (``ParallelState.full_shapes``), so
  the experts another rank holds are not unexpected here;
- **missing** parameters raise, naming them and the option that allows them (``from_pretrained`` initialises
  them at random with a warning, which a resumed training run would not notice);
- a **shape mismatch** raises naming the parameter, the tensor, its file and both shapes; when the folder's tensor
  is exactly ``1/k`` of the model's along one dim, the message says the folder looks tensor- (or, for dim 0 of a
  3-D experts tensor, expert-) parallel-sharded: one rank's slices saved as a whole model.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["initial_values", "mismatch_error", "missing_error", "warn_unexpected"]

logger = logging.getLogger(__name__)

_LISTED = 10  # names shown in a message; the count says how many more


def _listed(names: list[str]) -> str:
    more = len(names) - _LISTED
    return f"{names[:_LISTED]}{f' and {more} more' if more > 0 else ''}"


def _sharded_hint(file_shape: torch.Size, model_shape: torch.Size) -> str:
    """Why a file tensor ``1/k`` of the model's along one dim is there: one rank's parallel slice (else "")."""
    if len(file_shape) != len(model_shape):
        return ""
    differ = [d for d, (f, m) in enumerate(zip(file_shape, model_shape)) if f != m]
    if len(differ) != 1:
        return ""
    dim = differ[0]
    size, full = file_shape[dim], model_shape[dim]
    if size == 0 or full % size or full // size < 2:
        return ""
    kind = "expert-parallel" if dim == 0 and len(model_shape) == 3 else "tensor-parallel"
    return f"1/{full // size} of the model's along dim {dim}: it looks {kind}-sharded"


def _config_differences(folder: str, model: torch.nn.Module) -> list[str]:
    """The integer fields of the folder's ``config.json`` that differ from the model's config (sizes, counts)."""
    path = Path(folder) / "config.json"
    config = getattr(model, "config", None)
    if config is None or not path.is_file():
        return []
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        return []
    mine = config.to_dict()
    return [f"{k}: {saved[k]} in the folder, {mine[k]} in the model" for k in sorted(saved.keys() & mine.keys())
            if isinstance(saved[k], int) and isinstance(mine[k], int) and saved[k] != mine[k]]


def _saved_layout(folder: str) -> str:
    """The parallel layout an ``hf_elixir.save_checkpoint`` manifest in ``folder`` records, as text ("" if none)."""
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return ""
    found = {k: v for k, v in manifest.items() if isinstance(manifest, dict) and
             (k == "layout" or any(word in k for word in ("mesh", "parallel")))}
    return json.dumps(found, sort_keys=True) if found else ""


def mismatch_error(folder: str, model: torch.nn.Module, mismatched: list[tuple]) -> ValueError:
    """The error for parameters whose folder tensor has another shape: ``mismatched`` holds ``(name, key, file,
    file_shape, model_shape)``; each shown one names the tensor, its file and both shapes. When the folder's config
    matches the model's and the tensors are ``1/k`` of the model's along one dim, it says the folder looks
    tensor-/expert-parallel-sharded (one rank's slices saved as the whole model)."""
    lines = [f"{key!r}{'' if key == name else f' (for {name!r})'} in {file} is {tuple(fs)}, the model's is {tuple(ms)}"
             for name, key, file, fs, ms in mismatched]
    text = (f"checkpoint={folder!r} holds {len(lines)} tensors of other shapes than the model's: "
            f"{'; '.join(lines[:3])}{f' (and {len(lines) - 3} more)' if len(lines) > 3 else ''}. ")
    differences = _config_differences(folder, model)
    hints = [(key, h) for _, key, _, fs, ms in mismatched if (h := _sharded_hint(fs, ms))]
    layout = _saved_layout(folder)
    if layout:
        text += f"The folder's manifest.json records the layout it was saved with: {layout}. "
    if differences:
        text += (f"The folder's config.json differs from the model's ({'; '.join(differences[:4])}): build the model "
                 "from it (AutoConfig.from_pretrained(folder))")
    elif hints:
        key, hint = hints[0]
        text += (f"{key!r} is {hint}: the folder holds one rank's slices of a tensor/expert-parallel model saved as "
                 "whole tensors; load a consolidated save (save_pretrained or hf_elixir.parallel."
                 "gather_full_state_dict of the parallel model write the full tensors)")
    else:
        text += "Build the model from the folder's config.json (AutoConfig.from_pretrained(folder))"
    return ValueError(text)


def missing_error(folder: str, missing: list[str], num_params: int, fix: str) -> ValueError:
    """The error for parameters the folder has no tensor for (``fix`` says how to allow them or load otherwise)."""
    return ValueError(f"checkpoint={folder!r} has no tensor for {len(missing)} of the model's {num_params} parameters: "
                      f"{_listed(missing)}; {fix}")


def warn_unexpected(reader, model: torch.nn.Module, expected: Iterable[str]) -> list[str]:
    """Log a warning naming the folder's tensors that none of ``expected`` (the model's parameter and buffer names,
    under tensor/expert parallel the unmodified model's) uses, and return them (see [Note: strict loads]).

    A tensor is used when a name resolves to it (the base-model prefix added or removed) or a transformers weight
    converter/renaming registered on ``reader`` reads it.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = set(expected)
    names.update(n for n, _ in model.named_parameters(remove_duplicate=False))
    names.update(n for n, _ in model.named_buffers(remove_duplicate=False))
    used = {reader.resolve([n], prefix) for n in names}
    used.update(reader.renamed.values())
    for source in reader.converted.values():
        used.update(k for keys in source.sources.values() for k in keys)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    # buffers that older checkpoints saved under other names (transformers' _adjust_missing_and_unexpected_keys)
    ignore += [re.compile(p) for p, end in ((r"rotary_emb\.inv_freq", "rotary_emb.inv_freq"),
                                             (r"(^|\.)position_ids$", "position_ids"))
               if any(n.endswith(end) for n, _ in model.named_buffers())]
    unexpected = sorted(k for k in reader.keys() - used if not any(p.search(k) for p in ignore))
    if unexpected:
        logger.warning("checkpoint=%r holds %d tensors %s that %s does not use (UNEXPECTED: can be ignored when "
                       "loading from another task or architecture; not if you expect the same architecture: build "
                       "the model from the folder's config.json, AutoConfig.from_pretrained(folder))",
                       str(reader.folder), len(unexpected), _listed(unexpected), type(model).__name__)
    return unexpected


def initial_values(model: torch.nn.Module, name: str, param: torch.nn.Parameter, part: int = 0) -> torch.Tensor:
    """The value a parameter the folder lacks starts from: its own when it has one, else what the model's
    ``_init_weights`` (as ``from_pretrained`` does for missing keys; else the module's ``reset_parameters``) gives a
    CPU copy of its module, so the model's own meta parameters are left alone.

    The random draw is seeded from ``name`` and ``part`` (this rank's tensor-parallel index or first expert row),
    never from the global generator: every data-parallel rank builds the same value (a replicated parameter stays
    identical, a sharded one is one tensor), and the caller's random state is not advanced.

    Raises:
        ValueError: a meta parameter of a module neither can initialise.
    """
    if not param.is_meta:
        return param.detach().to("cpu").clone()
    owner_name, _, attr = name.rpartition(".")
    owner = copy.deepcopy(model.get_submodule(owner_name))  # meta tensors: a copy costs no memory
    owner.to_empty(device="cpu", recurse=True)
    with torch.no_grad():  # what no initialiser below covers starts at zero, never at uninitialised memory
        for tensor in owner.parameters():
            tensor.zero_()
    init = getattr(model, "_init_weights", None)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(name.encode()) + 7919 * part)
        if init is not None:
            for module in owner.modules():
                init(module)
        elif hasattr(owner, "reset_parameters"):
            owner.reset_parameters()
        else:
            raise ValueError(f"parameter {name!r} is missing from the checkpoint and on the meta device, and neither "
                             f"{type(model).__name__}._init_weights nor {type(owner).__name__}.reset_parameters can "
                             "initialise it: load a folder that holds it")
    value = getattr(owner, attr)
    assert value.shape == param.shape, (name, tuple(value.shape), tuple(param.shape))
    return value.detach().to(param.dtype)
