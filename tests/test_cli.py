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
    for word in ("Run tensor parallel 1 x expert parallel 1 x data parallel 2", "tokens/s for the job",
                 "rates priced", "device memory per GPU at the step's peak", "configurations compared"):
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


def test_plan_command_refuses_a_bad_degree_before_loading_the_config(monkeypatch, capsys):
    """A degree that does not divide --num-gpus fails at once (it waited for the model and the host probe)."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the degrees were checked")

    monkeypatch.setattr("hf_elixir.profiler._model_zoo.load_config", no_model)
    for flag, size, message in (("--tensor-parallel-size", "3", "--tensor-parallel-size=3 must divide --num-gpus=8"),
                                ("--tensor-parallel-size", "0", "argument --tensor-parallel-size: 0 must be >= 1"),
                                ("--expert-parallel-size", "16", "--expert-parallel-size=16 must divide --num-gpus=8")):
        assert main(["plan", "--model", "llama-3.1-8b", "--num-gpus", "8", flag, size]) == 2
        assert message in capsys.readouterr().err


def test_plan_command_reads_a_local_config_json(tmp_path, capsys):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 256}))
    assert main(["plan", "--model", str(cfg), "--gpu-memory", "64MiB", "--seq-len", "16"]) == 0
    assert "Run tensor parallel 1" in capsys.readouterr().out


#: every bad input: (argv, what the error line says); each exits 2 with argparse's "error:" line before any model
#: is built ([Note: CLI checks] in hf_elixir/cli/__init__.py)
BAD_INPUT = [
    (["plan", "--model", "gpt2", "--gpu-memory", "0"], "argument --gpu-memory: 0 must be positive, e.g. 40GiB"),
    (["plan", "--model", "gpt2", "--gpu-memory=-5GiB"], "argument --gpu-memory: -5GiB must be positive, e.g. 40GiB"),
    (["plan", "--model", "gpt2", "--gpu-memory", "lots"], "argument --gpu-memory: cannot read 'lots' as a size"),
    (["plan", "--model", "gpt2", "--host-memory", "0GiB"], "argument --host-memory: 0GiB must be positive"),
    (["plan", "--model", "gpt2", "--device-tflops", "nan"], "argument --device-tflops: nan must be a positive number"),
    (["plan", "--model", "gpt2", "--h2d-gbps", "0"], "argument --h2d-gbps: 0 must be a positive number"),
    (["plan", "--model", "gpt2", "--host-adam-gelems", "-1"], "argument --host-adam-gelems: -1 must be a positive"),
    (["plan", "--model", "gpt2", "--num-gpus", "0"], "argument --num-gpus: 0 must be >= 1"),
    (["plan", "--model", "gpt2", "--gpus-per-node", "x"], "argument --gpus-per-node: 'x' is not a whole number"),
    (["plan", "--model", "gpt2", "--safety-margin", "1"], "argument --safety-margin: 1 must be in [0, 1)"),
    (["plan", "--model", "gpt2", "--tensor-parallel-size", "two"], "argument --tensor-parallel-size: 'two' is not"),
    (["plan", "--model", "gpt2", "--gpu", "a200"], "argument --gpu: invalid choice: 'a200'"),
    (["plan", "--model", "gpt2", "--seq-len", "100000"], "--seq-len 100000 is longer than the model's 1024 positions"),
    (["plan", "--model", "gpt2", "--output", "plan.txt"], "--output plan.txt must end in .yaml, .yml or .json"),
    (["plan", "--model", "gpt2", "--output", "/no/such/dir/plan.yaml"], "the folder /no/such/dir does not exist"),
    (["plan", "--model", "gpt2", "--num-gpus", "4", "--tensor-parallel-size", "3"],
     "--tensor-parallel-size=3 must divide --num-gpus=4"),
    (["plan", "--model", "llama-3.1-8b", "--num-gpus", "16", "--tensor-parallel-size", "16"],
     "--tensor-parallel-size=16 does not divide the model's attention heads (8, 32); use one of [1, 2, 4, 8]"),
    (["plan", "--model", "llama-3.1-8b", "--num-gpus", "2", "--expert-parallel-size", "2"],
     "--expert-parallel-size=2: llama-3.1-8b has no MoE experts; leave --expert-parallel-size out"),
    (["plan", "--model", "mixtral-8x7b", "--num-gpus", "16", "--expert-parallel-size", "16"],
     "--expert-parallel-size=16 does not divide the model's 8 experts per layer"),
    (["plan", "--model", "no-such-model-anywhere"], "--model 'no-such-model-anywhere' is not a built-in config"),
    (["profile", "--batch-size", "0"], "argument --batch-size: 0 must be >= 1"),
    (["profile", "--budget-fraction", "2"], "argument --budget-fraction: 2 must be in [0, 1]"),
    (["profile", "--model", "{bad}"], "is not valid JSON"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_cli_bad_input_exits_2_with_an_error_line_before_any_model(argv, message, capsys, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr("hf_elixir.profiler._model_zoo.meta_model_and_batch", no_model)
    if "{bad}" in argv:
        bad = tmp_path / "config.json"
        bad.write_text("not json")
        argv = [str(bad) if a == "{bad}" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"hf-elixir {argv[0]}: error: " in err and message in err, err


def test_help_imports_no_torch():
    """``hf-elixir --help`` answers at once: nothing on its import path loads torch (it took 8 s)."""
    import subprocess
    import sys

    code = ("import sys, hf_elixir.cli as cli; cli._build_parser(); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_gpu_names_are_the_presets():
    from hf_elixir.cli import DEFAULT_PRESET, GPU_NAMES
    from hf_elixir.profiler._gpu_presets import DEFAULT_PRESET as PRESET_DEFAULT, GPU_PRESETS

    assert GPU_NAMES == tuple(GPU_PRESETS) and DEFAULT_PRESET == PRESET_DEFAULT


def test_profile_command_writes_a_png(tmp_path, capsys):
    out = tmp_path / "step.png"
    assert main(["profile", "--output", str(out), "--seq-len", "16"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "predicted" in capsys.readouterr().out


def test_plan_without_a_gpu_uses_a_preset_says_which_and_prints_human_times(tmp_path, capsys, monkeypatch):
    """No GPU here: the plan used to time this CPU as the device (the README's OPT-30B example predicted
    19,813 s per step). A preset from the spec sheet stands in, the output names it, times read in ms/s/min.
    The host-side rates the preset keeps are fixed ones (``fixed_cpu_hardware``, what the probe measured on a
    test VM), so the predicted step below does not depend on how loaded this machine is."""
    import torch

    from tests._models import fixed_cpu_hardware

    assert not torch.cuda.is_available()  # the suite runs on CPU machines
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "gpt2", "--seq-len", "128", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no GPU on this machine: device rates from the a100-80gb preset" in text
    assert "NVIDIA A100-SXM4-80GB" in text
    plan = ElixirPlan.load(out)
    # GPT-2 124M, 128 tokens, everything on an A100: about 11 ms with these host-side overheads (on this CPU's
    # rates it was seconds)
    assert plan.predicted_step_s < 0.1, plan.predicted_step_s
    import re

    row = re.search(r"predicted ([0-9.]+) (us|ms|s|min|h) a step", text)
    assert row is not None and row.group(2) in ("ms", "us"), text[-3000:]


def test_plan_gpu_flag_selects_the_preset(tmp_path, capsys):
    steps = {}
    for gpu in ("rtx4090", "h100"):
        out = tmp_path / f"{gpu}.yaml"
        assert main(["plan", "--model", "gpt2-xl", "--gpu", gpu, "--seq-len", "512", "--batch-size", "4",
                     "--output", str(out)]) == 0
        text = capsys.readouterr().out
        assert ("NVIDIA GeForce RTX 4090" if gpu == "rtx4090" else "NVIDIA H100") in text
        assert "no GPU on this machine" not in text  # the target was named
        plan = ElixirPlan.load(out)
        assert plan.predicted_peak_device_bytes <= 24 * 2**30 if gpu == "rtx4090" else True
        steps[gpu] = plan.predicted_step_s
    assert steps["h100"] < steps["rtx4090"], steps


def test_gpu_presets_hold_spec_sheet_numbers_and_derive_rates():
    from hf_elixir.profiler._gpu_presets import ACHIEVED_FRACTION, GPU_PRESETS, preset_hardware
    from hf_elixir.profiler._hardware import HardwareProfile

    for name in ("a100-40gb", "a100-80gb", "h100", "h200", "rtx4090"):
        p = GPU_PRESETS[name]
        assert set(p.tflops) == {"fp32", "tf32", "bf16", "fp16"} and p.source and p.memory_bytes > 16 * 2**30
    assert GPU_PRESETS["a100-80gb"].tflops["bf16"] == 312.0 and GPU_PRESETS["h100"].hbm_bytes_per_s == 3.35e12
    base = HardwareProfile(hostname="here", host_adam_numel_per_s=1e9, hook_event_s=1e-5)
    one = preset_hardware("h200", base)
    assert one.device_kind == "cuda" and one.can_overlap and one.host_adam_numel_per_s == 1e9
    assert one.flops_rate("bf16") == pytest.approx(989.5e12 * ACHIEVED_FRACTION["matmul"])
    assert one.flops_rate("fp32") == pytest.approx(67e12 * ACHIEVED_FRACTION["matmul"])
    assert one.allgather_bytes_per_s is None
    two = preset_hardware("h200", base, world_size=2)  # ring over NVLink: each rank sends half
    assert two.allgather_bytes_per_s == pytest.approx(2 * 450e9 * ACHIEVED_FRACTION["nvlink"])
    assert two.allreduce_bytes_per_s == pytest.approx(two.allgather_bytes_per_s / 2)
    with pytest.raises(ValueError, match="--gpu 'a200' is not a GPU preset"):
        preset_hardware("a200", base)


@pytest.mark.parametrize("seconds,text", [(2.5e-4, "250 us"), (0.0123, "12.3 ms"), (3.456, "3.46 s"),
                                          (19813.0, "5.5 h"), (600.0, "10 min")])
def test_times_print_in_human_units(seconds, text):
    from hf_elixir.cli._units import human_s

    assert human_s(seconds) == text


def _profile_figure(monkeypatch, argv):
    """Run `hf-elixir profile` and return (exit code, the drawn figure, printed text)."""
    import hf_elixir.cli._profile
    import hf_elixir.cli as cli

    drawn = []
    original = cli._profile._draw_profile
    monkeypatch.setattr(cli._profile, "_draw_profile", lambda *a: drawn.append(original(*a)) or drawn[-1])
    code = main(["profile", *argv])
    return code, (drawn[-1] if drawn else None)


def _axes_report(fig):
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = ax.get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    return ax, legend, labels


def test_profile_png_default_budget_onloads_y_from_zero_legend_outside(tmp_path, capsys, monkeypatch):
    out = tmp_path / "step.png"
    code, fig = _profile_figure(monkeypatch, ["--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import re

    onloads = int(re.search(r"(\d+) onloads", text).group(1))
    assert onloads > 0, text  # the default budget (--budget-fraction 0.5) forces offload
    ax, legend, labels = _axes_report(fig)
    assert ax.get_ylim()[0] == 0.0
    assert labels == ["device model data", "budget", "chunk onload"]
    # the legend sits outside the plotting area: it cannot cover the curve
    assert legend.get_window_extent().y0 >= ax.get_window_extent().y1 - 1


def test_profile_png_has_no_legend_entry_for_an_empty_series(tmp_path, capsys, monkeypatch):
    code, fig = _profile_figure(monkeypatch, ["--output", str(tmp_path / "s.png"), "--budget-fraction", "1"])
    assert code == 0 and " 0 onloads" in capsys.readouterr().out
    _, _, labels = _axes_report(fig)
    assert labels == ["device model data", "budget"]


def test_profile_takes_ranks_and_checkpointing_and_agrees_with_plan_on_budgets(tmp_path, capsys, monkeypatch):
    """Same flags, same search: a budget plan accepts, profile accepts (it refused 60KiB at 2 ranks: it had no
    --num-gpus and searched fp32 while plan defaults to bf16)."""
    shape = ["--model", "tiny-gpt2", "--batch-size", "2", "--seq-len", "32", "--num-gpus", "2", "--precision", "bf16",
             "--no-activations-on-device", "--activation-checkpointing", "off"]
    for budget, fits in (("60KiB", True), ("30KiB", False)):
        plan = main(["plan", *shape, "--gpu-memory", budget])
        plan_err = capsys.readouterr().err
        code, fig = _profile_figure(monkeypatch, [*shape[2:], "--budget", budget, "--output", str(tmp_path / "p.png")])
        prof_err = capsys.readouterr().err
        assert (plan == 0, code == 0) == (fits, fits), (budget, plan_err, prof_err)
        if not fits:
            assert "no configuration fits device_memory_budget_bytes=30720" in plan_err
            assert "no configuration fits device_memory_budget_bytes=30720" in prof_err
    code, fig = _profile_figure(monkeypatch, ["--activations-on-device", "--activation-checkpointing", "on",
                                              "--output", str(tmp_path / "c.png")])
    assert code == 0 and "ckpt True" in fig.axes[0].get_title()
    _, _, labels = _axes_report(fig)
    assert "budget minus activations" in labels


def test_plan_optimizer_flag_prices_its_state_bytes(monkeypatch, capsys):
    """``--optimizer`` hands the search that optimizer's terms (``optimizer_cost_terms`` of the same optimizer),
    not AdamW's."""
    import torch

    from hf_elixir import ElixirConfig
    from hf_elixir.cli import OPTIMIZER_TERMS
    from hf_elixir.optim.optimizer import optimizer_cost_terms
    from hf_elixir.search import _plan_search

    params = [torch.nn.Parameter(torch.zeros(2))]
    made = {"adamw": torch.optim.AdamW(params), "adam": torch.optim.Adam(params),
            "adamw-amsgrad": torch.optim.AdamW(params, amsgrad=True),
            "sgd-momentum": torch.optim.SGD(params, lr=0.1, momentum=0.9), "sgd": torch.optim.SGD(params, lr=0.1)}
    for name, opt in made.items():
        terms = optimizer_cost_terms(opt, ElixirConfig())
        assert OPTIMIZER_TERMS[name] == (terms["optim_states"], terms["snapshot_rollback"]), name
    seen = []
    real = _plan_search.search

    def spy(*args, **kwargs):
        seen.append((kwargs["optim_states"], kwargs["snapshot_rollback"]))
        return real(*args, **kwargs)
    monkeypatch.setattr(_plan_search, "search", spy)
    monkeypatch.setattr("hf_elixir.search.search", spy)
    assert main(["plan", "--model", "gpt2", "--gpu-memory", "2GiB", "--seq-len", "64", "--optimizer", "sgd"]) == 0
    assert seen and all(s == (0, True) for s in seen), seen


