"""``ElixirCallback``: run ``transformers.Trainer`` under hf_elixir with one added line.

[Note: where the callback attaches to the Trainer]

A ``TrainerCallback`` receives the model, optimizer and scheduler, but not the Trainer nor its
``Accelerator``, and the Trainer's order is fixed (transformers 5.x):

1. ``__init__`` builds the ``Accelerator``, then fires ``on_init_end`` (no optimizer yet);
2. ``train()`` loads a checkpoint's weights, ``create_optimizer()``, then
   ``accelerator.prepare(model, optimizer)`` (DDP under several processes), ``create_scheduler``
   on the prepared optimizer, loads optimizer/scheduler state when resuming, then fires
   ``on_train_begin``; every step calls ``accelerator.backward`` and
   ``accelerator.clip_grad_norm_`` and reads ``self.optimizer``.

``on_train_begin`` is too late (the model is already DDP-wrapped and the optimizer state already
loaded into a plain optimizer), so the callback attaches at ``on_init_end``: it locates the Trainer
that is calling it (walking up the call stack to the ``Trainer.__init__`` frame; or call
:meth:`ElixirCallback.bind` yourself) and wraps that Trainer's ``accelerator.prepare`` so that the
``prepare(model, optimizer)`` call of step 2 runs :func:`hf_elixir.prepare` and registers the result
without DDP (see :mod:`hf_elixir.integrations._binding`). From then on the Trainer's own code does the
rest: the scheduler is created on the Elixir optimizer, ``_load_optimizer_and_scheduler`` restores
the Elixir optimizer's state, ``max_grad_norm`` goes through Elixir's global norm. With ``model_init``
(hyperparameter search) every ``train()`` builds a new model and optimizer; each one is put under
Elixir and replaces the previous one in the accelerator's binding. ``on_train_begin`` checks that the
optimizer the Trainer will step is the Elixir one. A model that an earlier Trainer already trained under
Elixir keeps its chunks; the new Trainer's fresh optimizer resets the model's ElixirOptimizer
(``_binding.rebind_optimizer``).

Two Trainer methods call collective ``state_dict()``s on the main process only; under Elixir the
consolidation is a collective, so the callback gives the Trainer instance versions of ``_save`` and
``_save_optimizer_and_scheduler`` that gather on every rank and write on the main one.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import TrainerCallback

from hf_elixir.config import ElixirConfig
from hf_elixir.integrations._binding import (binding_of, elixir_prepare, feed_tensor_parallel_rows, first_batch,
                                             merge_precision)
from hf_elixir.integrations._target_sync import serve_target_syncs
from hf_elixir.runtime._entry_check import checked_call

__all__ = ["ElixirCallback"]

logger = logging.getLogger(__name__)

_OPTIMIZER_NAME = "optimizer.pt"
_SCHEDULER_NAME = "scheduler.pt"


def _find_calling_trainer():
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class ElixirCallback(TrainerCallback):
    """
    [`~transformers.TrainerCallback`] that makes [`~transformers.Trainer`] train under hf_elixir.

    Add it at construction, `Trainer(model, args, train_dataset=..., callbacks=[ElixirCallback()])`, and
    nothing else changes: no `DistributedDataParallel` on top of Elixir's own gradient reduction,
    `max_grad_norm` clipped by Elixir's global norm, the LR scheduler driving the Elixir optimizer,
    `gradient_accumulation_steps`, `bf16=True`/`fp16=True` mapped to Elixir precision,
    `trainer.save_model()` writing a standard Hugging Face folder and `resume_from_checkpoint`
    restoring model, optimizer (incl. loss scale), scheduler and RNG. A few of Elixir's counters are
    added to every log line under `elixir/...`: the device peak, the bytes moved host->device and
    device->host in the last step, and the loss scale (`DEFAULT_LOG_KEYS`); `log_all_stats=True` adds
    every `hf_elixir.memory_stats` counter.

    Args:
        config (`hf_elixir.ElixirConfig`, *optional*):
            Elixir settings; `None` = `ElixirConfig()` with `ELIXIR_<FIELD>` environment overrides. Its
            precision is merged with the `TrainingArguments` (`bf16`/`fp16`); a conflict raises `ValueError`.
            With `search="auto"` (`ELIXIR_SEARCH=auto`) the first batch of the Trainer's training DataLoader is
            the profiled step's `sample_batch`; the loader's shuffled order stays what it would be without it.
        log_memory_stats (`bool`, defaults to `True`):
            Add Elixir's counters to the Trainer's logs (`False`: none).
        log_all_stats (`bool`, defaults to `False`):
            Log every counter of `hf_elixir.memory_stats(model)` (cumulative and per-step traffic, chunk
            counts, evictions, prefetches, ...) instead of the few in `DEFAULT_LOG_KEYS`.
        checkpoint (`str`, *optional*):
            A Hugging Face model folder to stream the parameters from when the Trainer's model was built
            on the meta device (`hf_elixir.prepare(..., checkpoint=)`): each process reads only its shards.

    Example:

    ```python
    >>> from transformers import Trainer, TrainingArguments
    >>> from hf_elixir.integrations import ElixirCallback
    >>> trainer = Trainer(model, TrainingArguments("out", bf16=True), train_dataset=ds, callbacks=[ElixirCallback()])
    >>> trainer.train()
    >>> trainer.save_model("out/final")  # loads with AutoModel.from_pretrained, no hf_elixir needed
    ```
    """

    #: `memory_stats` keys logged by default (as `elixir/<key>`): device peak, last step's traffic, loss scale
    DEFAULT_LOG_KEYS = ("device_peak_bytes", "step_h2d_bytes", "step_d2h_bytes", "loss_scale")

    def __init__(self, config: ElixirConfig | None = None, log_memory_stats: bool = True,
                 checkpoint: str | None = None, log_all_stats: bool = False) -> None:
        if config is not None and not isinstance(config, ElixirConfig):
            raise TypeError(f"ElixirCallback(config={config!r}) must be an hf_elixir.ElixirConfig or None")
        self.config = config
        self._source = "ElixirCallback(config=...)"  # for the settings line logged at prepare
        self.checkpoint = checkpoint
        self.log_memory_stats = log_memory_stats
        self.log_all_stats = log_all_stats
        self.trainer = None
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self._train_loader: torch.utils.data.DataLoader | None = None  # see _prepare

    # ------------------------------------------------------------------ attaching
    def bind(self, trainer) -> None:
        """Attach to `trainer` (done automatically in `on_init_end`; call it yourself if the
        callback was added with `trainer.add_callback` after construction).

        Raises:
            ValueError: precision conflict, or the Trainer uses DeepSpeed/FSDP (they replace Elixir).
        """
        if self.trainer is trainer:
            return
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError("ElixirCallback cannot be combined with DeepSpeed or FSDP in TrainingArguments; remove one")
        args = trainer.args
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
        if self.config is None:
            self._source = "ElixirCallback (ELIXIR_* environment variables)"
        config = self.config if self.config is not None else _config_from_env()
        self.config = merge_precision(config, precision, source="TrainingArguments (bf16/fp16)")
        self.trainer = trainer
        accelerator = trainer.accelerator
        binding_of(accelerator)
        if trainer.model is not None:  # tp ranks of a row read the same batches ([Note: tensor-parallel batches])
            feed_tensor_parallel_rows(accelerator, trainer.model)
        original_prepare = accelerator.prepare
        callback = self

        def prepare(*objects, device_placement=None):
            return callback._prepare(original_prepare, objects, device_placement)

        accelerator.prepare = prepare
        trainer._save = types.MethodType(_save_gathered(type(trainer)._save), trainer)
        trainer._save_optimizer_and_scheduler = types.MethodType(_save_optimizer_and_scheduler, trainer)
        trainer._load_optimizer_and_scheduler = types.MethodType(
            _load_optimizer_and_scheduler_per_rank(type(trainer)._load_optimizer_and_scheduler), trainer)
        trainer._load_from_checkpoint = types.MethodType(
            _load_parallel_checkpoint(type(trainer)._load_from_checkpoint), trainer)
        trainer._load_best_model = types.MethodType(_load_parallel_best_model(type(trainer)._load_best_model), trainer)
        if hasattr(type(trainer), "get_tp_size"):  # throughput and epochs count data-parallel rows, not processes
            trainer.get_tp_size = types.MethodType(_tp_size_of_parallel_model(type(trainer).get_tp_size), trainer)
        if hasattr(type(trainer), "_track_num_input_tokens"):  # and tokens: a row's tp ranks read one batch
            trainer._track_num_input_tokens = types.MethodType(
                _tokens_once_per_row(type(trainer)._track_num_input_tokens), trainer)
        # Run first so Elixir's counters are in `logs` before the printer/reporters see them.
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
            handler.callbacks.insert(0, self)

    def _prepare(self, original_prepare, objects: tuple, device_placement):
        trainer = self.trainer
        model = trainer.model
        # The Trainer's current model with a fresh torch optimizer: the first `train()`, or every `train()`
        # with `model_init` (hyperparameter search builds a new model and optimizer each time). A model
        # already under Elixir with its AcceleratedOptimizer (a second `train()`, an auto_find_batch_size
        # retry) only needs accelerate to register it again.
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer) and not isinstance(o, AcceleratedOptimizer)]
        loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
        if loaders:
            # `train()` prepares the plain training DataLoader (`get_train_dataloader`) right before the model and
            # optimizer, so the last loader seen here when they come is the training one: its first batch is
            # `search="auto"`'s profiled step (an evaluation loader prepared earlier is replaced by it).
            self._train_loader = loaders[-1]
        if model is not self.model and any(o is model for o in objects) and len(optimizers) == 1:
            if self.model is not None:  # model_init replaced the model: the old one leaves the binding
                binding_of(trainer.accelerator).forget(self.model)
            sample_batch = None
            if self.config.search == "auto":
                if self._train_loader is None:
                    raise ValueError("ElixirCallback with ElixirConfig.search='auto' profiles the first training batch, "
                                     "but the Trainer prepared no training DataLoader before the model; give the "
                                     "Trainer a train_dataset, or set search='off' (ELIXIR_SEARCH=off)")
                sample_batch = first_batch(self._train_loader, trainer.accelerator.device, "the Trainer built")
            prepared_model, prepared_opt = elixir_prepare(trainer.accelerator, model, optimizers[0], self.config,
                                                         checkpoint=self.checkpoint, source=self._source,
                                                         sample_batch=sample_batch)
            self.model, self.optimizer = prepared_model, prepared_opt.optimizer
            out = [prepared_model if o is model else prepared_opt if o is optimizers[0] else o for o in objects]
            rest = [o for o in out if o is not prepared_model and o is not prepared_opt]
            if rest:
                done = original_prepare(*rest, device_placement=device_placement)
                done = iter(done if isinstance(done, tuple) else (done,))
                out = [o if (o is prepared_model or o is prepared_opt) else next(done) for o in out]
            return tuple(out) if len(out) > 1 else out[0]
        return original_prepare(*objects, device_placement=device_placement)

    # ------------------------------------------------------------------ events
    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = _find_calling_trainer()
            if trainer is None:
                raise RuntimeError(
                    "ElixirCallback could not find the Trainer it belongs to; pass it at construction "
                    "(Trainer(..., callbacks=[ElixirCallback()])) or call callback.bind(trainer)"
                )
            self.bind(trainer)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.trainer is None or self.optimizer is None or getattr(optimizer, "optimizer", optimizer) is not self.optimizer:
            raise RuntimeError(
                "ElixirCallback is not attached: the Trainer prepared its optimizer without Elixir. Pass the "
                "callback at Trainer construction, or call callback.bind(trainer) before trainer.train()"
            )
        # TRL's reference/teacher syncs read the model between steps ([Note: reference and teacher syncs between
        # steps] in _target_sync.py); TRL adds them in its own __init__, after the callbacks given to it
        serve_target_syncs(self.trainer.callback_handler.callbacks)

    def on_step_end(self, args, state, control, **kwargs):
        # The Trainer clears gradients with `model.zero_grad()` only; Elixir's gradient shards live in
        # chunk buffers that the optimizer owns, so clear them here, before the next step's backward.
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not self.log_memory_stats or logs is None or self.model is None or "loss" not in logs:
            return
        import hf_elixir

        stats = dict(hf_elixir.memory_stats(self.model))
        scale = _loss_scale(self.optimizer)
        if scale is not None:
            stats["loss_scale"] = scale
        keep = stats if self.log_all_stats else {k: stats[k] for k in self.DEFAULT_LOG_KEYS if k in stats}
        extra: dict[str, Any] = {f"elixir/{k}": v for k, v in keep.items()}
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


def _config_from_env() -> ElixirConfig:
    return ElixirConfig.from_env()  # a typo'd variable warns, a bad value names its variable


def _loss_scale(optimizer) -> float | None:
    for name in ("loss_scale", "scale"):
        value = getattr(optimizer, name, None)
        if callable(value):
            value = value()
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _save_gathered(original_save):
    """Trainer._save that consolidates the state dict on every rank (a collective under Elixir).

    A model rewritten by ``hf_elixir.parallel.parallelize`` (tensor/expert parallel) gets the unmodified model's
    full state dict through ``gather_full_state_dict`` (collective over every rank, as its ``state_dict()``), kept
    on the writing rank only (on every rank when ``save_on_each_node`` makes more than one rank write)."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:
            from hf_elixir.parallel._gather import gather_full_state_dict  # noqa: PLC0415

            with checked_call("trainer.save_model(...)", label=True):  # names it in a collective entry error
                if _parallelized(self.model):
                    state_dict = gather_full_state_dict(self.model, rank0_only=not self.args.save_on_each_node)
                else:
                    state_dict = self.accelerator.get_state_dict(self.model)
        return original_save(self, output_dir, state_dict=state_dict)

    return _save


