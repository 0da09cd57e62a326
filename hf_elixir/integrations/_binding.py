"""What the Accelerate plugin and the Trainer callback share: attaching Elixir to one ``Accelerator``.

[Note: why the accelerator instance is adjusted]

Accelerate has no plugin registry (``DistributedType`` is a closed enum) and its methods branch on
that enum, so a third-party memory manager cannot be *registered*; it has to meet accelerate where
the training loop calls it. Elixir needs exactly four things from an ``Accelerator``:

* ``prepare`` must not wrap an Elixir model in ``DistributedDataParallel`` (Elixir reduce-scatters
  gradients itself; DDP on top would reduce twice) nor in autocast (Elixir keeps the compute copy
  in the chosen precision). Accelerate's own "already prepared" marker, ``_is_accelerate_prepared``,
  makes ``prepare`` register a model/optimizer without wrapping it; :func:`register` sets it.
* ``backward(loss)`` must go through ``ElixirOptimizer.backward`` (fp16 loss scale) after
  accelerate's usual division by ``gradient_accumulation_steps``.
* ``clip_grad_norm_(model.parameters(), max_norm)`` must be the global norm over every rank's
  gradient shards (``ElixirOptimizer.clip_grad_norm``); accelerate's default reads ``p.grad``,
  which under Elixir lives in chunk buffers.
* the fp16 ``GradScaler`` accelerate creates must stay out of the way (Elixir's loss scaler is
  part of the optimizer state).
* ``join_uneven_inputs([model])`` must not hang or fail obscurely: see [Note: uneven inputs].

These are installed as instance attributes on that one ``Accelerator`` (never on the class), and
they fall through to accelerate's own methods for any model/optimizer that is not Elixir's, so a
second plain model in the same script behaves as before. Everything else (``accumulate``,
``save_state``/``load_state``, ``get_state_dict``, ``unwrap_model``, scheduler stepping) works
unchanged because the model stays unwrapped and the optimizer is an ``AcceleratedOptimizer``.

[Note: uneven inputs]

``accelerator.join_uneven_inputs(joinables, even_batches=False)`` lets ranks run different numbers of
batches: it wraps the loop in PyTorch's ``Join``, whose hooks let a rank that ran out of batches shadow
the collectives the others still issue. DDP's hook shadows its one gradient all-reduce. Under Elixir
every forward and backward is a sequence of collectives (all-gathers of the chunks, reduce-scatters of
their gradients) and the optimizer step adds more (the global norm), and an Elixir model is not a
``Joinable``: on GPUs accelerate's ``Join([model])`` fails with an ``AttributeError`` (``join_hook``),
and on CPU processes accelerate ignores the call (a warning), so the rank with more batches waits in
its next all-gather forever. The binding's ``join_uneven_inputs`` therefore refuses uneven inputs for
an Elixir model with a ``ValueError`` naming the fix (accelerate's default ``even_batches=True`` gives
every rank the same number of batches, a few samples repeated; or ``drop_last=True``), and with even
batches it is a plain context (no ``Join`` needed) that applies the ``even_batches`` override as
accelerate would. Joinables that are not Elixir's go to accelerate unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, Iterable

import torch
from accelerate.optimizer import AcceleratedOptimizer

from hf_elixir._logging import info_on_main_rank
from hf_elixir.chunk._shared_budget import SharedDeviceBudget
from hf_elixir.parallel._launch import check_launch_world_size
from hf_elixir.integrations._compile import compile_from_accelerator
from hf_elixir.integrations._takeover import log_takeover, parallelize_for_integration
from hf_elixir.runtime._state import is_prepared

__all__ = ["ElixirAcceleratedOptimizer", "binding_of", "config_summary", "elixir_prepare",
           "feed_tensor_parallel_rows", "merge_precision", "rebind_optimizer"]

logger = logging.getLogger(__name__)

_MIXED_TO_ELIXIR = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def merge_precision(config, accelerate_precision: str | None, source: str = "the accelerator"):
    """Make the Elixir precision agree with accelerate's ``mixed_precision``.

    ``fp32`` in the Elixir config means "not chosen": it adopts accelerate's ``bf16``/``fp16``.
    Two different low precisions are a user error.

    Raises:
        ValueError: the config asks for bf16 and accelerate for fp16 (or the reverse), or
            accelerate's precision (e.g. ``fp8``) has no Elixir equivalent.
    """
    wanted = _MIXED_TO_ELIXIR.get(str(accelerate_precision or "no"))
    if wanted is None:
        raise ValueError(
            f"mixed_precision={accelerate_precision!r} from {source} has no Elixir equivalent; use 'no', 'bf16' or 'fp16'"
        )
    if wanted == "fp32" or config.precision == wanted:
        return config
    if config.precision != "fp32":
        raise ValueError(
            f"ElixirConfig.precision={config.precision!r} disagrees with mixed_precision={accelerate_precision!r} "
            f"from {source}; set one of them so they match"
        )
    return dataclasses.replace(config, precision=wanted)


class ElixirAcceleratedOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` around an ``ElixirOptimizer``: no GradScaler, no device moves.

    Accelerate's wrapper keeps doing what the training loop relies on: ``step``/``zero_grad`` only
    on gradient-sync steps (gradient accumulation) and ``step_was_skipped`` for the scheduler, here
    taken from Elixir's loss scaler (an fp16 step skipped on overflow).
    """

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)

    def step(self, closure=None):
        scaler = getattr(self.optimizer, "scaler", None)
        skipped_before = getattr(scaler, "num_skipped_steps", 0)
        super().step(closure)
        # fp16 overflow: ElixirOptimizer skipped the update and backed off the loss scale.
        self._is_overflow = getattr(scaler, "num_skipped_steps", 0) > skipped_before

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``ElixirOptimizer.backward``: what ``accelerator.backward`` asks for when several Elixir models share
        the accelerator and it cannot tell which one a loss belongs to."""
        self.optimizer.backward(loss, **kwargs)


class _Binding:
    """Elixir's bookkeeping on one Accelerator: its models/optimizers and the original methods."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.entries: list[tuple[torch.nn.Module, Any]] = []  # (model, ElixirOptimizer, or None: inference only)
        # every model this accelerator puts under Elixir shares one device budget ([Note: one device budget for
        # several models] in hf_elixir/chunk/_shared_budget.py)
        self.shared_budget = SharedDeviceBudget()
        self.original_prepare = accelerator.prepare  # before the Trainer callback wraps it
        self.original_backward = accelerator.backward
        self.original_clip_grad_norm_ = accelerator.clip_grad_norm_
        self.original_join_uneven_inputs = accelerator.join_uneven_inputs
        accelerator.backward = self.backward
        accelerator.clip_grad_norm_ = self.clip_grad_norm_
        accelerator.join_uneven_inputs = self.join_uneven_inputs

    def forget(self, model: torch.nn.Module) -> None:
        """Drop ``model`` (and its optimizer) from this accelerator: it was replaced by a new model."""
        self.entries = [(m, o) for m, o in self.entries if m is not model]

    def optimizer_for_parameters(self, parameters: list[torch.Tensor]):
        ids = {id(p) for p in parameters}
        for model, optimizer in self.trained():
            if any(id(p) in ids for p in model.parameters()):
                return optimizer
        return None

    def trained(self) -> list[tuple[torch.nn.Module, Any]]:
        """The entries with an optimizer: a model prepared for inference (a frozen reference or teacher next to the
        trained one) takes no backward and no clipping."""
        return [(m, o) for m, o in self.entries if o is not None]

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``accelerator.backward(loss)``: divided by ``gradient_accumulation_steps``, then the backward of the Elixir
        optimizer of the model ``loss`` reached ([Note: which model a loss belongs to]).

        Raises:
            ValueError: the loss reaches several trained Elixir models of which one scales its loss (fp16).
        """
        trained = self.trained()
        if not trained:
            return self.original_backward(loss, **kwargs)
        if kwargs:
            logger.warning("accelerator.backward: %s are ignored under Elixir", sorted(kwargs))
        loss = loss / self.accelerator.gradient_accumulation_steps
        if len(trained) == 1:
            return trained[0][1].backward(loss)
        optimizers = _optimizers_reached(loss, trained) or [o for _, o in trained]
        if len(optimizers) == 1:
            return optimizers[0].backward(loss)
        scaled = [type(m).__name__ for m, o in trained if o in optimizers and o.scaler.enabled]
        if scaled:
            raise ValueError(
                f"accelerator.backward: the loss reaches {len(optimizers)} trained hf_elixir models, and fp16 "
                f"models ({', '.join(scaled)}) each scale their loss by their own factor, so one backward cannot "
                "serve them all; use precision='bf16' or 'fp32' for these models, or one loss (and one "
                "accelerator.backward) per fp16 model")
        loss.backward()  # no loss scale (fp32/bf16): each model's hooks reduce its own gradients

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        optimizer = self.optimizer_for_parameters(params)
        if optimizer is None:
            return self.original_clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}) under Elixir supports only norm_type=2")
        return optimizer.clip_grad_norm(float(max_norm) if math.isfinite(max_norm) else float("inf"))


    def is_elixir(self, obj) -> bool:
        """``obj`` is an Elixir model or optimizer (bare or accelerate-wrapped) of this accelerator."""
        inner = getattr(obj, "optimizer", obj) if isinstance(obj, AcceleratedOptimizer) else obj
        if isinstance(obj, torch.nn.Module) and is_prepared(obj):
            return True
        return any(inner is m or inner is o for m, o in self.entries)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches=None):
        """``Accelerator.join_uneven_inputs`` that refuses uneven inputs for Elixir models ([Note: uneven inputs]).

        Raises:
            ValueError: an Elixir model or optimizer among ``joinables`` while batches may be uneven
                (``even_batches=False`` here or in the ``Accelerator``) at several processes.
        """
        elixir = [j for j in joinables if self.is_elixir(j)]
        if not elixir:
            with self.original_join_uneven_inputs(joinables, even_batches=even_batches):
                yield
            return
        accelerator = self.accelerator
        even = accelerator.even_batches if even_batches is None else even_batches
        if not even and accelerator.num_processes > 1:
            raise ValueError(
                f"accelerator.join_uneven_inputs(even_batches={even_batches}) cannot join an hf_elixir model "
                f"({type(elixir[0]).__name__}): under hf_elixir every forward and backward is a collective over the "
                "ranks (chunk all-gathers and reduce-scatters) that PyTorch's Join cannot stand in for, so a rank "
                "that ran out of batches would leave the others waiting forever. Keep even batches (accelerate's "
                "default, DataLoaderConfiguration(even_batches=True): every rank gets the same number of batches) "
                "and drop the join_uneven_inputs(..., even_batches=False), or use DataLoader(drop_last=True)")
        others = [j for j in joinables if not self.is_elixir(j)]
        if others:  # DDP models next to the Elixir one: accelerate joins those (even batches: Join disabled)
            with self.original_join_uneven_inputs(others, even_batches=even_batches):
                yield
            return
        with _even_batches_override(accelerator, even_batches):
            yield


def _optimizers_reached(loss: torch.Tensor, trained: list[tuple[torch.nn.Module, Any]]) -> list:
    """The Elixir optimizers of the ``trained`` models whose parameters ``loss``'s autograd graph reaches.

    [Note: which model a loss belongs to] With several trained models on one accelerator (policy and value as
    in PPO, student beside a trained teacher), ``accelerator.backward(loss)`` gets no model, and what differs per
    model is the fp16 loss scale. The graph says which models the loss reached: every parameter it differentiates
    is a leaf whose ``AccumulateGrad`` node holds it (``node.variable``); an Elixir parameter keeps its identity
    ([Note: parameters as views] in ``hf_elixir/chunk/chunk.py``). The walk visits each node once and stops when
    every trained model is found; it runs only with two or more trained models. Parameters hidden inside a
    reentrant checkpoint's node are not seen: a loss whose reached models cannot be told is given to all of them
    (the caller's fallback), which is exact unless one scales its loss (fp16), refused by name.
    """
    owner = {id(p): i for i, (model, _) in enumerate(trained) for p in model.parameters() if p.requires_grad}
    found: set[int] = set()
    seen: set = set()
    stack = [loss.grad_fn]
    while stack and len(found) < len(trained):
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in owner:
            found.add(owner[id(variable)])
        stack.extend(child for child, _ in node.next_functions)
    return [trained[i][1] for i in sorted(found)]


@contextlib.contextmanager
def _even_batches_override(accelerator, even_batches):
    """Set ``even_batches`` on the accelerator's map-style dataloaders for the block, as
    ``Accelerator.join_uneven_inputs`` does (iterable-style ones keep theirs)."""
    saved = []
    if even_batches is not None:
        for dl in accelerator._dataloaders:
            sampler = getattr(dl, "batch_sampler", None)
            if hasattr(sampler, "even_batches"):
                saved.append((sampler, sampler.even_batches))
                sampler.even_batches = even_batches
    try:
        yield
    finally:
        for sampler, value in saved:
            sampler.even_batches = value


def binding_of(accelerator) -> _Binding:
    """The Elixir binding of ``accelerator``, installing it on first use (idempotent)."""
    binding = accelerator.__dict__.get("_hf_elixir_binding")
    if binding is None:
        binding = _Binding(accelerator)
        accelerator._hf_elixir_binding = binding
    return binding


def feed_tensor_parallel_rows(accelerator, model: torch.nn.Module) -> None:
    """Make ``accelerator`` give every tensor-parallel rank of a mesh row the same batches.

    [Note: tensor-parallel batches] Under ``dp x tp`` (:mod:`hf_elixir.parallel._mesh`) the ``tp`` ranks of a row
    split one model and must compute on one batch; accelerate's data loaders (the Trainer's included) give each
    of the ``num_processes`` processes its own batch. A tensor-parallel model trained through the Trainer or
    ``ElixirPlugin`` thus mixed two different batches in every all-reduce of its row: a wrong loss from the first
    step (GPT-2 tp=2: 4.463 where the stock Trainer has 4.459) and gradients of no batch. With a model rewritten
    by ``parallelize`` for ``tensor_parallel_size > 1``, data loaders this accelerator prepares from then on are
    sharded over the ``dp`` axis instead (``num_processes=dp_size``, ``process_index=dp rank``; accelerate's own
    answer for a ``(dp, tp)`` device mesh), with the accelerator's other loader settings. Expert parallelism
    needs nothing (every rank has its own batch). Installed once per accelerator, as an instance attribute.

    Raises:
        ValueError: ``dispatch_batches=True`` (one process reads and dispatches to all ``num_processes``, which
            cannot follow the ``dp`` axis).
    """
    from hf_elixir.parallel._apply import get_parallel_state  # noqa: PLC0415

    state = get_parallel_state(model)
    if state is None or not state.mesh.shares_batches_over_tp:
        return
    if accelerator.__dict__.get("_hf_elixir_tp_rows") is not None:
        return
    from accelerate.data_loader import prepare_data_loader  # noqa: PLC0415

    mesh = state.mesh
    dp_rank, dp_size = mesh.device_mesh.get_local_rank("dp"), mesh.dp_size
    accelerator._hf_elixir_tp_rows = (dp_rank, dp_size)
    original = accelerator.prepare_data_loader

    def prepare_tp_data_loader(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return original(data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch)
        if accelerator.dispatch_batches:
            raise ValueError(
                "dispatch_batches=True cannot feed a tensor-parallel model: the tensor-parallel ranks of a row need "
                "the same batches and dispatching follows all processes; use the default (dispatch_batches=None "
                "or False) so each data-parallel row reads its own shard")
        prepared = prepare_data_loader(
            data_loader, accelerator.device, num_processes=dp_size, process_index=dp_rank,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed, non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)
        return prepared

    accelerator.prepare_data_loader = prepare_tp_data_loader


def rebind_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config):
    """The ElixirOptimizer of an already prepared ``model``, set to what a fresh ``optimizer`` would be.

    A model object outlives the Trainer that trained it: the next ``Trainer(model=model, ...)`` builds a
    new torch optimizer over the same (managed) parameters. Elixir keeps the model's chunks and its one
    ElixirOptimizer; that optimizer takes the new one's hyperparameters and its empty state (moments and
    step counts start afresh, exactly as the new torch optimizer would; ``resume_from_checkpoint`` then
    loads a saved state as usual). The chunk layout, budget and placements stay as the first ``prepare``
    chose them.

    Raises:
        ValueError: the model was prepared for inference (no optimizer), the new optimizer is of another
            class or groups the parameters differently, or the precision differs from the first prepare.
    """
    import hf_elixir

    state = hf_elixir.get_state(model)
    existing = state.optimizer
    if existing is None:
        raise ValueError("this model was prepared by hf_elixir.prepare(model, optimizer=None) for inference; "
                         "prepare a fresh model with the optimizer to train it")
    if type(optimizer) is not type(existing.user_optimizer):
        raise ValueError(
            f"this model is already under hf_elixir with a {type(existing.user_optimizer).__name__}; a new "
            f"{type(optimizer).__name__} over it cannot take that one's place: keep the optimizer class "
            "(TrainingArguments.optim), or prepare a fresh model")
    groups = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
    if groups != [[id(p) for p in g["params"]] for g in existing.param_groups]:
        raise ValueError("the new optimizer groups this hf_elixir model's parameters differently from the one it "
                         "was prepared with; build it with the same param groups (same weight-decay split)")
    if config.precision != state.config.precision:
        raise ValueError(f"this model is under hf_elixir with precision={state.config.precision!r}; the new "
                         f"run asks for {config.precision!r}: keep the precision, or prepare a fresh model")
    existing.load_state_dict(optimizer.state_dict())
    return existing


def _loader_generators(loader) -> list[torch.Generator]:
    """The ``torch.Generator`` objects drawing ``loader``'s order: its own, its sampler's, its batch sampler's
    sampler's (``DataLoader(generator=...)``, ``RandomSampler(generator=...)``, a Trainer's ``data_seed``)."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def first_batch(loader: torch.utils.data.DataLoader, device: torch.device, source: str):
    """The first batch of ``loader`` on ``device``, drawn without changing what ``loader`` yields afterwards: for
    ``search="auto"``'s profiled step (``hf_elixir.prepare(..., sample_batch=)``).

    The draw runs under a forked CPU RNG (a ``RandomSampler`` without a generator seeds itself from the global
    one) and every generator of the loader's samplers is restored after it, so the training loop sees the same
    shuffled order as without the search. The loader must be a plain ``DataLoader`` (before
    ``accelerator.prepare``: iterating a prepared one registers it with accelerate's gradient state).

    Args:
        loader: the training ``DataLoader``; its batches are what ``model(**batch)`` takes.
        device: where the batch goes (``accelerate.utils.send_to_device``).
        source: who asked (``"ElixirPlugin.prepare"``, ``"ElixirCallback"``), for the error.

    Raises:
        ValueError: ``loader`` yields no batch.
    """
    from accelerate.utils import send_to_device

    generators = _loader_generators(loader)
    states = [g.get_state() for g in generators]
    iterator = None
    try:
        with torch.random.fork_rng(devices=[]):
            iterator = iter(loader)
            batch = next(iterator, None)
    finally:
        for gen, state in zip(generators, states):
            gen.set_state(state)
        _close_iterator(loader, iterator)
    if batch is None:
        raise ValueError(f"ElixirConfig.search='auto': the training DataLoader {source} profiles yields no batch; "
                         "give it a non-empty dataset or set search='off' (ELIXIR_SEARCH=off)")
    if not isinstance(batch, Mapping):
        # a TensorDataset's [x, y] reached the model as one positional list (GPT-2: "'list' object has no
        # attribute 'size'" from inside the profiler), and a loop's own loss function cannot reach the profile
        kind = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else \
            f"a {type(batch).__name__}"
        raise ValueError(
            f"ElixirConfig.search='auto' profiles one training step as model(**batch).loss on the first batch of the "
            f"training DataLoader {source}, but it yields {kind}, not a dict of the model's keyword arguments: give "
            "the DataLoader dict batches (with labels, so that a Hugging Face model returns .loss), or set "
            "search='off' (ELIXIR_SEARCH=off)")
    return send_to_device(batch, device)


