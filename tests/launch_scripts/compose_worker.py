"""Rank-side script of ``tests/test_multinode.py``: started by two ``torchrun`` agents (2 nodes x 2 processes,
gloo, CPU) exactly as a user launches a job that outgrew one machine.

Every rank checks what is per node (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the host budget), then trains
the compositions (TP=2 x DP=2 on a tiny Llama, EP=2 x DP=2 on a tiny Mixtral) under a device budget that
forces offload against plain PyTorch on the concatenated data-parallel batches, records which ranks the
groups of the mesh it trained on hold, and writes ``{out_dir}/rank{RANK}.json``. The budget is the tests'
tight one (5% above the smallest ``prepare`` accepts): at dp=2, half the 16 B/param state is below the
tiny Llama's working set and leaves the tiny Mixtral's chunks all resident.

Usage: ``torchrun --nnodes 2 --nproc_per_node 2 --node_rank N ... compose_worker.py OUT_DIR CASE [CASE ...]``
with CASE in ``llama_tp2_dp2`` / ``mixtral_ep2_dp2``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _per_node() -> dict:
    """What each rank reads per node: its device index from ``LOCAL_RANK`` (with two CUDA devices per node
    simulated, as on a 2-GPU machine) and its default host budget (80% of RAM / ``LOCAL_WORLD_SIZE``)."""
    import psutil

    from hf_elixir.chunk.memory import default_host_budget_bytes
    from hf_elixir.profiler._device import select_compute_device

    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=2), \
            mock.patch("torch.cuda.current_device", return_value=0), \
            mock.patch("torch.cuda.set_device") as set_device:
        device = select_compute_device()
    return {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "device_index": device.index,
        "set_device_calls": [c.args[0] for c in set_device.call_args_list],
        "host_budget_bytes": default_host_budget_bytes(),
        "host_ram_bytes": psutil.virtual_memory().total,
        "strict_device": os.environ.get("HF_ELIXIR_STRICT_DEVICE"),
    }


def _groups(mesh) -> dict:
    """The ranks of each group this rank belongs to in the mesh the prepared model trains on."""
    ranks = dist.get_process_group_ranks
    return {
        "mp_group": sorted(ranks(mesh.tp_group if mesh.mp_axis == "tp" else mesh.ep_group)),
        "dp_axis_group": sorted(ranks(mesh.expert_dp_group)),
        "dp_group": sorted(ranks(mesh.dp_group)),  # the group non-expert chunks are sharded over
    }


def _recording_prepare(seen: dict):
    """``hf_elixir.prepare`` that also records the host budget the ranks agreed on and the chunks that keep a
    rank-local host copy (refilled from this rank's host memory, never by an all-gather)."""
    import hf_elixir
    from hf_elixir.parallel._state import get_parallel_state

    prepare = hf_elixir.prepare

    def recording(*args, **kwargs):
        model, opt = prepare(*args, **kwargs)
        state = hf_elixir.get_state(model)
        seen["host_budget_used_bytes"] = state.config.host_memory_budget_bytes
        seen["host_copy_chunks"] = sum(bool(c.keep_host_copy) for c in state.manager.chunks)
        seen.update(_groups(get_parallel_state(model).mesh))
        return model, opt

    return mock.patch.object(hf_elixir, "prepare", recording)


def _case(name: str) -> dict:
    seen: dict = {}
    if name == "llama_tp2_dp2":
        from parallel_harness import train_case

        with _recording_prepare(seen):
            metrics = train_case("llama", tp=2, elixir="tight", matrix_decay=True)
        return {**metrics, **seen}
    if name == "mixtral_ep2_dp2":
        from tests._moe_ep_cases import ep_case

        with _recording_prepare(seen):
            metrics = ep_case("mixtral", budget="tight")
        return {**metrics, **seen}
    raise ValueError(f"unknown case {name!r}")


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
    dist.init_process_group("gloo")
    result: dict = {"per_node": _per_node()}
    for name in cases:
        try:
            result[name] = _case(name)
        except Exception:  # report, keep going: the other ranks raise too or time out
            result[name] = {"error": f"rank {dist.get_rank()}: {traceback.format_exc()}"}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