def _has_safetensors(folder) -> bool:
    """Whether ``folder`` holds the model's own safetensors weights (single file or an index)."""
    return any(os.path.isfile(os.path.join(folder, name))
               for name in ("model.safetensors", "model.safetensors.index.json"))


def _parallelized(model) -> bool:
    from hf_elixir.parallel._apply import get_parallel_state  # noqa: PLC0415

    return get_parallel_state(model) is not None


def _rank_optimizer_name(rank: int) -> str:
    """Optimizer file of rank ``rank`` of a tensor/expert-parallel model: ``optimizer.pt`` on rank 0 (where the
    Trainer looks), ``optimizer_rank<r>.pt`` on the others."""
    return _OPTIMIZER_NAME if rank == 0 else f"optimizer_rank{rank}.pt"


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    """Trainer._save_optimizer_and_scheduler for Elixir: every rank gathers, the main one writes.

    [Note: parallel optimizer files] After ``hf_elixir.parallel.parallelize`` the consolidated optimizer state
    holds the parameters this rank computes with (its experts, its tensor-parallel shards), so one file from the
    main rank cannot resume the others (their load failed naming param groups that differ past the shared
    parameters). Each rank writes its own (:func:`_rank_optimizer_name`) and
    :func:`_load_optimizer_and_scheduler_per_rank` reads it back."""
    import warnings

    optimizer_state = self.optimizer.state_dict()
    if _parallelized(self.model):
        torch.save(optimizer_state, os.path.join(output_dir, _rank_optimizer_name(self.args.process_index)))
    elif self.args.should_save:
        torch.save(optimizer_state, os.path.join(output_dir, _OPTIMIZER_NAME))
    if self.args.should_save:
        with warnings.catch_warnings(record=True):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))


