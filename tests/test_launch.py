"""``hf-elixir launch``: unchanged Accelerate and ``Trainer`` scripts train under hf_elixir.

The scripts in ``tests/launch_scripts/`` have nothing of hf_elixir in them (``plugin_loop.py``, the reference,
writes ``ElixirPlugin().prepare`` in). Each subprocess test launches CPU processes (``ACCELERATE_USE_CPU=1``;
two processes need ``--multi_gpu --num_processes 2``, docs/design/rules.md) on a free port and checks that the model is
never ``DistributedDataParallel`` and, for the plain loop, that the final loss equals the reference's exactly.
accelerate's own test scripts run from the installed package through ``tests/upstream/accelerate_shim.py`` in
its launch mode: only the routing of ``hf-elixir launch`` puts their models under hf_elixir, and the shim names
the upstream checks that are replaced (``EXCLUDED``, each with its reason).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch

from hf_elixir.integrations import _route
from hf_elixir.integrations.launch import BOOTSTRAP, accelerate_command
from tests._dist import free_port
from tests.upstream.accelerate_shim import EXCLUDED

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "launch_scripts"
YAML = SCRIPTS / "elixir_test.yaml"


def _launch(tmp_path: Path, num_processes: int, target: list[str], *, via: str = "hf-elixir",
            extra_env: dict[str, str] | None = None, config: Path = YAML, check: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELIXIR_")}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="1", HF_HOME=str(tmp_path / "hf_home"), **(extra_env or {}))
    launcher = [sys.executable, "-m", "hf_elixir.cli", "launch"] if via == "hf-elixir" else \
        [sys.executable, "-m", "accelerate.commands.launch"]
    procs = ["--multi_gpu", "--num_processes", "2"] if num_processes > 1 else ["--cpu", "--num_processes", "1"]
    cmd = [*launcher, "--config_file", str(config), "--main_process_port", str(free_port()), *procs, *target]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == check, out[-6000:]
    return out


# ---------------------------------------------------------------------------------------------- the command
def test_the_verb_runs_accelerate_launch_through_the_bootstrap_with_every_argument_kept(tmp_path):
    command, config_file = accelerate_command(
        ["--config_file", str(YAML), "--num_processes", "2", "train.py", "--lr", "1e-3", "--config_file", "x"])
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[3:] == ["--config_file", str(YAML), "--num_processes", "2", "--module", BOOTSTRAP,
                           "train.py", "--lr", "1e-3", "--config_file", "x"]  # the script's own flags stay its own
    assert config_file == str(YAML)
    command, config_file = accelerate_command(["-m", "pkg.train", "--epochs", "1"])
    assert command[3:] == ["--module", BOOTSTRAP, "-m", "pkg.train", "--epochs", "1"] and config_file is None
    with pytest.raises(ValueError, match="--no_python"):
        accelerate_command(["--no_python", "train.sh"])


# ------------------------------------------------------------------------------- the router, in this process
@pytest.fixture
def routed(monkeypatch):
    """``Accelerator.prepare`` routed as ``hf-elixir launch`` routes it, undone after the test."""
    from hf_elixir import ElixirConfig

    monkeypatch.setitem(_route._STATE, "config", ElixirConfig())
    monkeypatch.setitem(_route._STATE, "source", "test")
    monkeypatch.setitem(_route._STATE, "routed", [])
    monkeypatch.setattr(accelerate.Accelerator, "prepare", _route._routed_prepare(accelerate.Accelerator.prepare))
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    yield accelerate.Accelerator(cpu=True)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def test_a_model_prepared_apart_from_its_optimizer_is_refused_with_the_one_line_change(routed):
    model = torch.nn.Linear(4, 4)
    model = routed.prepare(model)  # evaluation-style prepare: left to accelerate
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("model, optimizer = accelerator.prepare(model, optimizer)")):
        routed.prepare(optimizer)
    assert _route.routed_models() == []


def test_two_models_in_one_prepare_are_paired_with_their_optimizers_and_a_shared_optimizer_is_refused(routed):
    import hf_elixir

    a, b, frozen = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).requires_grad_(False)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    out = routed.prepare(opt_b, a, frozen, b, opt_a)  # paired by the parameters each optimizer holds
    assert out[1] is a and out[2] is frozen and out[3] is b and _route.routed_models() == [a, b, frozen]
    assert out[0].optimizer is hf_elixir.get_state(b).optimizer and out[4].optimizer is hf_elixir.get_state(a).optimizer
    assert hf_elixir.get_state(frozen).optimizer is None
    c, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    both = torch.optim.SGD([*c.parameters(), *d.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="holds parameters of Linear and of Linear"):
        routed.prepare(c, d, both)


def test_a_model_with_its_optimizer_is_put_under_elixir_and_returned_in_order(routed):
    import hf_elixir

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    out_loader, out_opt, out_model = routed.prepare(loader, optimizer, model)
    assert out_model is model and hf_elixir.get_state(model) is not None
    assert type(out_opt).__name__ == "ElixirAcceleratedOptimizer"
    assert isinstance(out_loader, torch.utils.data.DataLoader) and _route.routed_models() == [model]


def test_the_router_does_not_keep_a_model_alive(routed):
    """Routing remembers its models by weak reference: a script that prepares model after model (a sweep) frees each
    one with its accelerator, and at exit no routed model keeps its process group alive ([Note: gloo group at exit])."""
    import gc
    import weakref

    def prepare_one():
        accelerator = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(4, 4)
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert _route.routed_models() == [model]
        return weakref.ref(model)

    ref = prepare_one()
    gc.collect()
    assert ref() is None and _route.routed_models() == []


# ----------------------------------------------------------------------------------- launched, unchanged
def _field(out: str, name: str) -> list[str]:
    return re.findall(rf"{name} ([\w.+-]+)", out)


# Each launch costs 10-20 s of CI; the routed prepare is the same code whichever launch installed it, so the default
# run checks the loss parity once per model, each through the other launch; the two remaining pairs are slow.
_HOOK_AT_1 = ("the start hook routing at 1 process: test_a_stock_trainer_script_trains_under_elixir[accelerate-1]; "
              "the same routed prepare's loss parity at 1 process: [gpt2-1-hf-elixir]")
_VERB_AT_2 = ("hf-elixir launch routing at 2 processes: test_a_stock_trainer_script_trains_under_elixir[hf-elixir-2] "
              "and test_accelerate_upstream_scripts_train_under_the_launch_at_2_processes[test_script-hf-elixir]; "
              "the same routed prepare's loss parity at 2 processes: [llama-2-accelerate]")


@pytest.mark.parametrize("model,num_processes,via", [
    ("gpt2", 1, "hf-elixir"),
    pytest.param("gpt2", 1, "accelerate", marks=pytest.mark.slow(reason=_HOOK_AT_1)),
    ("llama", 2, "accelerate"),
    pytest.param("llama", 2, "hf-elixir", marks=pytest.mark.slow(reason=_VERB_AT_2)),
], ids=["gpt2-1-hf-elixir", "gpt2-1-accelerate", "llama-2-accelerate", "llama-2-hf-elixir"])
def test_a_plain_loop_trains_under_elixir_and_matches_elixir_plugin(tmp_path, model, num_processes, via):
    """Both launches (``hf-elixir launch`` and plain ``accelerate launch`` through the start hook) route the loop,
    and its final loss equals ``ElixirPlugin().prepare`` of the same loop exactly."""
    reference = _launch(tmp_path, num_processes, [str(SCRIPTS / "plugin_loop.py"), "--model", model], via="accelerate")
    routed = _launch(tmp_path, num_processes, [str(SCRIPTS / "plain_loop.py"), "--model", model], via=via)
    assert _field(routed, "DDP") == ["False"] * num_processes, (via, routed[-3000:])
    # routed: accelerate's optimizer wrapper is hf_elixir's (at 1 process a model is never DDP anyway)
    assert _field(routed, "OPTIMIZER_CLASS") == ["ElixirAcceleratedOptimizer"] * num_processes, via
    losses = sorted(_field(routed, "FINAL_LOSS"))
    assert len(losses) == num_processes and losses == sorted(_field(reference, "FINAL_LOSS")), (
        via, routed[-2000:], reference[-2000:])


@pytest.mark.parametrize("via,num_processes", [("hf-elixir", 2), ("accelerate", 1), ("accelerate", 2)])
def test_a_stock_trainer_script_trains_under_elixir(tmp_path, via, num_processes):
    out = _launch(tmp_path, num_processes, [str(SCRIPTS / "run_trainer.py"), str(tmp_path / "out")], via=via)
    assert _field(out, "TRAINED_MODEL_CLASS") == ["GPT2LMHeadModel"] * num_processes, out[-3000:]
    assert "elixir/device_peak_bytes" in out  # ElixirCallback's counters in the Trainer's logs


@pytest.mark.parametrize("script,via", [
    ("test_script", "hf-elixir"),
    pytest.param("test_sync", "hf-elixir", marks=pytest.mark.slow(reason=(
        "test_sync's checks under the routed prepare: [test_sync-accelerate] (the same prepare, installed by the "
        "start hook); hf-elixir launch's routing at 2 processes: [test_script-hf-elixir]"))),
    ("test_sync", "accelerate")], ids=["test_script-hf-elixir", "test_sync-hf-elixir", "test_sync-accelerate"])
def test_accelerate_upstream_scripts_train_under_the_launch_at_2_processes(tmp_path, script, via):
    out = _launch(tmp_path, 2, ["-m", "tests.upstream.accelerate_shim", script], via=via,
                  extra_env={"ELIXIR_SHIM_ROUTE": "launch", "ELIXIR_SHIM_READ_FULL": "1"})
    prepared = {"test_script": "4", "test_sync": "1"}[script]
    assert re.findall(r"ELIXIR_SHIM prepared (\d+)", out) == [prepared] * 2, out[-4000:]
    assert set(re.findall(r"SKIPPED (\w+): ", out)) <= set(EXCLUDED[script])
    if script == "test_script":
        assert out.count("Training yielded the same results on one CPU or distributed setup with batch split") == 2
        assert "**Test reinstantiated state**" in out
    else:
        assert "gradient accumulation with optimizer and scheduler" in out
        assert out.count("ELIXIR_SHIM check_model_parameters on full_gradients") == 3 * 2  # 3 iterations, 2 ranks


# ------------------------------------------------------------------------ the start hook of plain accelerate launch
def _yaml_without_elixir(tmp_path: Path) -> Path:
    import yaml

    data = yaml.safe_load(YAML.read_text())
    del data["dynamo_config"]["elixir"]
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plain_accelerate_launch_without_an_elixir_section_or_with_the_hook_off_stays_ddp(tmp_path):
    """The hook routes only a launch whose config asks for Elixir: a DDP config trains as DDP, untouched (2
    processes), and ``HF_ELIXIR_AUTOROUTE=0`` turns routing off for an Elixir config too: accelerate's own optimizer
    wrapper, not hf_elixir's. That case runs at 1 process, where the hook routes too (test_a_stock_trainer_script_
    trains_under_elixir[accelerate-1]) and a routed loop shows hf_elixir's wrapper (test_a_plain_loop_trains_under_
    elixir_and_matches_elixir_plugin[gpt2-1-hf-elixir]): the switch acts in every
    process before anything is prepared (the hook does not arm, hf_elixir is not imported:
    test_the_hook_on_import_torch_arms_only_in_launched_processes_and_imports_nothing), so a second process adds
    nothing but a launch's cost."""
    for config, env, procs in ((_yaml_without_elixir(tmp_path), {}, 2), (YAML, {"HF_ELIXIR_AUTOROUTE": "0"}, 1)):
        out = _launch(tmp_path, procs, [str(SCRIPTS / "plain_loop.py"), "--model", "gpt2"], via="accelerate",
                      config=config, extra_env=env)
        assert _field(out, "DDP") == [str(procs > 1)] * procs, (env, out[-3000:])
        assert _field(out, "OPTIMIZER_CLASS") == ["AcceleratedOptimizer"] * procs, out[-3000:]
        # [Note: the start hook stays out of other launches]: nothing of hf_elixir imported, the hook's trigger (armed
        # in the launched DDP processes, not with the switch off) kept Accelerator.prepare's signature
        assert _field(out, "HF_ELIXIR_MODULES") == ["0"] * procs, out[-3000:]
        assert _field(out, "PREPARE_SIGNATURE_KEPT") == ["True"] * procs, out[-3000:]
        assert _field(out, "WRAPPED_BEFORE") == [str(not env)] * procs, out[-3000:]


