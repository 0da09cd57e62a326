"""No module of this repository shadows an installed package.

``python benchmarks/run_cpu.py`` and ``python recipes/finetune_clm.py`` put their own folder first on
``sys.path``. A file there named like an installed top-level module (``benchmarks/kernels.py`` did: transformers
5.25 requires and imports the ``kernels`` package) then replaces that package for the whole process, and every
import of transformers fails with ``cannot import name 'CUDAProperties' from 'kernels'``.
"""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folders a documented command runs a script from (so they are sys.path[0]), and the repository root
# (``python -m pytest`` / ``python -m benchmarks.x`` from the checkout).
SCRIPT_FOLDERS = ["benchmarks", "recipes", "tests", "."]


def _installed_top_level() -> set[str]:
    """Top-level module names importable from site-packages (not from this checkout)."""
    names = set()
    for info in pkgutil.iter_modules():
        path = Path(str(getattr(info.module_finder, "path", "")))
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            names.add(info.name)
    return names


def _module_names(folder: Path) -> set[str]:
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return names


@pytest.mark.parametrize("folder", SCRIPT_FOLDERS)
def test_no_module_shadows_an_installed_or_standard_module(folder):
    installed = _installed_top_level()
    assert "transformers" in installed and "torch" in installed, "site-packages not found: the check would be empty"
    own = _module_names(ROOT / folder)
    # The repository's own installed packages (pip install -e .) are found in site-packages through a finder.
    own_packages = {"hf_elixir", "triton_kernels", "hf_elixir_autoroute", "hf_elixir_launch_config"}
    clashes = sorted(n for n in own - own_packages if n in installed or n in sys.stdlib_module_names)
    assert not clashes, (f"{folder}/ holds modules named like installed or standard-library modules {clashes}: a "
                         f"script run from {folder}/ would import them instead of the real ones; rename them")
