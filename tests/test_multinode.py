"""Compositions on 4 ranks launched as 2 nodes x 2 processes: two ``torchrun`` agents on this machine
(``--nnodes 2 --nproc_per_node 2 --node_rank 0|1 --master_addr 127.0.0.1``), gloo, CPU, as a user launches a
job that outgrew one machine. One launch runs both compositions (``tests/launch_scripts/compose_worker.py``):

- TP=2 x DP=2 on a tiny Llama (tensor parallel read from its config's plan),
- EP=2 x DP=2 on a tiny Mixtral (fused 3-D experts),

each prepared under a device budget that forces offload, AdamW with weight decay on matrices only, clipping,
5 steps, fp32, strict device mode on, against plain PyTorch on the concatenation of the data-parallel ranks'
batches. Plus what is per node: the device index from ``LOCAL_RANK``, the host budget from
``LOCAL_WORLD_SIZE``, model-parallel groups inside a node and data-parallel groups across nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port

TOL = 2e-5  # fp32, relative: loss every step and the whole parameter vector after 5 steps
WORKER = Path(__file__).parent / "launch_scripts" / "compose_worker.py"
CASES = ("llama_tp2_dp2", "mixtral_ep2_dp2")
NODE_OF_RANK = {0: 0, 1: 0, 2: 1, 3: 1}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("multinode")
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
         "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
         str(WORKER), str(out_dir), *CASES],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, log in zip(agents, logs):
        assert agent.returncode == 0, log[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


def test_strict_device_mode_is_on_in_every_rank(ranks):
    assert all(r["per_node"]["strict_device"] == "1" for r in ranks)


def test_device_index_and_host_budget_are_read_per_node(ranks):
    """With two devices per node, rank 3 computes on device 1 of node 1 (its ``LOCAL_RANK``), not on a
    device 3 that no node has; the default host budget splits a node's RAM over that node's 2 ranks."""
    for r in ranks:
        node = r["per_node"]
        assert node["group_rank"] == NODE_OF_RANK[node["rank"]], node
        assert node["local_world_size"] == 2 and node["local_rank"] == node["rank"] % 2, node
        assert node["device_index"] == node["local_rank"], node
        assert node["host_budget_bytes"] == int(0.8 * node["host_ram_bytes"]) // 2, node


@pytest.mark.parametrize("case", CASES)
def test_model_parallel_groups_stay_in_a_node_and_dp_crosses_nodes(ranks, case):
    for rank, r in enumerate(ranks):
        m = r[case]
        assert "error" not in m, m["error"]
        assert m["mp_group"] == ([0, 1] if rank < 2 else [2, 3]), m["mp_group"]
        assert {NODE_OF_RANK[q] for q in m["mp_group"]} == {NODE_OF_RANK[rank]}
        assert m["dp_axis_group"] == [rank % 2, rank % 2 + 2]
        assert {NODE_OF_RANK[q] for q in m["dp_axis_group"]} == {0, 1}
        # non-expert chunks: the dp axis under tp (tp ranks see the same batch), the world under ep
        assert m["dp_group"] == (m["dp_axis_group"] if "_tp2_" in case else [0, 1, 2, 3])


@pytest.mark.parametrize("case", CASES)
def test_composition_under_offload_matches_plain_pytorch(ranks, case):
    for r in ranks:
        m = r[case]
        assert "error" not in m, m["error"]
        assert m["loss_rel"] < TOL and m["norm_rel"] < TOL and m["param_rel"] < TOL, m
        assert m["same_keys"] and m["params_moved"] > 1e-3, m
        assert m["num_evictions"] > 0, "the budget must force offload"
        # prepare agreed on the per-node host budget (RAM / 2 ranks on the node, not / 4 in the world)
        assert m["host_budget_used_bytes"] == r["per_node"]["host_budget_bytes"], m


@pytest.mark.parametrize("local_world_size, warned", [("2", False), ("4", False), ("3", True)])
def test_model_parallel_groups_that_would_span_nodes_are_reported(monkeypatch, caplog, local_world_size, warned):
    """tp=2 on nodes of 3 ranks: the groups {2, 3} straddle nodes 0 and 1; said, with the fix."""
    from hf_elixir.parallel._mesh import _warn_if_mp_groups_cross_nodes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    with caplog.at_level("WARNING", logger="hf_elixir.parallel._mesh"):
        _warn_if_mp_groups_cross_nodes("tp", 2)
    assert ("tensor_parallel_size=2 does not divide the 3 ranks on this node" in caplog.text) == warned


@pytest.mark.parametrize("visible, initialized, expected", [(1, False, [0]), (2, False, []), (1, True, [])])
def test_one_visible_gpu_is_made_current_before_the_mesh(monkeypatch, visible, initialized, expected):
    """LOCAL_RANK=1 with CUDA_VISIBLE_DEVICES giving the process one GPU: cuda:0 becomes current before
    ``init_device_mesh`` (which would pick cuda:1, an invalid ordinal); with two visible devices, or a device
    the process already set, the mesh's own choice (``cuda:LOCAL_RANK``) or the user's stands."""
    import torch

    from hf_elixir.parallel._mesh import _set_device_before_mesh

    calls: list[int] = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    _set_device_before_mesh()
    assert calls == expected