def test_plain_accelerate_launch_with_an_invalid_elixir_field_fails_at_prepare_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(YAML.read_text().replace("default_placement: sharded", "default_placement: sharded\n    prefetch_depthh: 2"))
    out = _launch(tmp_path, 1, [str(SCRIPTS / "plain_loop.py"), "--model", "gpt2"], via="accelerate", config=bad,
                  check=False)
    assert "prefetch_depthh" in out and "FINAL_LOSS" not in out, out[-3000:]


@pytest.mark.parametrize("env,armed", [({}, False), ({"ACCELERATE_DYNAMO_BACKEND": "NO"}, True),
                                       ({"ACCELERATE_DYNAMO_BACKEND": "NO", "HF_ELIXIR_AUTOROUTE": "0"}, False)])
def test_the_hook_on_import_torch_arms_only_in_launched_processes_and_imports_nothing(env, armed):
    """``import torch`` runs the ``torch.backends`` entry point in every process: outside ``accelerate launch``
    it does nothing, and inside it only adds an import watcher (hf_elixir itself is not imported)."""
    code = ("import sys, torch, hf_elixir_autoroute as h; "
            "print(any(isinstance(f, h._RouteWhenImported) for f in sys.meta_path), 'hf_elixir' in sys.modules)")
    clean = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_DYNAMO_BACKEND", "HF_ELIXIR_AUTOROUTE")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == [str(armed), "False"]


