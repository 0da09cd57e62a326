"""Rank-side script of ``tests/test_tp_ep.py::test_tp_ep_eight_ranks_on_two_nodes``: started by two ``torchrun``
agents (2 nodes x 4 processes, gloo, CPU). Every rank trains the tiny Qwen3-MoE at ``tensor_parallel_size=2``,
``expert_parallel_size=4`` under a budget 5% above the smallest ``prepare`` accepts (``tests/_tp_ep_cases.py``) against plain PyTorch
and writes its metrics to ``{out_dir}/rank{RANK}.json``.

Usage: ``torchrun --nnodes 2 --nproc_per_node 4 --node_rank N ... tp_ep_worker.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torch.distributed as dist  # noqa: E402

from tests._tp_ep_cases import train_case  # noqa: E402


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    try:
        metrics = train_case("qwen3_moe", tp=2, ep=4, budget="tight")
        metrics.pop("placements")
        Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
