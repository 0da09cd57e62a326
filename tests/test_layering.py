"""Nothing below imports a layer above it (docs/design/rules.md, *Errors and layers*).

Every module under ``hf_elixir/`` is parsed (``ast``, so lazy imports inside functions count too;
imports under ``if TYPE_CHECKING:`` do not, they never run) and its ``hf_elixir`` imports are checked
against the layer order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hf_elixir"

#: layer of each top-level part of the package, bottom first; a module may import its own layer and below
LAYERS = {
    "config": 0, "plan": 0, "data": 0, "_compat": 0, "_logging": 0,
    "chunk": 1,
    "runtime": 2,
    "optim": 3,
    "placement": 4,
    "parallel": 5,
    "profiler": 6,
    "search": 7,
    "api": 8,
    "checkpoint": 9, "_hardware_probe": 9,
    "__init__": 10,
    "integrations": 11,
    "cli": 11,
}
#: may import the façade (``hf_elixir.api``, or the ``hf_elixir`` package itself)
FACADE_USERS = ("__init__", "integrations", "cli", "_hardware_probe")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[str]:
    """Every ``hf_elixir`` module name imported anywhere in ``tree`` (outside ``if TYPE_CHECKING:``)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.split(".")[0] == "hf_elixir")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "hf_elixir":
            if node.module == "hf_elixir":  # `from hf_elixir import x`: a submodule, or the package's names
                found.extend(f"hf_elixir.{a.name}" if (ROOT / a.name).is_dir() or (ROOT / f"{a.name}.py").is_file()
                             else "hf_elixir" for a in node.names)
            else:
                found.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _part(module: str) -> str:
    """``hf_elixir.chunk.manager`` -> ``chunk``; ``hf_elixir`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> list[tuple[str, list[str]]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        part = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"
        out.append((f"{part}:{rel}", _imports(ast.parse(path.read_text(), filename=str(path)))))
    return out


def test_every_part_has_a_layer():
    parts = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts <= set(LAYERS), f"add {sorted(parts - set(LAYERS))} to LAYERS"


def test_only_the_top_imports_the_facade():
    bad = [(where, m) for where, imports in _modules() for m in imports
           if _part(m) in ("api", "__init__") and where.split(":")[0] not in FACADE_USERS]
    assert not bad, f"modules below the façade import hf_elixir.api / the hf_elixir package: {bad}"


def test_chunk_imports_no_upper_layer():
    forbidden = {"runtime", "placement", "optim", "search", "integrations", "parallel", "profiler", "api",
                 "checkpoint", "cli"}
    bad = [(where, m) for where, imports in _modules() for m in imports
           if where.startswith("chunk:") and _part(m) in forbidden]
    assert not bad, f"chunk/ imports an upper layer: {bad}"


@pytest.mark.parametrize("where,imports", _modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_no_module_imports_a_layer_above_it(where, imports):
    own = LAYERS[where.split(":")[0]]
    above = [m for m in imports if LAYERS[_part(m)] > own]
    assert not above, f"{where} (layer {own}) imports layers above it: {above}"


def test_the_checker_sees_lazy_imports():
    tree = ast.parse("def f():\n    from hf_elixir.api import prepare\n"
                     "if TYPE_CHECKING:\n    from hf_elixir.optim import x\n")
    assert _imports(tree) == ["hf_elixir.api"]
