"""What the chunk manager really holds on the (simulated) device, measured from the tensors themselves, not
from the pool's own counter, so a buffer the pool forgot to charge shows up here: the bytes of every distinct
storage on the compute device that is reachable from the manager and the optimizer and is not host memory
([Note: strict device] in ``hf_elixir/chunk/strict.py``).

Parameters are skipped (views into the chunks' buffers, reached through the chunks, or stale placeholders).
Per-parameter bookkeeping the pool does not charge is reported apart: the has-gradient flags (4 bytes a
parameter), their groups' indices (8 bytes a parameter) and their all-reduce's buffers, the reduce order and hyperparameter checks' one value each, the stale placeholders' few values, and 0-dim tensors (the optimizer's ``step`` counters, host
memory on CUDA for PyTorch's non-fused optimizers)."""

from __future__ import annotations

import gc
import types

import torch

from hf_elixir.chunk import strict

_SKIP = (types.ModuleType, type, torch.nn.Module, torch.nn.Parameter, torch.dtype, torch.device, str, bytes, int,
         float)
# attribute and closure-variable names (the flags' all-reduce in flight holds ``flags`` and ``parts``)
BOOKKEEPING_NAMES = frozenset({"has_grad_flags", "flag_groups", "flags", "parts", "stale_values",
                               "reduce_order_mismatch", "hyper_mismatch"})


def held_device_bytes(*roots, device: torch.device = torch.device("cpu")) -> tuple[int, int]:
    """``(model data, bookkeeping)`` bytes of the distinct device storages reachable from ``roots`` through
    attributes, containers, closures and bound methods (not modules, classes or functions' globals)."""
    seen: set[int] = set()
    storages: dict[int, tuple[int, bool]] = {}  # storage address -> (bytes, bookkeeping)
    todo = [(root, False) for root in roots]
    while todo:
        obj, bookkeeping = todo.pop()
        if obj is None or id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device == device and obj.layout == torch.strided and not strict.is_host(obj):
                storage = obj.untyped_storage()
                if storage.nbytes():
                    prior = storages.get(storage.data_ptr(), (0, True))[1]
                    storages[storage.data_ptr()] = (storage.nbytes(), prior and (bookkeeping or obj.dim() == 0))
            continue
        if isinstance(obj, types.FunctionType):
            todo.extend((cell.cell_contents, bookkeeping or name in BOOKKEEPING_NAMES)
                        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()) if _filled(cell))
        elif isinstance(obj, types.MethodType):
            todo.extend(((obj.__self__, bookkeeping), (obj.__func__, bookkeeping)))
        elif isinstance(obj, dict):
            todo.extend((k, bookkeeping) for k in obj)
            todo.extend((v, bookkeeping or k in BOOKKEEPING_NAMES) for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend((v, bookkeeping) for v in obj)
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            todo.extend((v, bookkeeping) for v in gc.get_referents(obj))
    model = sum(n for n, book in storages.values() if not book)
    return model, sum(n for n, book in storages.values() if book)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
