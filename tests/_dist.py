"""Spawn N gloo processes (free port, timeouts) and run a module-level function in each.

Workers return a picklable result through a file; failures re-raise in the parent with the rank's
traceback. Every collective runs under the process group's timeout, so a hang fails the test.

[Note: forkserver ranks] The ranks start by ``forkserver``, not ``spawn``: a spawned rank imports torch,
transformers and hf_elixir again (3-5 s a test on the 2-core CI machine, 8-10 s under load, for a step of
milliseconds), while a rank forked from the server, which imported them once per test session, starts in
about 0.1 s. Each rank is a fresh fork of the server (never of an earlier rank or of the pytest process,
whose threads and process groups it must not inherit), so it sees those modules as freshly imported. The
server's environment is the one it started with; each rank therefore takes the caller's ``os.environ`` as it
is at ``run_distributed`` (a test's ``monkeypatch.setenv`` reaches its ranks, as with ``spawn``). What a module
reads from the environment at import (``HF_ELIXIR_STRICT_DEVICE``, ``TRITON_INTERPRET``) is fixed by
``conftest.py`` before the server starts. ``HF_ELIXIR_TEST_START_METHOD=spawn`` restores spawned ranks.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: imported once by the forkserver ([Note: forkserver ranks]); a module that fails to import is skipped there
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.opt.modeling_opt",
            "transformers.models.switch_transformers.modeling_switch_transformers", "accelerate", "hf_elixir"]


def _start_method() -> str:
    method = os.environ.get("HF_ELIXIR_TEST_START_METHOD", "forkserver")
    if method == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)
    return method


def _worker(rank: int, world_size: int, port: int, fn, args, out_dir: str, timeout_s: int,
            environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's, not the forkserver's ([Note: forkserver ranks])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    result = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(context, deadline_s: float) -> None:
    """Wait for every rank until ``deadline_s`` (``time.monotonic()``); past it, kill them and fail (a hang)."""
    while not context.join(timeout=max(0.1, min(1.0, deadline_s - time.monotonic()))):
        if time.monotonic() > deadline_s:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError("the ranks did not finish in time: a hang")


def run_distributed(fn, world_size: int, *args, timeout_s: int = 120, join_timeout_s: float | None = None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the list of results.

    ``join_timeout_s``: kill the ranks and fail when they have not all returned by then (a hang outside the process
    group's collectives, which ``timeout_s`` bounds)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker, args=(world_size, free_port(), fn, args, out_dir, timeout_s, dict(os.environ)),
            nprocs=world_size, join=join_timeout_s is None, start_method=_start_method())
        if join_timeout_s is not None:
            _join(context, time.monotonic() + join_timeout_s)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