def _tp_size_of_parallel_model(original_get_tp_size):
    """Trainer.get_tp_size that knows a model rewritten by ``parallelize`` for tensor parallel.

    [Note: Trainer metrics under tensor parallel] The Trainer counts the samples of a run as per-device batch x
    gradient accumulation x ``world_size // get_tp_size()`` (``get_total_train_batch_size``), which sets the
    ``Total train batch size`` it logs, ``train_samples_per_second`` and, with ``max_steps``, the samples it
    reports. ``get_tp_size`` knows transformers' own tensor parallel (``model._tp_size``), DeepSpeed AutoTP and
    accelerate's ``ParallelismConfig``, not hf_elixir's mesh, so the ``tp`` ranks of a row, which read one batch
    ([Note: tensor-parallel batches] in ``_binding.py``), were counted as data-parallel ones (GPT-2 at tp=2 on 2
    processes: 8 samples a step reported where 4 were consumed; ``num_input_tokens_seen`` sums every process's
    tokens: :func:`_tokens_once_per_row`). Expert parallel needs nothing: every rank reads its own batch."""
    def get_tp_size(self) -> int:
        from hf_elixir.parallel._apply import get_parallel_state  # noqa: PLC0415

        state = get_parallel_state(self.model) if self.model is not None else None
        if state is not None and state.mesh.shares_batches_over_tp:
            return state.mesh.tp_size
        return original_get_tp_size(self)

    return get_tp_size