def _close_iterator(loader: torch.utils.data.DataLoader, iterator) -> None:
    """Stop the worker processes of ``first_batch``'s one-batch ``iterator`` now. With ``persistent_workers=True`` the
    loader keeps its iterator (``loader._iterator``) and with it ``num_workers`` processes for as long as the loader
    lives: a Trainer trained beside one idle worker process per ``dataloader_num_workers`` of this throw-away draw
    (the training loader is another object, with its own workers)."""
    if iterator is None:
        return
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None
    shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's _MultiProcessingDataLoaderIter
    if callable(shutdown):
        shutdown()


def _prepare_explaining_no_loss(model, optimizer, config, checkpoint, sample_batch):
    """``hf_elixir.prepare`` whose "no loss in the model output" (``search="auto"``'s profiled step) speaks to an
    integration's user, who can give neither ``sample_batch`` nor ``loss_fn`` (prepare changed nothing yet).

    Raises:
        ValueError: the model returned no loss for the first training batch (no labels in it: a Trainer subclass's
            ``compute_loss`` or a training loop's own loss function, which the profile cannot run).
    """
    import hf_elixir
    from hf_elixir.profiler._step import NoLossError  # noqa: PLC0415

    try:
        return hf_elixir.prepare(model, optimizer, config=config, checkpoint=checkpoint, sample_batch=sample_batch)
    except NoLossError as err:
        keys = sorted(sample_batch) if isinstance(sample_batch, Mapping) else type(sample_batch).__name__
        raise ValueError(
            f"ElixirConfig.search='auto' profiles one training step as model(**batch).loss on the first training "
            f"batch, but {type(model).__name__} returned no loss for a batch with {keys}: the profile runs the model "
            "alone, not a Trainer's compute_loss or a training loop's own loss function. Give the batches labels (a "
            "Hugging Face model then returns .loss), or set search='off' (ELIXIR_SEARCH=off); for a searched plan "
            "without labels, write one with `hf-elixir plan ... --output plan.yaml` and pass "
            "ElixirConfig(plan='plan.yaml')") from err


