"""The accelerator's ``torch.compile`` settings as ``ElixirConfig.compile``.

[Note: torch.compile through the integrations] ``TrainingArguments(torch_compile=True)`` (with
``torch_compile_backend`` / ``torch_compile_mode``) and an accelerate config's ``dynamo_backend`` (``dynamo_mode``,
``dynamo_use_fullgraph``, ``dynamo_use_dynamic``) reach the ``Accelerator`` as its ``TorchDynamoPlugin``;
accelerate would compile the whole model at the end of ``prepare_model``, a step an Elixir model skips (it is
registered as already prepared: [Note: why the accelerator instance is adjusted] in ``_binding.py``), and that
whole-model compile would trace Elixir's hooks. The plugin's settings become ``ElixirConfig.compile`` instead,
so hf_elixir compiles each transformer block with its hooks outside ([Note: compiled blocks] in
``hf_elixir/runtime/compile.py``). An explicit ``ElixirConfig.compile`` wins over the accelerator's.
"""

from __future__ import annotations

import dataclasses

__all__ = ["compile_from_accelerator"]


def compile_from_accelerator(accelerator, config):
    """``config`` with ``compile`` taken from ``accelerator``'s dynamo plugin when ``config.compile`` is off and
    the plugin's backend is not ``"no"``; otherwise ``config`` unchanged."""
    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    backend = str(getattr(getattr(plugin, "backend", None), "value", "NO")).lower()
    if config.compile or backend == "no":
        return config
    kwargs = {"backend": backend}
    if getattr(plugin, "mode", None) not in (None, "default"):
        kwargs["mode"] = plugin.mode
    if getattr(plugin, "fullgraph", False):
        kwargs["fullgraph"] = True
    if getattr(plugin, "dynamic", None) is not None:
        kwargs["dynamic"] = plugin.dynamic
    if getattr(plugin, "options", None):
        kwargs["options"] = dict(plugin.options)
    return dataclasses.replace(config, compile=kwargs)