def _tokens_once_per_row(original_track):
    """Trainer._track_num_input_tokens that counts a tensor-parallel row's batch once: it sums every process's
    tokens, and the ``tp`` ranks of a row read the same batch ([Note: Trainer metrics under tensor parallel])."""
    def _track_num_input_tokens(self, inputs) -> None:
        before = self.state.num_input_tokens_seen
        original_track(self, inputs)
        tp_size = self.get_tp_size()
        if tp_size > 1:
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // tp_size

    return _track_num_input_tokens


def _load_parallel_checkpoint(original_load):
    """Trainer._load_from_checkpoint that loads a tensor/expert-parallel model's checkpoint into this rank's parts.

    The checkpoint holds the unmodified model's full tensors (:func:`_save_gathered`), which do not fit this rank's
    column/row shards or expert slices (before: ``load_state_dict``'s size mismatches, so resuming a
    tensor-parallel model was refused). For a model rewritten by ``hf_elixir.parallel.parallelize`` every rank
    reads its own slices of the folder's tensors (:func:`hf_elixir.parallel.load_full_state_dict`, [Note: loading
    full tensors] in ``hf_elixir/parallel/_load.py``); any other model loads as the Trainer does. The optimizer
    state follows from each rank's own file ([Note: parallel optimizer files]).

    Raises:
        ValueError: the folder lacks a parameter of the model or holds another shape (names them).
        FileNotFoundError: the folder holds no safetensors weights.
    """

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from hf_elixir.parallel._load import load_folder_state_dict, load_full_state_dict  # noqa: PLC0415

        target = model if model is not None else self.model
        if not _parallelized(target):
            if _has_safetensors(resume_from_checkpoint):
                # the folder holds save_pretrained's on-disk names (Mixtral's per-expert w1/w2/w3): read them
                # through transformers' conversion mapping, where the Trainer's plain load_state_dict missed them
                self._issue_warnings_after_load(load_folder_state_dict(target, resume_from_checkpoint))
                return None
            return original_load(self, resume_from_checkpoint, model) if model is not None else \
                original_load(self, resume_from_checkpoint)
        logger.info("loading this rank's tensor/expert-parallel parts of %s", resume_from_checkpoint)
        result = load_full_state_dict(target, resume_from_checkpoint)
        self._issue_warnings_after_load(result)
        return None

    return _load_from_checkpoint


