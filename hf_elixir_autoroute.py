"""Start hook: plain ``accelerate launch --config_file elixir.yaml train.py`` routes an unchanged script to hf_elixir.

[Note: the start hook]

accelerate 1.16 has no engine entry point and passes a launched process neither its config path nor free-form
settings ([Note: how elixir.yaml reaches the training processes] in ``hf_elixir/integrations/_launch_config.py``),
so an unchanged script (``Accelerator()``, ``accelerator.prepare(model, optimizer)``, a plain loop or a stock
``Trainer``) can only reach hf_elixir if something runs in its process before the script's ``prepare``. This module
is that something. It is registered in the ``torch.backends`` entry-point group (pyproject), which ``import torch``
loads in every process of the environment (torch >= 2.5, ``torch._import_device_backends``), so it is kept to
what such a hook may cost and risk:

* On ``import torch`` it reads two environment variables and returns, unless the process was started by
  ``accelerate launch`` (``ACCELERATE_DYNAMO_BACKEND``, which accelerate sets in every process it starts). It
  imports nothing beyond the standard library and never raises (a failure there would fail ``import torch``).
* In a launched process it watches imports (a ``sys.meta_path`` entry that finds nothing itself). Once
  ``accelerate.accelerator`` has defined ``Accelerator`` (and ``transformers.trainer`` has defined ``Trainer``, if
  the script uses it), it puts a first-call trigger on ``Accelerator.prepare`` and ``Trainer.__init__``; the
  trigger imports nothing while those packages may still be half imported. At the first call it puts the
  originals back, finds the launch's config file as ``ElixirPlugin`` does and, only if the file has a
  ``dynamo_config.elixir`` section, installs the router (:func:`hf_elixir.integrations._route.install`). A config
  without the section (a DDP, FSDP or DeepSpeed launch) is left alone: the script runs as accelerate runs it.
  An invalid Elixir section raises there (``ValueError`` naming the field), in the script's ``prepare`` call,
  rather than letting the run train as DDP; only an hf_elixir that does not import is a warning.

``hf-elixir launch`` (``hf_elixir.integrations.launch``) installs the same router explicitly and also works
where no ``accelerate launch`` parent exists (``torchrun ... -m hf_elixir.integrations.launch`` with
``ELIXIR_CONFIG_FILE``). Off switches: ``HF_ELIXIR_AUTOROUTE=0``, or torch's own
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (which turns off every ``torch.backends`` entry point).

[Note: the start hook stays out of other launches]

``torch.backends`` is the group torch made for out-of-tree *device* backends; neither torch nor accelerate offers
an entry point for "run before a launched script's prepare", so the hook borrows it and owes every other launch
that it costs nothing and changes nothing there:

* **No import of hf_elixir** unless the launch's config file has the Elixir section: finding the file
  (:func:`find_launch_config_file`) and reading it (:func:`has_elixir_section`) live in ``hf_elixir_launch_config.py``,
  on the standard library and PyYAML (which accelerate has already imported), so a DDP, FSDP or DeepSpeed launch ends
  with no ``hf_elixir`` module in ``sys.modules`` (a test counts them).
* **Signatures kept**: a trigger is ``functools.wraps`` of the method it stands in for, so ``inspect.signature``
  of ``Trainer.__init__`` and ``Accelerator.prepare`` is the same before the first call as after (libraries that
  look for a parameter there see it).
* **No silent choice between two files**: an ``ELIXIR_CONFIG_FILE`` left in the environment that names another
  file than the launcher's ``--config_file`` raises ``ValueError`` naming both (a stale one used to route a DDP
  launch to hf_elixir).
"""

from __future__ import annotations

import functools
import os
import sys

# finding and reading the launch's config file: the standard library and PyYAML, no hf_elixir
from hf_elixir_launch_config import find_launch_config_file, has_elixir_section

__all__ = ["autoload"]

_LAUNCHED_ENV = "ACCELERATE_DYNAMO_BACKEND"  # set by accelerate launch in every process it starts
_OFF_ENV = "HF_ELIXIR_AUTOROUTE"


