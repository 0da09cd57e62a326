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
  (:func:`find_launch_config_file`) and reading it (:func:`has_elixir_section`) live here, on the standard
  library and PyYAML (which accelerate has already imported), so a DDP, FSDP or DeepSpeed launch ends with no
  ``hf_elixir`` module in ``sys.modules`` (a test counts them).
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
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ELIXIR_SECTION", "autoload", "find_launch_config_file", "has_elixir_section", "read_launch_config"]

_LAUNCHED_ENV = "ACCELERATE_DYNAMO_BACKEND"  # set by accelerate launch in every process it starts
_OFF_ENV = "HF_ELIXIR_AUTOROUTE"
_CONFIG_FILE_ENV = "ELIXIR_CONFIG_FILE"
_MAX_PARENT_DEPTH = 4
#: (top-level accelerate key, sub-key) under which elixir.yaml keeps the ElixirConfig fields.
ELIXIR_SECTION: tuple[str, str] = ("dynamo_config", "elixir")


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


# ------------------------------------------------------------------------------------ finding the launch's config
def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may contain spaces/parentheses, so split after the last ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None


def _config_file_from_launcher_argv(argv: list[str]) -> str | None:
    """The ``--config_file`` value of an ``accelerate launch`` argv, ``""`` if it has none, else None."""
    head = argv[:4]
    via_cli = any(Path(a).name == "accelerate" for a in head[:2]) and "launch" in head
    via_module = "accelerate.commands.launch" in head or any(a.endswith("accelerate/commands/launch.py") for a in head)
    if not (via_cli or via_module):
        return None
    for i, arg in enumerate(argv):
        if arg == "--config_file" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    return ""


def _launcher_config_file() -> tuple[Path | None, bool]:
    """The config file of the ``accelerate launch`` that started this process (searched up to
    ``_MAX_PARENT_DEPTH`` parents), and whether it came from ``--config_file`` (``False``: accelerate's default
    file, or no launcher at all: ``(None, False)``)."""
    pid: int | None = os.getpid()
    for _ in range(_MAX_PARENT_DEPTH):
        pid = _parent_pid(pid) if pid is not None else None
        if pid is None or pid <= 1:
            return None, False
        found = _config_file_from_launcher_argv(_cmdline(pid))
        if found is None:
            continue
        if found == "":
            from accelerate.commands.config import default_config_file

            return (Path(default_config_file) if os.path.isfile(default_config_file) else None), False
        path = Path(found).expanduser()
        if not path.is_absolute():
            try:
                path = Path(os.readlink(f"/proc/{pid}/cwd")) / path
            except OSError:
                path = path.resolve()
        return (path.resolve() if path.is_file() else None), True
    return None, False


def find_launch_config_file(explicit: str | os.PathLike | None = None) -> Path | None:
    """Locate the accelerate/Elixir YAML for this process: ``explicit``, else ``ELIXIR_CONFIG_FILE``, else the
    ``--config_file`` of the ``accelerate launch`` parent (accelerate's default file without one); [Note: how
    elixir.yaml reaches the training processes] in ``hf_elixir/integrations/_launch_config.py``.

    Args:
        explicit: a path given by the user; wins over everything else.

    Returns:
        The absolute path, or ``None`` when the process was not started by ``accelerate launch``
        and neither ``explicit`` nor ``ELIXIR_CONFIG_FILE`` is set.

    Raises:
        FileNotFoundError: ``explicit`` or ``ELIXIR_CONFIG_FILE`` names a missing file.
        ValueError: ``ELIXIR_CONFIG_FILE`` and the launcher's ``--config_file`` name different files.
    """
    if explicit:
        path = Path(explicit).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"config_file={str(explicit)!r}: no such file")
        return path
    from_env = os.environ.get(_CONFIG_FILE_ENV)
    launcher, given = _launcher_config_file()
    if not from_env:
        return launcher
    path = Path(from_env).expanduser().resolve()
    if given and launcher is not None and launcher != path:
        raise ValueError(
            f"{_CONFIG_FILE_ENV}={from_env!r} disagrees with `accelerate launch --config_file {launcher}`: the "
            "launch would be configured by one file and routed by the other. Unset ELIXIR_CONFIG_FILE (a value "
            "left from an earlier run), or set it to the --config_file you launch with")
    if not path.is_file():
        raise FileNotFoundError(f"{_CONFIG_FILE_ENV}={from_env!r}: no such file")
    return path


def read_launch_config(path: str | os.PathLike) -> dict[str, Any]:
    """The whole accelerate config file (YAML or JSON) as a dict."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: an accelerate config file must be a mapping, got {type(data).__name__}")
    return dict(data)


def has_elixir_section(path: str | os.PathLike) -> bool:
    """Whether the accelerate config file has a ``dynamo_config.elixir`` key (even an empty one: the defaults)."""
    outer, inner = ELIXIR_SECTION
    section = read_launch_config(path).get(outer)
    return isinstance(section, Mapping) and inner in section
