"""The peer models of ``benchmarks/predicted_gpu.py`` move, per step, the bytes their construction implies,
checked by hand on a two-block model: root (embeddings + head) 100 elements, blocks
``h.0`` and ``h.1`` 40 elements each, bf16 (b = 2)."""

import pytest

from benchmarks._peers_predicted import predict_peer, units_of
from hf_elixir.profiler import AccessEvent, HardwareProfile, StepProfile


def _profile() -> StepProfile:
    fwd = [AccessEvent("fwd", "wte", [0], flops=1e6), AccessEvent("fwd", "h.0.mlp", [1], flops=2e6),
           AccessEvent("fwd", "h.1.mlp", [2], flops=2e6)]
    bwd = [AccessEvent("bwd", "h.1.mlp", [2], flops=4e6), AccessEvent("bwd", "h.0.mlp", [1], flops=4e6),
           AccessEvent("bwd", "wte", [0], flops=2e6)]
    return StepProfile(param_names=["wte.weight", "h.0.mlp.weight", "h.1.mlp.weight"], param_numels=[100, 40, 40],
                       param_requires_grad=[True] * 3, events=fwd + bwd, grad_ready_event=[5, 4, 3],
                       block_activation_bytes={"h.0": 8, "h.1": 8}, block_input_bytes={"h.0": 2, "h.1": 2},
                       activation_peak_bytes=20, activation_dtype_bytes=2, device="meta")


def _hw(ws: int) -> HardwareProfile:
    return HardwareProfile(device_kind="cuda", device_total_bytes=2**30, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9,
                           allgather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=1e9, host_adam_numel_per_s=1e6,
                           device_flops_per_s=1e12, world_size=ws)


def test_units_are_the_blocks_and_the_root():
    root, blocks = units_of(_profile(), _hw(1), "bf16")
    assert (root.numel, [b.name for b in blocks], [b.numel for b in blocks]) == (100, ["h.0", "h.1"], [40, 40])
    assert root.fwd_s == pytest.approx(1e-6) and blocks[0].bwd_s == pytest.approx(4e-6)


@pytest.mark.parametrize("peer, ws, expected", [
    # FSDP2 + CPUOffload: fp32 shard H2D (4n/W) + bf16 all-gather (2n) per use, root once, blocks twice;
    # bf16 reduce-scatter (2n), fp32 gradient shard D2H (4n/W)
    ("fsdp2_offload", 2, {"h2d": 200 + 4 * 80, "allgather": 200 + 4 * 80, "reduce_scatter": 360, "d2h": 360}),
    ("fsdp2_offload", 1, {"h2d": 400 + 4 * 160, "allgather": 0, "reduce_scatter": 0, "d2h": 720}),
    # ZeRO-3 offload: bf16 partition H2D (2n/W) + all-gather (2n) per use, root too in backward; bf16 gradients
    ("ds_zero3_offload", 2, {"h2d": 2 * 100 + 4 * 40, "allgather": 2 * 200 + 4 * 80, "reduce_scatter": 360,
                             "d2h": 180}),
    # ZeRO-Offload: nothing fetched; bf16 gradient partition out, updated bf16 partition back, all-gathered
    ("zero_offload", 2, {"h2d": 180, "allgather": 360, "reduce_scatter": 360, "d2h": 180}),
    ("zero_offload", 1, {"h2d": 360, "allgather": 0, "reduce_scatter": 0, "d2h": 360}),
])
def test_bytes_moved_per_step_match_the_construction(peer, ws, expected):
    pred = predict_peer(peer, _profile(), _hw(ws), precision="bf16", world_size=ws)
    assert pred.bytes == expected
    assert pred.optimizer_s >= (180 // ws) / 1e6  # host AdamW over the rank's P / W elements after backward
    assert pred.step_s >= pred.compute_s > 0


def test_a_peer_that_cannot_hold_its_model_data_does_not_fit():
    assert predict_peer("zero_offload", _profile(), _hw(1), precision="bf16", device_bytes=100) is None
    with pytest.raises(ValueError, match="peer="):
        predict_peer("ddp", _profile(), _hw(1))
