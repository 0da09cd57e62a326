"""Spawn N gloo processes (free port, timeouts) and run a module-level function in each.

Workers return a picklable result through a file; failures re-raise in the parent with the rank's
traceback. Every collective runs under the process group's timeout, so a hang fails the test.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, out_dir: str, timeout_s: int) -> None:
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


def run_distributed(fn, world_size: int, *args, timeout_s: int = 120):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the list of results."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, timeout_s),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