def test_plan_host_adam_flag_sets_the_target_host_rate(tmp_path, capsys):
    """``--host-adam-gelems`` prices the target's host AdamW, not this machine's: the same flag gives the same plan
    whatever the load here, and a slower host makes a plan that keeps optimizer states on the host slower."""
    times = {}
    for rate in ("4.5", "4.5", "0.5"):
        out = tmp_path / f"plan{len(times)}.yaml"
        # 1 GiB holds none of GPT-2's optimizer states on the device: the host AdamW prices every chunk's update
        assert main(["plan", "--model", "gpt2", "--gpu", "a100-40gb", "--gpu-memory", "1GiB",
                     "--host-memory", "256GiB", "--batch-size", "2", "--seq-len", "256", "--host-adam-gelems", rate,
                     "--output", str(out)]) == 0
        plan = ElixirPlan.load(out)
        times.setdefault(rate, []).append(plan.predicted_step_s)
        assert any("host AdamW " + rate + " G elements/s given" in r for r in plan.reasons), plan.reasons
    capsys.readouterr()
    assert times["4.5"][0] == times["4.5"][1]
    assert times["0.5"][0] > times["4.5"][0]


def _alternative_rows(text: str) -> list[str]:
    lines = text.split("configurations compared", 1)[1].splitlines()
    return [ln for ln in lines if ln.startswith("│") and ("sharded" in ln or "replicated" in ln)]


