"""One hook unit per expert for the fused 3-D MoE experts of today's Hugging Face families.

Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 and gpt-oss (transformers 5.x) keep one layer's experts in one
module with parameters stacked on dim 0: ``gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``
(gpt-oss transposed, plus ``(E, 2I)`` / ``(E, H)`` biases). A parameter lives in one chunk slot
([Note: parameters as views] in ``chunk/chunk.py``) and a module's unit unshards all its chunks at once
(``runtime/hooks.py: _units``), so such a module forces chunks of E experts and a device floor of several
whole layers' experts (Mixtral-8x7B bf16 at 1 rank: 18.97 GiB).

[Note: split fused experts] :func:`split_fused_experts` keeps each fused experts module (class, name,
``act_fn``, ``config``, ``num_experts``) but moves its parameters into ``n`` child modules ``"0"`` ..
``"n-1"`` (``n = num_experts``; after expert-parallel sharding the ``L`` local experts), one per expert:
child ``j`` is an instance of the same class with ``num_experts = 1`` whose parameters hold expert ``j``'s
rows, shape ``(1, ...)``, so re-fusing is ``torch.cat`` on dim 0 (what expert-parallel reassembly does with
ep slices). Each child is an ordinary hook unit: only one expert's chunks need to be unsharded at a time.
The module's forward becomes :class:`SplitExpertsForward` (same call as the Hugging Face experts forward):
it groups the ``T * k`` (token, choice) rows by expert (``moe_permute``), calls EVERY child in expert order
(on every rank, so the chunk all-gathers its hooks issue agree) on its rows as top-1 choices of local id 0
with weight 1 through the child's own forward (transformers' eager / ``grouped_mm`` / ``batched_mm`` per
``config._experts_implementation``), and sums each token's k outputs weighted by its routing weights
(``moe_unpermute``, differentiable in the weights). A child with no rows runs on one all-zero probe row and
its output is dropped, so its parameters get an exact zero gradient, as an idle slice of the fused tensor
does in plain PyTorch, where AdamW still decays it ([Note: idle fused experts] in ``_fused_experts.py``).
Under expert parallel the split replaces the local-expert call of :class:`FusedExpertDispatch`.

Names stay the unmodified model's: a state-dict hook on the module concatenates the children's entries into
the fused names and shapes (so ``model.state_dict()``, ``save_pretrained`` with transformers' reverse weight
conversion, ``gather_full_state_dict`` see the fused tensors), a load pre-hook splits them again, and
:func:`fused_names` maps gradients (``hf_elixir.full_gradients``) and streamed loading
(``chunk/_stream_load.py``: each piece reads its rows of the fused checkpoint tensor through
``EXPERT_ROWS_ATTR``) back to the fused names. :func:`unsplit_fused_experts` undoes the split exactly (the
original parameter objects come back).

Source: transformers ``integrations/moe.py`` (``use_experts_implementation``) and the families' modeling files;
the permutation as in ``parallel/_fused_experts.py`` (GShard, arXiv 2006.16668, section 2).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_elixir.chunk._stream_load import EXPERT_ROWS_ATTR
from hf_elixir.placement._experts import PIECE_ATTR, SPLIT_ATTR, fused_expert_count

__all__ = ["SplitExpertsForward", "fuse_tensors", "fused_names", "is_split", "release_fused", "split_fused_experts",
           "split_optimizer_params", "splittable_names", "temporarily_split", "unsplit_fused_experts"]


@dataclass
class _SplitRecord:
    """What :func:`split_fused_experts` changed on one fused experts module (kept on it as ``SPLIT_ATTR``).

    Attributes:
        names: the fused parameter names, in registration order.
        params: name -> the original fused ``nn.Parameter`` (``(n, ...)``), given back by the undo (emptied by
            :func:`release_fused` once ``prepare`` succeeded).
        num_pieces: ``n``, the children ``"0"`` .. ``"n-1"``.
        forward: the instance ``forward`` before the split (``None`` if the class's).
        handles: the state-dict hook handles.
    """

    names: tuple[str, ...]
    params: dict[str, nn.Parameter]
    num_pieces: int
    forward: Any = None
    handles: list = field(default_factory=list)


def is_split(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module that :func:`split_fused_experts` split."""
    return isinstance(getattr(module, SPLIT_ATTR, None), _SplitRecord)


def _pieces(module: nn.Module) -> list[nn.Module]:
    return [module._modules[str(j)] for j in range(getattr(module, SPLIT_ATTR).num_pieces)]


class SplitExpertsForward:
    """The ``forward`` of a split fused experts module (see [Note: split fused experts]).

    Call args (as the Hugging Face experts forward): ``hidden_states`` ``(T, H)`` float; ``top_k_index``
    ``(T, k)`` int64 expert ids in ``[0, n)``; ``top_k_weights`` ``(T, k)`` routing weights. Returns
    ``(T, H)`` in ``hidden_states.dtype``: per token the sum over its k choices of weight times expert output
    (accumulated in fp32 by ``moe_unpermute``). One host read per call (the per-expert row counts).
    """

    #: run the MoE permutation Triton kernels on CPU tensors too (tests, under ``TRITON_INTERPRET=1``)
    force_triton = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        from triton_kernels import moe_permute, moe_unpermute  # noqa: PLC0415 (imports triton: lazy)

        pieces = _pieces(self.module)
        if hidden_states.is_meta:  # a profiled step: shapes and calls only
            return self._meta_forward(pieces, hidden_states, top_k_index, top_k_weights)
        x_sorted, row_map, counts = moe_permute(hidden_states, top_k_index, len(pieces), None,
                                                force_triton=self.force_triton)
        outs = self._run_pieces(pieces, x_sorted, counts.tolist())  # the one host read
        out = moe_unpermute(torch.cat(outs), row_map, top_k_weights, hidden_states.shape[0],
                            force_triton=self.force_triton)
        return out.to(hidden_states.dtype)

    @staticmethod
    def _run_pieces(pieces: list[nn.Module], x_sorted: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Every piece on its rows of ``x_sorted`` ``(N, H)`` (``counts[j]`` rows for piece ``j``, in order)."""
        outs, start = [], 0
        for piece, num_rows in zip(pieces, counts):
            rows = x_sorted[start:start + num_rows]
            start += num_rows
            if num_rows == 0:  # still called: hooks agree across ranks, the gradient is an exact zero
                probe = rows.sum(dim=0, keepdim=True)  # one zero row, connected to the input
                ids = torch.zeros((1, 1), dtype=torch.long, device=rows.device)
                outs.append(piece(probe, ids, probe.new_ones((1, 1)))[:0])
            else:
                ids = torch.zeros((num_rows, 1), dtype=torch.long, device=rows.device)
                outs.append(piece(rows, ids, rows.new_ones((num_rows, 1))))
        return outs

    def _meta_forward(self, pieces, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """On the meta device (no values, no host read): the ``T * k`` rows spread evenly over the experts (the
        balanced routing the router's auxiliary loss aims for), each piece called on its share."""
        num_tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1] if top_k_index.dim() > 1 else 1
        x_rows = hidden_states.repeat_interleave(top_k, dim=0)  # (T * k, H)
        num_rows, num = x_rows.shape[0], len(pieces)
        y = torch.cat(self._run_pieces(pieces, x_rows, [num_rows // num + (j < num_rows % num) for j in range(num)]))
        weights = top_k_weights.reshape(num_tokens, top_k, 1).to(y.dtype)
        return (y.view(num_tokens, top_k, -1) * weights).sum(dim=1).to(hidden_states.dtype)


def _new_piece(module: nn.Module) -> nn.Module:
    """An instance of ``module``'s class with its attributes (``config``, ``act_fn``, ...) and no parameters,
    ``num_experts = 1``."""
    cls = type(module)
    piece = cls.__new__(cls)
    nn.Module.__init__(piece)
    own = set(vars(piece))
    for key, value in vars(module).items():
        if key not in own and key not in ("forward", SPLIT_ATTR):
            object.__setattr__(piece, key, value)
    piece.training = module.training
    for name, child in module._modules.items():  # act_fn and such, shared (they hold no parameters)
        if child is not None and not any(True for _ in child.parameters()):
            piece._modules[name] = child
    for name, buf in module._buffers.items():
        piece._buffers[name] = buf
    piece.num_experts = 1
    setattr(piece, PIECE_ATTR, True)
    return piece


def _fuse_state_dict_hook(module, destination, prefix, local_metadata) -> None:
    """The children's ``"{j}.{name}"`` entries -> one ``name`` entry, concatenated on dim 0."""
    record = getattr(module, SPLIT_ATTR)
    for name in record.names:
        keys = [f"{prefix}{j}.{name}" for j in range(record.num_pieces)]
        if all(k in destination for k in keys):
            parts = [destination.pop(k) for k in keys]
            with torch.no_grad():
                destination[prefix + name] = torch.cat([p.detach() for p in parts])


def _split_load_pre_hook(module, state_dict, prefix, *args) -> None:
    """A fused ``name`` entry of ``n`` rows -> the children's ``"{j}.{name}"`` entries (views of its rows)."""
    record = getattr(module, SPLIT_ATTR)
    for name in record.names:
        value = state_dict.get(prefix + name)
        if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == record.num_pieces:
            del state_dict[prefix + name]
            for j in range(record.num_pieces):
                state_dict[f"{prefix}{j}.{name}"] = value[j:j + 1]


def _split_one(module: nn.Module) -> None:
    num_pieces = module.num_experts
    params = dict(module.named_parameters(recurse=False))
    record = _SplitRecord(names=tuple(params), params=params, num_pieces=num_pieces,
                          forward=vars(module).get("forward"))
    pieces = [_new_piece(module) for _ in range(num_pieces)]
    for name, fused in params.items():
        first, full_rows = getattr(fused, EXPERT_ROWS_ATTR, (0, num_pieces))
        for j, piece in enumerate(pieces):
            rows = (torch.empty((1, *fused.shape[1:]), dtype=fused.dtype, device="meta") if fused.is_meta
                    else fused.detach()[j:j + 1])  # a view: no copy of the experts
            part = nn.Parameter(rows, requires_grad=fused.requires_grad)
            setattr(part, EXPERT_ROWS_ATTR, (first + j, full_rows))  # streamed init reads these rows
            setattr(part, PIECE_ATTR, True)  # get_full_grad gives a piece its own rows
            piece.register_parameter(name, part)
        del module._parameters[name]
    for j, piece in enumerate(pieces):
        module.add_module(str(j), piece)
    setattr(module, SPLIT_ATTR, record)
    dispatch = record.forward
    if dispatch is not None and hasattr(dispatch, "experts_forward"):  # expert parallel: its local-expert call
        dispatch.experts_forward = SplitExpertsForward(module)
    else:
        module.forward = SplitExpertsForward(module)
    record.handles = [module._register_state_dict_hook(_fuse_state_dict_hook),
                      module._register_load_state_dict_pre_hook(_split_load_pre_hook, with_module=True)]


def _takes_routing(module: nn.Module) -> bool:
    """Whether ``module``'s class forward takes ``(hidden_states, top_k_index, top_k_weights)`` (three positional
    arguments after ``self``, as the families above); Llama-4's ``Llama4TextExperts.forward(hidden_states)`` (the
    routing already applied to its input) does not."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    kinds = [p.kind for p in params]
    positional = sum(k in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p, k in zip(params, kinds))
    return positional >= 3 or inspect.Parameter.VAR_POSITIONAL in kinds


def _splittable(module: nn.Module) -> bool:
    """A fused experts module not yet split: a fused container (``fused_expert_count``) holding a 3-D parameter
    (a router's ``(E, H)`` weight alone also has ``num_experts`` rows), whose forward takes the routing
    (:func:`_takes_routing`), and whose ``forward`` no other rewrite replaced (expert parallel's
    ``FusedExpertDispatch`` excepted: tensor parallel's ``moe_tp`` wraps the experts' forward in its collectives and
    keeps them fused)."""
    if is_split(module) or fused_expert_count(module) is None:
        return False
    if not any(p.dim() >= 3 for p in module.parameters(recurse=False)):
        return False
    own = vars(module).get("forward")
    if own is not None and not hasattr(own, "experts_forward"):
        return False
    return _takes_routing(module)


def splittable_names(model: nn.Module) -> list[str]:
    """The names of the fused parameters :func:`split_fused_experts` would split now (``named_modules`` order)."""
    return [f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules() if _splittable(module)
            for name, _ in module.named_parameters(recurse=False)]


def split_fused_experts(model: nn.Module) -> list[nn.Module]:
    """Split every fused experts module of ``model`` into one child per expert, in place
    (see [Note: split fused experts]).

    Each fused parameter ``(n, ...)`` becomes ``n`` parameters ``(1, ...)`` (views of its rows, or new meta
    tensors on the meta device), each in child ``str(j)`` of the module, with the same dtype, device and
    ``requires_grad``; the module's ``forward`` becomes :class:`SplitExpertsForward` (under expert parallel:
    the local-expert call of its ``FusedExpertDispatch``). Modules already split, modules whose forward does not
    take the routing (Llama-4's ``Llama4TextExperts``) and fused experts split over tensor parallel (``moe_tp``)
    are left alone.

    Args:
        model: any ``nn.Module`` (a Hugging Face MoE model, parallelized or not; not yet prepared).

    Returns:
        The modules split now, in ``named_modules`` order (empty for a model without fused experts).
    """
    targets = [m for _, m in model.named_modules() if _splittable(m)]
    for module in targets:
        _split_one(module)
    return targets


def unsplit_fused_experts(modules: list[nn.Module]) -> None:
    """Undo :func:`split_fused_experts` on ``modules`` (its return value): the original fused parameter
    objects, forward and hooks come back, the children go. The pieces' values are not copied back (the undo
    is for a ``prepare`` or a floor computation that did not train)."""
    for module in modules:
        record = getattr(module, SPLIT_ATTR)
        assert len(record.params) == len(record.names), f"the split of {type(module).__name__} was released"
        for handle in record.handles:
            handle.remove()
        for j in range(record.num_pieces):
            del module._modules[str(j)]
        for name, param in record.params.items():
            module._parameters[name] = param
        if record.forward is not None and hasattr(record.forward, "experts_forward"):
            record.forward.experts_forward = type(module).forward.__get__(module)
        if record.forward is None:
            vars(module).pop("forward", None)
        else:
            module.forward = record.forward
        delattr(module, SPLIT_ATTR)


def release_fused(modules: list[nn.Module]) -> None:
    """Forget the original fused parameters of the split ``modules`` (after a successful ``prepare``: the pieces'
    values live in their chunks, and the fused tensors' storage, the experts' whole size, can go). The split can
    no longer be undone."""
    for module in modules:
        getattr(module, SPLIT_ATTR).params = {}


def split_optimizer_params(optimizer: torch.optim.Optimizer | None, modules: list[nn.Module]):
    """Point ``optimizer``'s param groups at the pieces of the split ``modules``: each fused parameter is
    replaced, in its group and position, by its pieces in expert order (so per-group settings such as weight
    decay apply to them). Returns a function that puts the groups back.

    Raises:
        ValueError: the optimizer already holds state for a fused parameter (it stepped before ``prepare``);
            the message names the parameter and the fix.
    """
    if optimizer is None or not modules:
        return lambda: None
    pieces_of: dict[int, list[nn.Parameter]] = {}
    for module in modules:
        record = getattr(module, SPLIT_ATTR)
        for name, fused in record.params.items():
            pieces_of[id(fused)] = [getattr(piece, name) for piece in _pieces(module)]
            if fused in optimizer.state and optimizer.state[fused]:
                raise ValueError(
                    f"the optimizer holds state for fused expert parameter {name!r} ({tuple(fused.shape)}), which "
                    "ElixirConfig.split_fused_experts=True splits per expert: build the optimizer after loading, "
                    "before any step, or set ElixirConfig(split_fused_experts=False)")
    before = [list(group["params"]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [q for p in group["params"] for q in pieces_of.get(id(p), [p])]

    def restore() -> None:
        for group, params in zip(optimizer.param_groups, before):
            group["params"] = params

    return restore


@contextlib.contextmanager
def temporarily_split(model: nn.Module, enabled: bool = True):
    """Split ``model``'s fused experts for the duration of the block (floor computations and offline plans see
    the model ``prepare`` will build), then undo it. ``enabled=False``: no change."""
    modules = split_fused_experts(model) if enabled else []
    try:
        yield model
    finally:
        unsplit_fused_experts(modules)


def fused_names(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Piece parameter name -> ``(fused name, index j, n)`` for every split experts module of ``model``:
    ``"...experts.3.gate_up_proj" -> ("...experts.gate_up_proj", 3, 8)``. Empty when nothing is split."""
    out: dict[str, tuple[str, int, int]] = {}
    for fqn, module in model.named_modules():
        if is_split(module):
            record = getattr(module, SPLIT_ATTR)
            base = f"{fqn}." if fqn else ""
            for j in range(record.num_pieces):
                for name in record.names:
                    out[f"{base}{j}.{name}"] = (base + name, j, record.num_pieces)
    return out


def fuse_tensors(model: nn.Module, tensors: dict[str, torch.Tensor],
                 present: dict[str, bool] | None = None):
    """Piece entries of ``tensors`` (names as :func:`fused_names`) -> fused entries (``torch.cat`` on dim 0, at
    the first piece's position; other entries keep their order). With ``present`` (name -> has a value), a fused
    entry is present when any piece is, and absent pieces must hold zeros. Returns ``(tensors, present)``."""
    mapping = fused_names(model)
    if not mapping:
        return tensors, present
    groups: dict[str, list[str]] = {}
    for name in tensors:
        if name in mapping:
            groups.setdefault(mapping[name][0], []).append(name)
    out: dict[str, torch.Tensor] = {}
    flags: dict[str, bool] | None = {} if present is not None else None
    for name, value in tensors.items():
        if name not in mapping:
            out[name] = value
            if flags is not None:
                flags[name] = present[name]
            continue
        fused, j, num = mapping[name]
        if fused in out:
            continue
        parts = sorted(groups[fused], key=lambda k: mapping[k][1])
        if len(parts) != num:  # not every piece is here (e.g. a frozen one): keep the pieces' names
            out[name] = value
            if flags is not None:
                flags[name] = present[name]
            continue
        with torch.no_grad():
            out[fused] = torch.cat([tensors[k] for k in parts])
        if flags is not None:
            flags[fused] = any(present[k] for k in parts)
    return out, flags
