"""Bad input fails with a clear TypeError/ValueError naming the field, the value and the fix, before any
work is done: every ElixirConfig / LossScalePolicy / ElixirPlan field, YAML sections (unknown keys name
the closest valid one), plans made for another run, too-small budgets, unsupported optimizers.

Mesh factoring and heads/experts divisibility are covered by tests/test_placement.py
(test_world_size_must_factor_into_the_mesh, the "not divisible" cases)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

import hf_elixir
from hf_elixir import ElixirConfig, ElixirPlan, LossScalePolicy
from hf_elixir.integrations import ElixirPlugin
from tests._models import tiny_model

CONFIG_CASES = [
    # (field, bad value, exception, message fragment)
    ("precision", "fp8", ValueError, "precision='fp8' is not supported; use one of"),
    ("precision", 16, ValueError, "precision=16"),
    ("export_dtype", "bf16", ValueError, "export_dtype='bf16' is not supported; use 'fp32'"),
    ("export_dtype", "FP32", ValueError, "export_dtype='FP32' is not supported.*Did you mean 'fp32'"),
    ("device_memory_budget_bytes", 1.5e9, TypeError, "device_memory_budget_bytes=1500000000.0 has type float"),
    ("device_memory_budget_bytes", True, TypeError, "device_memory_budget_bytes=True is a bool"),
    ("device_memory_budget_bytes", 0, ValueError, "device_memory_budget_bytes=0 must be > 0"),
    ("budget_covers_activations", "yes", TypeError, "budget_covers_activations='yes' has type str; use True"),
    ("budget_covers_activations", 1, TypeError, "budget_covers_activations=1 has type int"),
    ("host_memory_budget_bytes", 2.5e9, TypeError, "host_memory_budget_bytes=2500000000.0 has type float"),
    ("host_memory_budget_bytes", False, TypeError, "host_memory_budget_bytes=False is a bool"),
    ("host_memory_budget_bytes", -1, ValueError, "host_memory_budget_bytes=-1 must be > 0"),
    ("host_memory_budget_bytes", "plenty", ValueError, "host_memory_budget_bytes: cannot read 'plenty' as a size"),
    ("offload_dir", 3, TypeError, "offload_dir=3 has type int"),
    ("offload_dir", "/no/such/dir", ValueError, "offload_dir='/no/such/dir' is not a directory; create it"),
    ("offload_dir", "/proc", ValueError, "offload_dir='/proc' is not writable"),
    ("disk_budget_bytes", "1TB", ValueError, "disk_budget_bytes=1000000000000 is set without offload_dir"),
    ("chunk_size_numel", "1M", TypeError, "chunk_size_numel='1M' has type str"),
    ("chunk_size_numel", -4, ValueError, "chunk_size_numel=-4 must be > 0"),
    ("reduce_dtype", "bf16", ValueError, "reduce_dtype='bf16' must be 'fp32' or None"),
    ("offload_optimizer", "yes", ValueError, "offload_optimizer='yes' must be True, False or 'auto'"),
    ("offload_optimizer", 1, ValueError, "offload_optimizer=1 must be True, False or 'auto'"),
    ("overlap_host_optimizer", "yes", TypeError, "overlap_host_optimizer='yes' must be True, False or None"),
    ("prefetch_depth", 2.0, TypeError, "prefetch_depth=2.0 has type float"),
    ("prefetch_depth", -1, ValueError, "prefetch_depth=-1 must be >= 0"),
    ("plan", 3, TypeError, "plan=3 must be an ElixirPlan, a path"),
    ("plan", "/nonexistent/plan.yaml", FileNotFoundError, "plan=./nonexistent/plan.yaml.: no such plan file"),
    ("search", "on", ValueError, "search='on' must be one of"),
    ("placements", ["sharded"], TypeError, "placements=\\['sharded'\\] must be a dict"),
    ("placements", {"h.*": "zero3"}, ValueError, "placements\\['h.\\*'\\]='zero3' is not a placement"),
    ("placements", {3: "sharded"}, TypeError, "placements key 3 must be a module-name glob"),
    ("default_placement", "zero3", ValueError, "default_placement='zero3' must be one of"),
    ("default_placement", "replicate", ValueError, "default_placement='replicate' must be one of .* Did you mean 'replicated'"),
    ("tensor_parallel_size", "2", TypeError, "tensor_parallel_size='2' has type str"),
    ("tensor_parallel_size", 0, ValueError, "tensor_parallel_size=0 must be >= 1"),
    ("expert_parallel_size", 0, ValueError, "expert_parallel_size=0 must be >= 1"),
    ("loss_scale", 2.0, TypeError, "loss_scale=.* must be a LossScalePolicy"),
    ("loss_scale", {"init_scal": 2.0}, ValueError, "loss_scale: unknown LossScalePolicy key 'init_scal'. Did you mean"),
    ("device_memory_budget_bytes", "lots", ValueError, "device_memory_budget_bytes: cannot read 'lots' as a size"),
    ("precision", "BF16", ValueError, "precision='BF16' is not supported.*Did you mean 'bf16'"),
    ("activation_policy", "swap", ValueError, "activation_policy='swap' is not a policy; use one of"),
    ("activation_policy", {"transformer.h.*": "ofload"}, ValueError,
     "activation_policy\\['transformer.h.\\*'\\]='ofload' is not a policy.*Did you mean 'offload'"),
    ("activation_policy", ["keep"], TypeError, "activation_policy=\\['keep'\\] has type list"),
    ("activation_policy", {0: "keep"}, TypeError, "activation_policy key 0 must be a block-name glob"),
    ("compile", 3, TypeError, "compile=3 must be False, True, a torch.compile backend name"),
    ("compile", {"backend": "eager", "bogus": 1}, ValueError, "compile has unknown torch.compile arguments \\['bogus'\\]"),
    ("split_fused_experts", "yes", TypeError, "split_fused_experts='yes' is not supported; give 'auto'"),
    ("frozen_placement", "replicated", ValueError, "frozen_placement='replicated' is not supported; use 'auto'"),
    ("allow_missing_keys", "yes", TypeError, "allow_missing_keys='yes' must be True .* or False"),
]


@pytest.mark.parametrize("field,value,exc,message", CONFIG_CASES, ids=[f"{c[0]}={c[1]!r}" for c in CONFIG_CASES])
def test_every_config_field_rejects_bad_values(field, value, exc, message):
    with pytest.raises(exc, match=f"ElixirConfig.{message}"):
        ElixirConfig(**{field: value})


def test_config_cases_cover_every_field():
    checked = {c[0] for c in CONFIG_CASES}
    assert {f.name for f in dataclasses.fields(ElixirConfig)} - checked == {"process_group"}  # any group object


POLICY_CASES = [
    ("init_scale", "big", TypeError, "init_scale='big' must be a number"),
    ("init_scale", float("nan"), ValueError, "init_scale=nan must be a finite number"),
    ("init_scale", -1.0, ValueError, "init_scale=-1.0 and min_scale=1.0 must be > 0"),
    ("growth_factor", 1.0, ValueError, "growth_factor=1.0 must be > 1"),
    ("growth_factor", None, TypeError, "growth_factor=None must be a number"),
    ("backoff_factor", 1.5, ValueError, "backoff_factor=1.5 must be in \\(0, 1\\)"),
    ("backoff_factor", float("inf"), ValueError, "backoff_factor=inf must be a finite number"),
    ("growth_interval", 0, ValueError, "growth_interval=0 must be an int >= 1"),
    ("growth_interval", 10.0, TypeError, "growth_interval=10.0 must be an int"),
    ("min_scale", 2.0**20, ValueError, "min_scale=1048576.0 is above init_scale=65536.0"),
    ("min_scale", True, TypeError, "min_scale=True must be a number"),
    ("max_consecutive_min_scale_overflows", 0, ValueError, "max_consecutive_min_scale_overflows=0 must be"),
    ("max_consecutive_min_scale_overflows", "3", TypeError, "max_consecutive_min_scale_overflows='3' must be"),
]


@pytest.mark.parametrize("field,value,exc,message", POLICY_CASES, ids=[f"{c[0]}={c[1]!r}" for c in POLICY_CASES])
def test_every_loss_scale_field_rejects_bad_values(field, value, exc, message):
    with pytest.raises(exc, match=f"LossScalePolicy.{message}"):
        LossScalePolicy(**{field: value})


def test_policy_cases_cover_every_field():
    assert {c[0] for c in POLICY_CASES} == {f.name for f in dataclasses.fields(LossScalePolicy)}


PLAN_CASES = [
    ("model_type", 2, TypeError, "model_type=2 has type int"),
    ("num_params", "1M", TypeError, "num_params='1M' has type str"),
    ("num_params", -1, ValueError, "num_params=-1 must be >= 0"),
    ("world_size", "2", TypeError, "world_size='2' has type str"),
    ("world_size", 0, ValueError, "world_size=0 must be >= 1"),
    ("precision", "int8", ValueError, "precision='int8' must be one of"),
    ("chunk_size_numel", -5, ValueError, "chunk_size_numel=-5 must be >= 0"),
    ("chunk_size_numel", 1.0, TypeError, "chunk_size_numel=1.0 has type float"),
    ("param_order", "wte", TypeError, "param_order='wte' has type str"),
    ("param_order", [1, 2], TypeError, "param_order must be a list of str"),
    ("resident_chunks", [-1], ValueError, "resident_chunks=\\[-1\\] must be a list of chunk ids"),
    ("device_shard_chunks", [0.5], ValueError, "device_shard_chunks=\\[0.5\\] must be a list of chunk ids"),
    ("device_optim_chunks", (0,), TypeError, "device_optim_chunks=\\(0,\\) has type tuple"),
    ("host_copy_chunks", [True], ValueError, "host_copy_chunks=\\[True\\] must be a list of chunk ids"),
    ("prefetch_depth", -1, ValueError, "prefetch_depth=-1 must be >= 0"),
    ("activation_checkpointing", "yes", TypeError, "activation_checkpointing='yes' has type str"),
    ("activation_policy", {"transformer.h.0": "swap"}, ValueError,
     "activation_policy\\['transformer.h.0'\\]='swap' must map a block name"),
    ("activation_policy", "offload", TypeError, "activation_policy='offload' has type str"),
    ("placements", {"h.0": "zero3"}, ValueError, "placements\\['h.0'\\]='zero3' must map"),
    ("refresh_cast", "gpu", ValueError, "refresh_cast='gpu' must be one of"),
    ("refresh_cast", "device", ValueError, "refresh_cast='device' with precision='fp32'"),
    ("refresh_cast", 1, TypeError, "refresh_cast=1 has type int"),
    ("reduce_dtype", "bf16", ValueError, "reduce_dtype='bf16' must be 'fp32' or None"),
    ("reduce_dtype", 4, TypeError, "reduce_dtype=4 has type int"),
    ("frozen_whole", "yes", TypeError, "frozen_whole='yes' has type str"),
    ("predicted_step_s", -1.0, ValueError, "predicted_step_s=-1.0 must be >= 0"),
    ("predicted_peak_device_bytes", "1G", TypeError, "predicted_peak_device_bytes='1G' has type str"),
    ("activation_peak_bytes", "1G", TypeError, "activation_peak_bytes='1G' has type str"),
    ("activation_peak_bytes", -1, ValueError, "activation_peak_bytes=-1 must be >= 0 or None"),
    ("reasons", "fast", TypeError, "reasons='fast' has type str"),
    ("format_version", "1", TypeError, "format_version='1' has type str"),
]


@pytest.mark.parametrize("field,value,exc,message", PLAN_CASES, ids=[f"{c[0]}={c[1]!r}" for c in PLAN_CASES])
def test_every_plan_field_rejects_bad_values(field, value, exc, message):
    with pytest.raises(exc, match=f"ElixirPlan.{message}"):
        ElixirPlan(**{field: value})


def test_plan_cases_cover_every_field():
    assert {c[0] for c in PLAN_CASES} == {f.name for f in dataclasses.fields(ElixirPlan)}


# -- files: unknown keys name the closest valid one -----------------------------------------------------
def test_unknown_yaml_keys_name_the_closest_valid_one(tmp_path):
    with pytest.raises(ValueError, match="unknown ElixirConfig key 'chunk_size_numels'. Did you mean 'chunk_size_numel'"):
        ElixirConfig.from_dict({"chunk_size_numels": 1024})
    with pytest.raises(ValueError, match="unknown LossScalePolicy key 'init_scal'. Did you mean 'init_scale'"):
        ElixirConfig.from_dict({"precision": "fp16", "loss_scale": {"init_scal": 8.0}})
    with pytest.raises(TypeError, match="must be a mapping"):
        ElixirConfig.from_dict(["precision"])
    # through an accelerate launch file read by the plugin
    path = tmp_path / "elixir.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU",
                                    "dynamo_config": {"elixir": {"device_memory_budget": 1024}}}))
    with pytest.raises(ValueError, match="'device_memory_budget'. Did you mean 'device_memory_budget_bytes'"):
        ElixirPlugin(config_file=str(path))
    path.write_text(yaml.safe_dump({"dynamo_config": {"elixir": {"precision": "fp12"}}}))
    with pytest.raises(ValueError, match="precision='fp12'"):
        ElixirPlugin(config_file=str(path))
    with pytest.raises(TypeError, match="ElixirPlugin.config=.* must be an hf_elixir.ElixirConfig"):
        ElixirPlugin(config={"precision": "bf16"})
    # plan files
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump({"world_size": 1, "chunk_size": 4096}))
    with pytest.raises(ValueError, match="unknown ElixirPlan key 'chunk_size'. Did you mean 'chunk_size_numel'"):
        ElixirPlan.load(plan_path)
    plan_path.write_text(yaml.safe_dump({"world_size": 1, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version=99 is newer"):
        ElixirPlan.load(plan_path)
    plan_path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="does not hold a mapping"):
        ElixirPlan.load(plan_path)


# -- plans for another run, budgets, optimizers, hardware ---------------------------------------------
def _plan_for(model, **changes):
    base = dict(model_type="gpt2", num_params=sum(p.numel() for p in model.parameters()), world_size=1,
                precision="fp32", chunk_size_numel=8192)
    return ElixirPlan(**{**base, **changes})


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "opt"}, "model_type 'opt' \\(this model is 'gpt2'\\)"),
    ({"world_size": 2}, "world_size 2 \\(this run has 1\\)"),
    ({"num_params": 12345}, "num_params 12345 \\(this model has \\d+\\)"),
    ({"precision": "bf16"}, "precision='bf16' but ElixirConfig.precision='fp32'.*set ElixirConfig\\(precision='bf16'\\)"),
    ({"resident_chunks": [99]}, "chunk ids \\[99\\]"),
    ({"param_order": ["transformer.wte.weight", "encoder.block.0.weight"]}, "names parameters this model lacks"),
])
def test_plan_made_for_another_model_or_world_size_is_rejected(tmp_path, changes, message):
    model = tiny_model("gpt2")
    path = tmp_path / "plan.json"
    _plan_for(model, **changes).save(path)
    with pytest.raises(ValueError, match=message):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), ElixirConfig(plan=str(path)))


def test_yaml_and_env_forms_sizes_loss_scale_mapping_and_env_typos(monkeypatch):
    cfg = ElixirConfig(device_memory_budget_bytes="40GiB", loss_scale={"init_scale": 2.0})
    assert cfg.device_memory_budget_bytes == 40 * 2**30 and cfg.loss_scale == LossScalePolicy(init_scale=2.0)
    monkeypatch.setenv("ELIXIR_DEVICE_MEMORY_BUDGET_BYTES", "1e9")  # YAML 1.1 reads 1e9 as a string
    monkeypatch.setenv("ELIXIR_PRECISON", "bf16")
    with pytest.warns(UserWarning, match="ELIXIR_PRECISON is not an ElixirConfig field.*ELIXIR_PRECISION"):
        assert ElixirConfig.from_env().device_memory_budget_bytes == 10**9
    monkeypatch.setenv("ELIXIR_DEVICE_MEMORY_BUDGET_BYTES", "-5")
    with pytest.raises(ValueError, match="read from the environment: ELIXIR_DEVICE_MEMORY_BUDGET_BYTES"), \
            pytest.warns(UserWarning):
        ElixirConfig.from_env()


def test_plugin_and_callback_read_the_environment_as_from_env_does(monkeypatch):
    """ElixirPlugin() and ElixirCallback() without a config read ELIXIR_* like ElixirConfig.from_env: a typo'd
    variable warns (it was silently ignored), a value that is not YAML and an invalid value name the variable (a
    bare yaml ScannerError / a message without the variable before)."""
    from hf_elixir.integrations.trainer_callback import _config_from_env

    monkeypatch.delenv("ELIXIR_CONFIG_FILE", raising=False)
    monkeypatch.setattr("sys.argv", ["train.py"])
    monkeypatch.setenv("ELIXIR_CHUNK_SIZE", "4096")
    for read in (lambda: ElixirPlugin().config, _config_from_env):
        with pytest.warns(UserWarning, match="ELIXIR_CHUNK_SIZE is not an ElixirConfig field.*ELIXIR_CHUNK_SIZE_NUMEL"):
            assert read().chunk_size_numel is None
    monkeypatch.delenv("ELIXIR_CHUNK_SIZE")
    monkeypatch.setenv("ELIXIR_PLACEMENTS", "*.mlp=sharded")
    for read in (lambda: ElixirPlugin().config, _config_from_env, ElixirConfig.from_env):
        with pytest.raises(ValueError, match="ELIXIR_PLACEMENTS='\\*.mlp=sharded' is not a valid YAML value.*"
                                             "ELIXIR_PLACEMENTS=\"{'\\*.mlp': sharded}\""):
            read()
    monkeypatch.setenv("ELIXIR_PLACEMENTS", "{'*.mlp': sharded}")
    assert ElixirPlugin().config.placements == {"*.mlp": "sharded"}
    monkeypatch.delenv("ELIXIR_PLACEMENTS")
    monkeypatch.setenv("ELIXIR_PREFETCH_DEPTH", "-1")
    for read in (lambda: ElixirPlugin().config, _config_from_env):
        with pytest.raises(ValueError, match="prefetch_depth=-1 must be >= 0.*ELIXIR_PREFETCH_DEPTH"):
            read()


def test_prepare_arguments_and_process_group_of_the_wrong_kind_say_what_is_expected():
    model = tiny_model("gpt2")
    with pytest.raises(TypeError, match="prepare\\(model=...\\) got NoneType; pass a torch.nn.Module"):
        hf_elixir.prepare(None)
    with pytest.raises(TypeError, match="prepare\\(optimizer=...\\) got GPT2LMHeadModel"):
        hf_elixir.prepare(model, model)
    with pytest.raises(TypeError, match="process_group='nccl' must be a torch.distributed process group"):
        ElixirConfig(process_group="nccl")


def test_plan_for_a_larger_budget_is_rejected_and_its_checkpointing_is_applied(tmp_path):
    model = tiny_model("gpt2")
    path = tmp_path / "plan.json"
    _plan_for(model, predicted_peak_device_bytes=500_000).save(path)
    with pytest.raises(ValueError, match="predicts a device peak of 500000 bytes but device_memory_budget_bytes="
                                         "400000: the plan was made for a larger budget"):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                          ElixirConfig(plan=str(path), device_memory_budget_bytes=400_000))
    _plan_for(model, activation_checkpointing=True).save(path)
    assert not model.is_gradient_checkpointing
    hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), ElixirConfig(plan=str(path)))
    assert model.is_gradient_checkpointing  # the plan's memory peak assumes it


@pytest.mark.parametrize("offload", [True, "auto"])
def test_budget_below_the_largest_module_names_the_bytes(offload):
    model = tiny_model("gpt2")
    cfg = ElixirConfig(chunk_size_numel=8192, offload_optimizer=offload)
    need = hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(model.parameters()), cfg)
    with pytest.raises(ValueError, match=f"device_memory_budget_bytes={need - 1} is too small: .* needs {need} bytes"):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                          dataclasses.replace(cfg, device_memory_budget_bytes=need - 1))


def test_chunk_size_below_the_largest_parameter_names_both_numbers():
    model = tiny_model("gpt2")
    largest = max(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=f"chunk_size_numel=100 is smaller than the largest parameter \\({largest}"):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), ElixirConfig(chunk_size_numel=100))


class _MyAdamW(torch.optim.AdamW):
    """A subclass may change the update rule: rejected too (only the listed classes are known exact)."""


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps),
    lambda ps: torch.optim.Adafactor(ps),
    lambda ps: _MyAdamW(ps),
])
def test_unsupported_optimizers_list_the_supported_ones(make):
    model = tiny_model("gpt2")
    optimizer = make(model.parameters())
    supported = ", ".join(f"torch.optim.{c.__name__}" for c in hf_elixir.SUPPORTED_OPTIMIZERS)
    with pytest.raises(TypeError, match=f"optimizer=<{type(optimizer).__name__}>.*Use one of: {supported}"):
        hf_elixir.prepare(model, optimizer)


def test_optimizer_over_parameters_of_another_model_is_rejected():
    model, other = tiny_model("gpt2"), tiny_model("gpt2")
    with pytest.raises(ValueError, match="not in the prepared model"):
        hf_elixir.prepare(model, torch.optim.AdamW(other.parameters()))


def test_precision_the_gpu_cannot_run_is_rejected(monkeypatch):
    from hf_elixir.api import _check_precision_supported

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ValueError, match="precision='bf16' is not supported by this GPU \\(Tesla V100\\)"):
        _check_precision_supported("bf16", torch.device("cuda", 0))
    _check_precision_supported("fp16", torch.device("cuda", 0))
    _check_precision_supported("bf16", torch.device("cpu"))


def test_preparing_twice_and_a_non_config_are_rejected():
    model = tiny_model("gpt2")
    with pytest.raises(TypeError, match="must be an ElixirConfig"):
        hf_elixir.prepare(model, None, {"precision": "bf16"})
    hf_elixir.prepare(model, None)
    with pytest.raises(ValueError, match="already prepared"):
        hf_elixir.prepare(model, None)
