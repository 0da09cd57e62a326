"""The public surface of ``hf_elixir``: the integrations at the top level, imported lazily."""

import json
import subprocess
import sys


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_hf_elixir_does_not_import_the_integrations():
    loaded = _run("import json, sys, hf_elixir; "
                  "print(json.dumps({m: m in sys.modules for m in ('accelerate', 'transformers.trainer', "
                  "'hf_elixir.integrations.accelerate_plugin', 'hf_elixir.integrations.trainer_callback')}))")
    assert not any(loaded.values()), loaded


def test_integrations_are_exported_at_the_top_level():
    names = _run("import json, hf_elixir; from hf_elixir.integrations import ElixirCallback, ElixirPlugin; "
                 "print(json.dumps([hf_elixir.ElixirPlugin is ElixirPlugin, hf_elixir.ElixirCallback is ElixirCallback, "
                 "'ElixirPlugin' in hf_elixir.__all__, 'ElixirCallback' in hf_elixir.__all__]))")
    assert names == [True, True, True, True]
    import hf_elixir

    try:
        hf_elixir.NoSuchName
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("hf_elixir.NoSuchName did not raise AttributeError")
