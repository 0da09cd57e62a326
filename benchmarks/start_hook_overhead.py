"""Start-up cost of the ``torch.backends`` start hook (``hf_elixir_autoroute``) in a plain DDP launch.

Launches a minimal accelerate script (``Accelerator(cpu=True)``, a ``Linear`` and its AdamW through
``accelerator.prepare``) with a config that has no Elixir section, ``--repeats`` times with the hook on and with
``HF_ELIXIR_AUTOROUTE=0``, at ``--num-processes`` CPU processes, and reports per process the median of:
``import torch`` (where the hook arms), ``import transformers + accelerate`` (the import watcher runs on each new
import), the hook's work at the first ``accelerator.prepare`` (finding and reading the launch's config file, timed
apart), that ``prepare`` itself, and how many ``hf_elixir`` modules the process imported (0 expected). [Note: the start hook stays out of other launches] in
``hf_elixir_autoroute.py``.

    python benchmarks/start_hook_overhead.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PROBE = r'''
import os, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers, accelerate
from accelerate import Accelerator
t2 = time.perf_counter()
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.AdamW(model.parameters())
import hf_elixir_autoroute as hook
armed = bool(hook._ORIGINALS)  # the hook put its first-call trigger on Accelerator.prepare
t3 = time.perf_counter()
if armed:
    hook._activate()  # what the trigger runs at the first prepare: find the launch's config file, read it
t4 = time.perf_counter()
model, optimizer = accelerator.prepare(model, optimizer)
t5 = time.perf_counter()
own = sum(m == "hf_elixir" or m.startswith("hf_elixir.") for m in sys.modules)
os.write(1, (f"PROBE torch={t1 - t0:.4f} hf={t2 - t1:.4f} hook_first_call={t4 - t3:.5f} prepare={t5 - t4:.4f} "
             f"armed={int(armed)} hf_elixir_modules={own}\n").encode())
'''

_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
rdzv_backend: static
same_network: true
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(folder: Path, num_processes: int, hook_on: bool) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELIXIR_")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_ELIXIR_AUTOROUTE="1" if hook_on else "0")
    procs = ["--multi_gpu", "--num_processes", str(num_processes)] if num_processes > 1 else ["--cpu", "--num_processes", "1"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(folder / "ddp.yaml"),
           "--main_process_port", str(_free_port()), *procs, str(folder / "probe.py")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=folder)
    rows = [dict((k, float(v)) for k, v in re.findall(r"(\w+)=([\d.]+)", line))
            for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    if out.returncode != 0 or len(rows) != num_processes:
        raise RuntimeError(f"launch failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-processes", type=int, default=2)
    args = parser.parse_args(argv)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "probe.py").write_text(_PROBE)
        (folder / "ddp.yaml").write_text(_YAML)
        for hook_on in (True, False, True, False)[: 2 if args.repeats < 2 else 4]:  # interleaved: load drifts
            rows = [r for _ in range(max(1, args.repeats // 2)) for r in _launch(folder, args.num_processes, hook_on)]
            result.setdefault("hook on" if hook_on else "hook off", []).extend(rows)
    summary = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} | {"samples": len(rows)}
               for name, rows in result.items()}
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