class _RouteWhenImported:
    """A ``sys.meta_path`` entry that finds no module: on every new import it checks whether accelerate's
    ``Accelerator`` and transformers' ``Trainer`` exist yet and puts a first-call trigger on each
    (``Accelerator.prepare``, ``Trainer.__init__``). The triggers import nothing: the class may be defined while
    its package is still half imported."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 - the finder protocol
        for module, cls, method in _TARGETS:
            found = getattr(sys.modules.get(module), cls, None)
            if found is not None and (module, cls, method) not in _ORIGINALS:
                _ORIGINALS[(module, cls, method)] = original = found.__dict__[method]
                _TRIGGERS[(module, cls, method)] = trigger = _trigger(found, method, original)
                setattr(found, method, trigger)
        if len(_ORIGINALS) == len(_TARGETS) or _ACTIVATED:
            _remove(self)
        return None


#: (module, class, method) that get a first-call trigger, and the originals the triggers put back
_TARGETS = (("accelerate.accelerator", "Accelerator", "prepare"), ("transformers.trainer", "Trainer", "__init__"))
_ORIGINALS: dict[tuple[str, str, str], object] = {}
_TRIGGERS: dict[tuple[str, str, str], object] = {}
_ACTIVATED: list[bool] = []


def _trigger(cls, method: str, original):
    @functools.wraps(original)  # the same inspect.signature before the first call ([Note: ... other launches])
    def first_call(self, *args, **kwargs):
        outermost = cls.__dict__.get(method) is first_call
        _activate()
        if outermost:  # put back by _activate: what is there now is the original or the router's wrapper of it
            return getattr(cls, method)(self, *args, **kwargs)
        return original(self, *args, **kwargs)  # something wrapped the trigger (hf-elixir launch's router): pass on

    return first_call


def _remove(finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def _activate() -> None:
    """At the first ``accelerator.prepare`` or ``Trainer(...)``: put every original back, then install the router
    if this launch's config file has an Elixir section (everything is fully imported by now).

    Raises:
        ValueError: ``ELIXIR_CONFIG_FILE`` names another file than the launcher's ``--config_file``, or the
            Elixir section holds an invalid field.
    """
    if _ACTIVATED:
        return
    _ACTIVATED.append(True)
    for key, original in _ORIGINALS.items():
        module, cls, method = key
        owner = getattr(sys.modules[module], cls)
        if owner.__dict__.get(method) is _TRIGGERS[key]:  # not if something wrapped it since (functools.wraps
            setattr(owner, method, original)            # copies a trigger's name: compared by identity)
    for finder in [f for f in sys.meta_path if isinstance(f, _RouteWhenImported)]:
        _remove(finder)
    path = find_launch_config_file()  # ValueError: ELIXIR_CONFIG_FILE disagrees with --config_file
    if path is None or not has_elixir_section(path):
        return  # not an Elixir launch: hf_elixir is not imported ([Note: the start hook stays out of other launches])
    try:
        from hf_elixir.integrations._route import install_for_accelerate_launch
    except Exception as err:  # noqa: BLE001 - a broken install must not stop launches that do not use hf_elixir
        import warnings

        warnings.warn(f"hf_elixir is installed but does not import ({type(err).__name__}: {err}): this `accelerate "
                      "launch` is not routed to it", RuntimeWarning, stacklevel=3)
        return
    install_for_accelerate_launch(path)  # an invalid Elixir section raises here, inside the script's prepare call


def autoload() -> None:
    """The ``torch.backends`` entry point: see [Note: the start hook]. Never raises."""
    try:
        if os.environ.get(_OFF_ENV, "1") == "0" or _LAUNCHED_ENV not in os.environ:
            return
        if any(isinstance(f, _RouteWhenImported) for f in sys.meta_path):
            return
        sys.meta_path.insert(0, _RouteWhenImported())
    except Exception:  # noqa: BLE001 - a start hook must not fail `import torch`
        return