def test_a_stale_elixir_config_file_that_disagrees_with_config_file_is_an_error_naming_both(tmp_path):
    """A DDP launch (``--config_file ddp.yaml``) with ``ELIXIR_CONFIG_FILE`` left pointing at an Elixir YAML used to be
    routed to hf_elixir without a word; now the first ``prepare`` raises, naming both files."""
    ddp = _yaml_without_elixir(tmp_path)
    out = _launch(tmp_path, 1, [str(SCRIPTS / "plain_loop.py"), "--model", "gpt2"], via="accelerate", config=ddp,
                  extra_env={"ELIXIR_CONFIG_FILE": str(YAML)}, check=False)
    assert "ValueError: ELIXIR_CONFIG_FILE=" in out and str(YAML) in out and str(ddp) in out, out[-3000:]
    assert "FINAL_LOSS" not in out


def test_the_config_file_sources_agree_or_the_lookup_names_both(tmp_path, monkeypatch):
    import hf_elixir_launch_config as hook

    elixir, other = tmp_path / "elixir.yaml", tmp_path / "other.yaml"
    elixir.write_text(YAML.read_text())
    other.write_text(YAML.read_text())
    monkeypatch.setenv("ELIXIR_CONFIG_FILE", str(elixir))
    for launcher, expected in (((None, False), elixir), ((elixir, True), elixir), ((other, False), elixir)):
        monkeypatch.setattr(hook, "_launcher_config_file", lambda launcher=launcher: launcher)
        assert hook.find_launch_config_file() == expected  # no launcher, the same file, accelerate's default file
    monkeypatch.setattr(hook, "_launcher_config_file", lambda: (other, True))
    with pytest.raises(ValueError, match=re.escape(f"ELIXIR_CONFIG_FILE={str(elixir)!r} disagrees with `accelerate "
                                                   f"launch --config_file {other}`")):
        hook.find_launch_config_file()
    assert hook.find_launch_config_file(other) == other  # an explicit ElixirPlugin(config_file=) wins