def _load_parallel_best_model(original_load):
    """Trainer._load_best_model (``load_best_model_at_end=True``) that loads a tensor/expert-parallel model's best
    checkpoint into this rank's parts (as :func:`_load_parallel_checkpoint`; the model is prepared by then, so the load
    is collective, and the Trainer calls it on every rank); any other model loads as the Trainer does."""

    def _load_best_model(self) -> None:
        from hf_elixir.parallel._load import load_full_state_dict  # noqa: PLC0415

        if not _parallelized(self.model):
            return original_load(self)
        logger.info("loading this rank's parts of the best model %s (score %s)", self.state.best_model_checkpoint,
                    self.state.best_metric)
        self._issue_warnings_after_load(load_full_state_dict(self.model, self.state.best_model_checkpoint))
        return None

    return _load_best_model


def _load_optimizer_and_scheduler_per_rank(original_load):
    """Trainer._load_optimizer_and_scheduler that reads each rank's own optimizer file for a tensor/expert-parallel
    model ([Note: parallel optimizer files]); any other model loads as the Trainer does.

    Raises:
        FileNotFoundError: a parallel model's checkpoint lacks this rank's optimizer file (saved by another
            number of ranks, or before per-rank files), naming the file.
    """

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _parallelized(self.model):
            return original_load(self, checkpoint)
        if not os.path.isfile(os.path.join(checkpoint, _SCHEDULER_NAME)):
            return None  # as the Trainer: no optimizer/scheduler state saved, nothing to restore
        path = os.path.join(checkpoint, _rank_optimizer_name(self.args.process_index))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} not found: a tensor/expert-parallel model resumes each rank's optimizer state from its own "
                f"file; resume from a checkpoint saved by this ElixirCallback with the same {self.args.world_size} "
                "processes")
        self.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER_NAME), map_location="cpu",
                                                     weights_only=True))
        return None

    return _load_optimizer_and_scheduler
