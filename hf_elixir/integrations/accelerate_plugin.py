"""``ElixirPlugin``: train with hf_elixir inside an ordinary Accelerate script."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_elixir.config import ElixirConfig, env_values
from hf_elixir.integrations._binding import elixir_prepare, feed_tensor_parallel_rows, first_batch, merge_precision
from hf_elixir.integrations._launch_config import find_launch_config_file, read_elixir_section

__all__ = ["ElixirPlugin", "resolve_elixir_config"]

logger = logging.getLogger(__name__)


def _env_overrides(prefix: str = "ELIXIR_") -> dict[str, Any]:
    """``ELIXIR_<FIELD>`` overrides as ``{field: value}`` (:func:`hf_elixir.config.env_values`: a variable that is
    no field warns, a value that is not YAML raises naming it)."""
    return env_values(prefix)


def resolve_elixir_config(config_file: str | os.PathLike | None = None) -> tuple[ElixirConfig, Path | None]:
    """Build the ElixirConfig a launched process should use.

    Reads the ``dynamo_config.elixir`` section of the launch YAML (found as described in
    :mod:`hf_elixir.integrations._launch_config`), then applies ``ELIXIR_<FIELD>`` environment
    overrides.

    Returns:
        ``(config, path)``: the config and the file it came from (``None`` if no file was found).

    Raises:
        ValueError / TypeError: an unknown or invalid field (from :meth:`ElixirConfig.from_dict`).
    """
    path = find_launch_config_file(config_file)
    values = read_elixir_section(path) if path is not None else {}
    env = _env_overrides()
    values.update(env)
    try:
        return ElixirConfig.from_dict(values), path
    except (TypeError, ValueError) as err:
        where = [f"ELIXIR_{k.upper()} (environment)" for k in env] + ([str(path)] if path is not None else [])
        raise type(err)(f"{err} (settings read from: {', '.join(where)})") from None


@dataclass
class ElixirPlugin:
    """
    Plugin that lets an [`~accelerate.Accelerator`] training loop run under hf_elixir: parameters
    packed into chunks, sharded across processes, offloaded under a device-memory budget, and
    gradients reduced by Elixir itself (the model is never wrapped in `DistributedDataParallel`).

    After [`~ElixirPlugin.prepare`], the usual Accelerate calls keep working:
    `accelerator.backward(loss)` (fp16 loss scaling included), `accelerator.clip_grad_norm_(...)` (global
    norm over all shards), `accelerator.accumulate(model)`, `accelerator.save_state()` /
    `load_state()`, `accelerator.get_state_dict(model)` and `accelerator.unwrap_model(model)`.

    Args:
        config (`hf_elixir.ElixirConfig`, *optional*):
            The Elixir settings. When `None`, they are read from the `dynamo_config.elixir` section of
            the YAML given to `accelerate launch --config_file` (or from `config_file` /
            `$ELIXIR_CONFIG_FILE`), then `ELIXIR_<FIELD>` environment variables override single fields.
        config_file (`str`, *optional*):
            Path of the accelerate/Elixir YAML to read when `config` is `None`.
        checkpoint (`str`, *optional*):
            A Hugging Face model folder (safetensors) to stream the parameters from, for a model built on
            the meta device (`with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)`):
            each process reads only its own shards (`hf_elixir.prepare(..., checkpoint=)`).

    The precision follows the accelerator's `mixed_precision` (`"bf16"`/`"fp16"`) unless the Elixir
    config sets one; conflicting settings raise `ValueError`.

    Example:

    ```python
    >>> from accelerate import Accelerator
    >>> from hf_elixir.integrations import ElixirPlugin
    >>> accelerator = Accelerator()
    >>> plugin = ElixirPlugin()  # settings from `accelerate launch --config_file elixir.yaml`
    >>> model, optimizer, train_dl, scheduler = plugin.prepare(accelerator, model, optimizer, train_dl, scheduler)
    >>> for batch in train_dl:
    ...     with accelerator.accumulate(model):
    ...         accelerator.backward(model(**batch).loss)
    ...         accelerator.clip_grad_norm_(model.parameters(), 1.0)
    ...         optimizer.step()
    ...         scheduler.step()
    ...         optimizer.zero_grad()
    ```
    """

    config: ElixirConfig | None = field(default=None, metadata={"help": "ElixirConfig; None = read the launch YAML"})
    config_file: str | None = field(default=None, metadata={"help": "accelerate/Elixir YAML to read"})
    checkpoint: str | None = field(default=None, metadata={"help": "Hugging Face folder to stream the weights from"})
    source_file: Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.config is None:
            self.config, self.source_file = resolve_elixir_config(self.config_file)
        elif not isinstance(self.config, ElixirConfig):
            raise TypeError(f"ElixirPlugin.config={self.config!r} must be an hf_elixir.ElixirConfig or None")

    def _source(self) -> str:
        """Where the settings came from, for the settings line ``prepare`` logs."""
        if self.source_file is not None:
            return f"{self.source_file} (and ELIXIR_* environment variables)"
        if self.config_file is None and not _env_overrides():
            return "ElixirPlugin(config=...)" if self.config != ElixirConfig() else "ElixirPlugin (defaults)"
        return "ElixirPlugin (ELIXIR_* environment variables)"

    def prepare(self, accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *others):
        """Put `model`/`optimizer` under Elixir and let `accelerator` prepare the rest.

        Args:
            accelerator (`accelerate.Accelerator`): the script's accelerator.
            model (`torch.nn.Module`): the plain model (do not pass it to `accelerator.prepare` first).
            optimizer (`torch.optim.Optimizer` or `None`): an optimizer over `model.parameters()`; `None` for a
                model that is only evaluated (a frozen reference or teacher model beside the trained one): it is
                prepared for inference (`hf_elixir.prepare(model, None)`), `None` is returned in the optimizer's
                place, and `accelerator.backward` / `clip_grad_norm_` keep going to the trained model.
            *others: dataloaders and LR schedulers, prepared by `accelerator.prepare` as usual
                (schedulers built on `optimizer` then drive the Elixir optimizer: its param_groups
                are `optimizer`'s).

        Returns:
            `(model, optimizer, *others)` in the order given: the same model object and an
            `AcceleratedOptimizer` around the `ElixirOptimizer` (`None` when `optimizer` is `None`).

        Raises:
            ValueError: precision conflict between the Elixir config and the accelerator.
            TypeError: `model` was already wrapped by `accelerator.prepare`.
            ValueError: `search="auto"` without a `DataLoader` in `others` to take the profiled batch from.

        With `ElixirConfig(search="auto")` the first batch of the first `DataLoader` in `others` is the
        `sample_batch` of `hf_elixir.prepare` (the profiled step, moved to `accelerator.device`); the global
        torch RNG is restored afterwards, so the loader shuffles as it would without the search.
        """
        config = merge_precision(self.config, accelerator.mixed_precision)
        self.config = config
        sample_batch = _sample_batch(others, accelerator.device) if config.search == "auto" else None
        model, optimizer = elixir_prepare(accelerator, model, optimizer, config, checkpoint=self.checkpoint,
                                          source=self._source(), sample_batch=sample_batch)
        if not others:
            return model, optimizer
        feed_tensor_parallel_rows(accelerator, model)  # [Note: tensor-parallel batches] in _binding.py
        prepared = accelerator.prepare(*others)
        prepared = prepared if isinstance(prepared, tuple) else (prepared,)
        return (model, optimizer, *prepared)


def _sample_batch(others: tuple, device: torch.device):
    """The first batch of the first ``DataLoader`` in ``others`` on ``device`` (:func:`first_batch`: the loader's
    order is left as it was), for ``search="auto"``'s profiled step.

    Raises:
        ValueError: no ``DataLoader`` in ``others``, or it yields no batch.
    """
    loader = next((o for o in others if isinstance(o, torch.utils.data.DataLoader)), None)
    if loader is None:
        raise ValueError("ElixirConfig.search='auto' profiles one training step on a batch: pass the training "
                         "DataLoader to ElixirPlugin.prepare(accelerator, model, optimizer, train_loader, ...) "
                         "(its first batch is profiled), or set search='off' (ELIXIR_SEARCH=off)")
    return first_batch(loader, device, "passed to ElixirPlugin.prepare")