def test_the_hooks_triggers_keep_the_signatures_of_the_methods_they_stand_in_for():
    import inspect

    import transformers

    import hf_elixir_autoroute as hook

    for cls, method in ((accelerate.Accelerator, "prepare"), (transformers.Trainer, "__init__")):
        original = cls.__dict__[method]
        trigger = hook._trigger(cls, method, original)
        assert inspect.signature(trigger) == inspect.signature(original) and trigger.__name__ == method
        assert "callbacks" in inspect.signature(trigger).parameters or method == "prepare"


def test_an_unchanged_loop_with_two_trained_models_is_routed_and_trains_as_ddp(tmp_path):
    """Plain ``accelerate launch`` (the start hook) of a loop preparing a policy and a value model with their
    optimizers in one call, one loss reaching both: both go to hf_elixir, and the losses equal the same loop under
    DDP at 2 processes."""
    script = [str(SCRIPTS / "two_models_loop.py")]
    routed = _launch(tmp_path, 2, script, via="accelerate")
    ddp = _launch(tmp_path, 2, script, via="accelerate", config=_yaml_without_elixir(tmp_path))
    for name in ("OPTIMIZER_P", "OPTIMIZER_V"):
        assert _field(routed, name) == ["ElixirAcceleratedOptimizer"] * 2, routed[-3000:]
    assert _field(routed, "DDP") == ["False"] * 2 and _field(ddp, "DDP") == ["True"] * 2, ddp[-2000:]
    got, expected = sorted(map(float, _field(routed, "FINAL_LOSS"))), sorted(map(float, _field(ddp, "FINAL_LOSS")))
    assert len(got) == 2 and got == pytest.approx(expected, rel=1e-5), (got, expected)