def config_summary(config, source: str) -> str:
    """The one line both integrations log before ``prepare`` (``ElixirPlugin`` and ``ElixirCallback``, through
    :func:`elixir_prepare`): where the settings came from and every ``ElixirConfig`` field that differs from
    its default, e.g. ``hf_elixir: ElixirConfig from elixir.yaml: precision='bf16', offload_optimizer=True``.

    Args:
        config: the :class:`hf_elixir.ElixirConfig` about to be used (precision already merged).
        source: where it came from (a YAML path, ``ELIXIR_*`` environment variables, a constructor argument).
    """
    from hf_elixir.config import ElixirConfig  # noqa: PLC0415

    default = ElixirConfig()
    changed = []
    for f in dataclasses.fields(config):
        value, base = getattr(config, f.name), getattr(default, f.name)
        if value is not base and value != base:
            changed.append(f"{f.name}={value!r}")
    return f"hf_elixir: ElixirConfig from {source}: {', '.join(changed) or 'all defaults'}"


def elixir_prepare(accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config, checkpoint=None,
                   source: str = "the caller", sample_batch=None):
    """Run :func:`hf_elixir.prepare` and register the result with ``accelerator`` without DDP.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        model: the unwrapped model (an ``nn.Module``; not yet prepared by accelerate).
        optimizer: a torch optimizer over ``model``'s parameters, or ``None`` for a model that is only evaluated
            (prepared for inference, ``hf_elixir.prepare(model, None)``; registered with accelerate without an
            optimizer, and left out of ``accelerator.backward`` / ``clip_grad_norm_``).
        config: the :class:`hf_elixir.ElixirConfig` (precision already merged).
        checkpoint: a Hugging Face folder to stream the parameters from (``hf_elixir.prepare(...,
            checkpoint=)``; the model may be on the meta device), or ``None``.
        source: where ``config`` came from, for the settings line (:func:`config_summary`) logged first.
        sample_batch: the batch ``search="auto"`` profiles (``hf_elixir.prepare(..., sample_batch=)``), or ``None``.

    Returns:
        ``(model, accelerated_optimizer)``: the same model object (registered in
        ``accelerator._models``) and an ``AcceleratedOptimizer`` around the ``ElixirOptimizer`` (``None`` when
        ``optimizer`` is ``None``: before, an ``AcceleratedOptimizer`` around ``None`` was registered, whose
        ``accelerator.save_state`` raised an ``AttributeError``, and a trained model's ``accelerator.backward``
        refused to choose between it and the reference model).

    Raises:
        TypeError: ``model`` is already wrapped (DDP/FSDP/compiled) or ``optimizer`` already prepared.
    """
    import hf_elixir

    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        raise TypeError("ElixirPlugin.prepare got a DDP-wrapped model; pass the plain model, not accelerator.prepare's result")
    if isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    check_launch_world_size(accelerator.num_processes, "ElixirPlugin.prepare / ElixirCallback")
    binding = binding_of(accelerator)
    config = compile_from_accelerator(accelerator, config)  # [Note: torch.compile through the integrations]
    info_on_main_rank(logger, "%s", config_summary(config, source))
    if not is_prepared(model):  # [Note: parallelized by the integration] in _takeover.py
        parallelize_for_integration(model, optimizer, config, accelerator)
    if optimizer is None:  # a model only evaluated (a reference or teacher model): nothing to step or wrap
        if not is_prepared(model):
            with binding.shared_budget:
                model, _ = hf_elixir.prepare(model, None, config=config, checkpoint=checkpoint,
                                             sample_batch=sample_batch)
            log_takeover(model, source)
        model._is_accelerate_prepared = True
        binding.entries.append((model, None))
        return binding.original_prepare(model), None
    if config.precision == "fp16" and accelerator.scaler is not None:
        accelerator.scaler = None  # Elixir's loss scaler replaces accelerate's GradScaler
    if is_prepared(model):  # a model a previous Trainer/Accelerator already trained
        elixir_optimizer = rebind_optimizer(model, optimizer, config)
    else:
        with binding.shared_budget:
            model, elixir_optimizer = _prepare_explaining_no_loss(model, optimizer, config, checkpoint, sample_batch)
        log_takeover(model, source)
    wrapped = ElixirAcceleratedOptimizer(elixir_optimizer)
    model._is_accelerate_prepared = True  # accelerate: register, do not wrap (no DDP, no autocast)
    wrapped._is_accelerate_prepared = True
    binding.entries.append((model, elixir_optimizer))
    model, wrapped = binding.original_prepare(model, wrapped)
    return model, wrapped
