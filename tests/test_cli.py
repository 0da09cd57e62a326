"""`hf-elixir plan` / `hf-elixir profile` end to end (offline, small configs)."""

import pytest

from hf_elixir.cli import main, parse_bytes
from hf_elixir.plan import ElixirPlan


@pytest.fixture(autouse=True)
def _hardware_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))


def test_parse_bytes():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("512GB") == 512 * 10**9
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes("1024") == 1024
    assert parse_bytes("1e9") == 10**9
    with pytest.raises(ValueError, match="40 gigs"):
        parse_bytes("40 gigs")


def test_plan_command_prints_tables_and_writes_a_loadable_plan(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    code = main(["plan", "--model", "gpt2", "--num-gpus", "2", "--gpu-memory", "2GiB", "--host-memory", "64GiB",
                 "--batch-size", "1", "--seq-len", "128", "--precision", "bf16", "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    for word in ("model data: optimizer", "chosen plan", "next-best alternatives", "predicted_step_s"):
        assert word in text
    plan = ElixirPlan.load(out)
    assert plan.world_size == 2 and plan.precision == "bf16" and plan.model_type == "gpt2"
    assert plan.predicted_peak_device_bytes <= 2 * 2**30
    assert "module placements" in text and plan.placements["transformer.h.0.attn.c_attn"] == "sharded"


def test_plan_command_shows_tensor_and_expert_parallel_placements(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt2", "--num-gpus", "4", "--tensor-parallel-size", "2", "--gpu-memory",
                 "2GiB", "--seq-len", "64", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    plan = ElixirPlan.load(out)
    assert plan.world_size == 4
    assert plan.placements["transformer.h.0.attn.c_attn"] == "column"
    assert plan.placements["transformer.h.0.attn.c_proj"] == "row" and "column" in text
    assert main(["plan", "--model", "gpt2", "--num-gpus", "4", "--tensor-parallel-size", "3"]) == 2
    assert "--tensor-parallel-size=3" in capsys.readouterr().err


def test_plan_command_reads_a_local_config_json(tmp_path, capsys):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 256}))
    assert main(["plan", "--model", str(cfg), "--gpu-memory", "64MiB", "--seq-len", "16"]) == 0
    assert "chosen plan" in capsys.readouterr().out


def test_plan_command_reports_unknown_model(capsys):
    assert main(["plan", "--model", "no-such-model-anywhere"]) == 2
    assert "not a built-in config" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--gpu-memory", "0"], "--gpu-memory 0 must be a positive size"),
    (["--output", "plan.txt"], "--output plan.txt must end in .yaml, .yml or .json"),
])
def test_plan_command_names_the_bad_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["plan", "--model", "gpt2", *argv])


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "gpt2", "--device-tflops", "nan"], "--device-tflops nan must be a positive number"),
    (["plan", "--model", "gpt2", "--h2d-gbps", "0"], "--h2d-gbps 0.0 must be a positive number"),
    (["plan", "--model", "gpt2", "--seq-len", "100000"], "--seq-len 100000 is longer than the model's 1024"),
    (["plan", "--model", "gpt2", "--output", "/no/such/dir/plan.yaml"], "the folder /no/such/dir does not exist"),
    (["profile", "--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["profile", "--model", "{bad}"], "is not valid JSON"),
])
def test_cli_errors_name_the_flag_before_any_work(argv, message, capsys, tmp_path):
    if "{bad}" in argv:
        bad = tmp_path / "config.json"
        bad.write_text("not json")
        argv = [str(bad) if a == "{bad}" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_profile_command_writes_a_png(tmp_path, capsys):
    out = tmp_path / "step.png"
    assert main(["profile", "--output", str(out), "--seq-len", "16"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "predicted" in capsys.readouterr().out