def test_plan_table_agrees_with_its_activation_policy_and_shows_distinct_rows(capsys):
    # a batch whose activations only fit recomputed: the per-block policy decides, not the uniform flag
    assert main(["plan", "--model", "gpt2", "--gpu-memory", "10GiB", "--batch-size", "16", "--seq-len", "1024",
                 "--precision", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "activations recompute 12/12 blocks" in text  # the headline says the policy the plan runs
    rows = _alternative_rows(text)
    assert rows and len(rows) == len(set(rows)), rows


def test_plan_host_memory_error_names_the_cli_flag(capsys):
    assert main(["plan", "--model", "gpt2", "--gpu-memory", "2GiB", "--host-memory", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "no configuration fits host memory" in err and "--host-memory" in err and "host_memory_bytes=" not in err


@pytest.mark.parametrize(("name", "billions"), [
    ("Llama-3.1-8B", 8.03), ("Qwen3-30B-A3B", 30.53), ("mixtral-8x7b", 46.70), ("deepseek-ai/DeepSeek-V3", 671.03),
    ("gpt-oss-20b", 20.91)])
def test_builtin_configs_of_todays_models_build_on_meta_at_their_published_size(name, billions):
    from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch

    model, _ = meta_model_and_batch(load_config(name), batch_size=1, seq_len=8)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_plan_command_runs_for_a_builtin_llama_3_1_8b(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--num-gpus", "8", "--gpu", "h100", "--host-memory", "2TiB"]) == 0
    text = capsys.readouterr().out
    assert "8.0 B parameters" in text and "Run tensor parallel" in text


def _plan_json(capsys, argv) -> dict:
    import json

    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_for_a_named_gpu_measures_nothing_here_and_is_the_same_on_a_busy_machine(tmp_path, capsys, monkeypatch):
    """The target's rates by default ([Note: target rates] in hf_elixir/cli/_plan.py): planning for a named GPU
    never times this machine, so a busy loop on both cores changes nothing; the report names each rate's source."""
    import subprocess
    import sys

    def no_probe(*args, **kwargs):
        raise AssertionError("this machine was measured for a plan for another machine")

    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", no_probe)
    argv = ["plan", "--model", "gpt2", "--gpu", "a100-40gb", "--gpu-memory", "1GiB", "--host-memory", "256GiB",
            "--num-gpus", "2", "--seq-len", "128", "--output"]
    idle = _plan_json(capsys, [*argv, str(tmp_path / "idle.yaml")])
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = _plan_json(capsys, [*argv, str(tmp_path / "busy.yaml")])
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert ElixirPlan.load(tmp_path / "idle.yaml") == ElixirPlan.load(tmp_path / "busy.yaml")
    for report in (idle, busy):
        del report["search_s"], report["plan_file"]
    assert idle == busy
    sources = {r["rate"]: r["source"] for r in idle["rates"]}
    assert sources["host AdamW"].startswith("a GPU server's host") and idle["rates"][5]["value"] == 4.5
    assert sources["device matmul"] == "a100-40gb preset (NVIDIA A100 data sheet, derated)"
    assert sources["device memory per GPU"] == "--gpu-memory" and sources["host memory per machine"] == "--host-memory"
    assert idle["hardware"] == "2 x NVIDIA A100-SXM4-40GB (a100-40gb preset)"


def test_measure_here_times_this_machine_and_says_so(capsys, monkeypatch):
    from tests._models import fixed_cpu_hardware

    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    report = _plan_json(capsys, ["plan", "--model", "gpt2", "--gpu", "h100", "--measure-here", "--seq-len", "64"])
    host = next(r for r in report["rates"] if r["rate"] == "host AdamW")
    assert host["source"] == "measured on this machine (--measure-here)" and host["value"] == 0.5
    flag = _plan_json(capsys, ["plan", "--model", "gpt2", "--gpu", "h100", "--measure-here", "--seq-len", "64",
                               "--host-adam-gelems", "2"])
    host = next(r for r in flag["rates"] if r["rate"] == "host AdamW")
    assert host["source"] == "--host-adam-gelems" and host["value"] == 2.0


def test_plan_report_reads_in_human_units_and_its_json_adds_up(capsys):
    """GiB/TiB and M/B, no scientific notation, one count of configurations, the rows of the memory table add up to
    the peak, the headline's tokens/s is the job's (data-parallel micro-batches over the step)."""
    import re

    argv = ["plan", "--model", "gpt2", "--gpu", "h100", "--num-gpus", "2", "--gpu-memory", "2GiB",
            "--host-memory", "1TiB", "--seq-len", "512"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert not re.search(r"\d\.?\d*e[+-]\d", text), re.findall(r".{40}\d\.?\d*e[+-]\d.{10}", text)
    assert "124.4 M parameters" in text and "of 1 TiB per machine" in text and "hostname" not in text
    assert len(re.findall(r"searched [\d,]+ configurations", text)) == 1
    report = _plan_json(capsys, argv)
    assert sum(r["bytes"] for r in report["memory_at_peak"]) == report["device_peak_bytes"]
    chosen = report["chosen"]
    tokens = chosen["data_parallel"] * 512
    assert chosen["tokens_per_s"] == pytest.approx(tokens / chosen["step_s"], rel=1e-4)
    assert report["alternatives"][0]["tokens_per_s"] == max(r["tokens_per_s"] for r in report["alternatives"])


@pytest.mark.parametrize("value,text", [(2**40, "1 TiB"), (1.5 * 2**30, "1.5 GiB"), (537 * 2**20, "537 MiB"),
                                        (76137713668, "70.91 GiB"), (12, "12 B")])
def test_sizes_print_in_binary_units(value, text):
    from hf_elixir.cli._units import human_bytes

    assert human_bytes(value) == text


def test_plan_lora_prices_a_frozen_base_and_trained_adapters(tmp_path, capsys):
    """``--lora-rank``: peft's adapters on the meta model; the frozen base has no gradients or optimizer state, so a
    budget too small for full fine-tuning fits LoRA, and the plan packs the adapters with the base."""
    argv = ["plan", "--model", "gpt2-medium", "--gpu", "h100", "--gpu-memory", "1GiB", "--host-memory", "2GiB",
            "--seq-len", "128"]
    assert main(argv) == 2  # full fine-tuning needs host memory for its fp32 masters and moments
    assert "no configuration fits host memory" in capsys.readouterr().err
    out = tmp_path / "lora.json"
    report = _plan_json(capsys, [*argv, "--lora-rank", "8", "--lora-targets", "c_attn", "--output", str(out)])
    data = report["zero3_model_data_per_gpu_bytes"]
    assert 0 < data["grads"] < 0.01 * data["params"] and data["optimizer"] < 0.02 * data["params"]
    plan = ElixirPlan.load(out)
    assert any("lora_A" in name for name in plan.param_order) and any("LoRA rank 8" in r for r in plan.reasons)
