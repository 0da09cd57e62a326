"""Every benchmark command that benchmarks/RESULTS.md, README.md or docs/ gives runs as given: ``python
benchmarks/<script>.py`` or ``python -m benchmarks.<script>`` from the repository root, with nothing of the checkout on
``PYTHONPATH`` (as after ``pip install -e .``, which installs ``hf_elixir`` and ``triton_kernels`` but not
``benchmarks``).

Each script a page names has a cheap form here (:data:`QUICK`): its quick run where it has one that takes seconds,
else ``--help`` (the full runs take minutes to hours); the quick forms of run_cpu / moe_dense / plan_tables /
split_experts / gpu run in tests/test_benchmarks.py and tests/test_benchmarks_gpu.py. ``--help``
does not reach an import inside ``main``, so a static check adds that every script importing ``benchmarks`` makes
the checkout importable first (a script run by path has only ``benchmarks/`` on ``sys.path``).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "benchmarks" / "RESULTS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: script -> the arguments of its cheap form ("{tmp}" is a scratch folder)
QUICK: dict[str, list[str]] = {
    "compile_bench": ["--quick", "--peers", "ddp_eager", "elixir_eager", "--steps", "1", "--warmup", "1",
                      "--output", "{tmp}/compile.json"],
    "disk_tier": ["--quick", "--skip-gpt2", "--dir", "{tmp}"],
    "host_adam": ["--rounds", "1", "--hidden", "64", "--blocks", "4096", "--threads", "1"],
    "kernel_bench": ["--smoke"],
    "trl_sft": ["--quick", "--systems", "elixir,ddp", "--modes", "lora"],
    "moe": ["--device", "cpu", "--steps", "1", "--warmup", "0", "--layers", "1", "--d-model", "32", "--d-ff", "64",
            "--heads", "2", "--vocab", "128", "--batch", "2", "--seq", "16", "--experts", "2"],
    **{name: ["--help"] for name in ("agreed_prefetch", "checkpoint_kill", "host_memory", "predicted_gpu", "search_accuracy", "soak",
                                          "start_hook_overhead")},
    # their quick forms, as the pages give them, run in tests/test_benchmarks.py and tests/test_benchmarks_gpu.py
    **{name: [] for name in ("gpu", "moe_dense", "plan_tables", "run_cpu", "split_experts")},
}
#: the fix a script run by path needs before it imports ``benchmarks`` (the one form every script uses)
PATH_FIX = "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))"


#: the two forms a page gives a command in: by path, or as a module
FORMS = {"path": r"python benchmarks/(\w+)\.py", "module": r"python -m benchmarks\.(\w+)"}


def _named_forms() -> set[tuple[str, str]]:
    """(script, form) for every benchmark command a page gives."""
    return {(name, form) for page in PAGES for form, pattern in FORMS.items()
            for name in re.findall(pattern, page.read_text())}


def _named_scripts() -> set[str]:
    return {name for name, _ in _named_forms()}


def test_every_named_script_has_a_cheap_form_here():
    named = _named_scripts()
    assert named, "no page names a benchmark command any more"
    assert named - set(QUICK) == set(), "a page names a benchmark this test does not run"
    assert all((ROOT / "benchmarks" / f"{name}.py").is_file() for name in named)


def _imports_benchmarks(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "benchmarks":
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "benchmarks" for a in node.names):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("name", sorted(QUICK))
def test_a_script_importing_benchmarks_makes_the_checkout_importable_first(name):
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    imports = _imports_benchmarks(ast.parse(source))
    if imports:
        assert PATH_FIX in source, f"benchmarks/{name}.py imports benchmarks without {PATH_FIX}"
        fix_line = source[:source.index(PATH_FIX)].count("\n") + 1
        assert fix_line < min(imports), f"benchmarks/{name}.py imports benchmarks (line {min(imports)}) before the fix"


@pytest.mark.parametrize("name,form", sorted((n, f) for n, f in _named_forms() if QUICK.get(n)))
def test_named_command_runs_as_given(name, form, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    args = [a.replace("{tmp}", str(tmp_path)) for a in QUICK[name]]
    command = [f"benchmarks/{name}.py"] if form == "path" else ["-m", f"benchmarks.{name}"]
    proc = subprocess.run([sys.executable, *command, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    if args != ["--help"]:
        assert proc.stdout.strip(), "the quick run printed nothing"
