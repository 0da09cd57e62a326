"""A stock ``Trainer`` script under hf_elixir ends its gloo group before Python finalizes ([Note: gloo group at
exit] in ``hf_elixir/parallel/_exit.py``).

The flake this guards against (a gloo worker thread taking the GIL during ``Py_FinalizeEx``: SIGABRT after
training, about one launch in eight on a loaded 2-core machine) is a race of milliseconds, so the test checks
its precondition instead, deterministically: ``tests/launch_scripts/run_trainer.py``, run unchanged (through
``runpy``) by ``accelerate launch`` at 2 CPU processes, behind an ``atexit`` probe registered before anything
else (so it runs after hf_elixir's hook: ``atexit`` is last in, first out), finds no default group and no gloo
thread left (a script that never destroys its group would show the group and 3 gloo threads there).
"""

from __future__ import annotations

import sys

import pytest

from tests.test_launch import SCRIPTS, _field, _launch

WRAPPER = """
import atexit, os, runpy, sys

def probe():  # registered first, so it runs last: after hf_elixir's hook
    import torch.distributed as dist
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    gloo = sum("gloo" in name for name in names)
    os.write(1, f"AT_EXIT initialized={dist.is_initialized()} gloo_threads={gloo}\\n".encode())

atexit.register(probe)
runpy.run_path(sys.argv.pop(1), run_name="__main__")  # the stock script, with its own arguments
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc/self/task")
def test_a_stock_trainer_script_ends_its_gloo_group_before_python_finalizes(tmp_path):
    wrapper = tmp_path / "probe_exit.py"
    wrapper.write_text(WRAPPER)
    out = _launch(tmp_path, 2, [str(wrapper), str(SCRIPTS / "run_trainer.py"), str(tmp_path / "out")],
                  via="accelerate")
    assert _field(out, "TRAINED_MODEL_CLASS") == ["GPT2LMHeadModel"] * 2, out[-3000:]
    assert out.count("AT_EXIT initialized=False gloo_threads=0") == 2, out[-3000:]
