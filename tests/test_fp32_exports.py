"""Exports under bf16/fp16 carry the optimizer's fp32 masters (hf_elixir/runtime/_exports.py, [Note: fp32 exports]);
``export_dtype="compute"`` writes the compute copy; ``config.json`` names what was written; a save_pretrained ->
from_pretrained -> prepare round trip continues as a run that never saved."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hf_elixir
from tests._dist import run_distributed
from tests._models import rank_batch, tiny_model, two_groups

CHUNK = 8192
LAYOUTS = {
    # resident shards, optimizer states on the device
    "sharded": dict(chunk_size_numel=CHUNK, default_placement="sharded"),
    # whole chunks on every rank, gradients all-reduced (DDP-like buckets)
    "replicated": dict(default_placement="replicated"),
    # a model-data budget: chunks offloaded, optimizer states (and masters) on the host
    "offloaded": dict(chunk_size_numel=CHUNK, default_placement="sharded", device_memory_budget_bytes=200_000,
                      budget_covers_activations=False, offload_optimizer=True),
}
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _train(model, opt, steps, rank, world_size):
    for step in steps:
        opt.backward(model(**rank_batch("gpt2", step, rank, world_size, 2)).loss)
        opt.step()
        opt.zero_grad()


def _masters(opt) -> dict[str, torch.Tensor]:
    return {name: entry["master"] for name, entry in opt.state_dict()["state"].items()}


def _export_worker(rank, world_size, precision, layout, export_dtype):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        precision=precision, export_dtype=export_dtype, **LAYOUTS[layout]))
    _train(model, opt, range(3), rank, world_size)
    state = model.state_dict()
    masters = _masters(opt)
    compute = PRECISIONS[precision]
    if export_dtype == "fp32":
        same = {name: torch.equal(state[name], master) for name, master in masters.items()}
    else:
        same = {name: torch.equal(state[name], master.to(compute)) for name, master in masters.items()}
    # the masters hold more than their rounding: an fp32 export that was rounded would show it
    finer = sum(int((m != m.to(compute).float()).sum()) for m in masters.values())
    return {"dtypes": sorted({str(v.dtype) for v in state.values() if v.is_floating_point()}),
            "mismatched": [n for n, ok in same.items() if not ok], "num_masters": len(masters), "finer": finer,
            "tied": state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_state_dict_is_the_fp32_masters_bit_for_bit(precision, layout, world_size):
    if world_size == 1:
        results = [_export_worker(0, 1, precision, layout, "fp32")]
    else:
        results = run_distributed(_export_worker, 2, precision, layout, "fp32", timeout_s=240)
    for result in results:
        assert result["dtypes"] == ["torch.float32"]
        assert result["num_masters"] > 20 and result["mismatched"] == []
        assert result["finer"] > 1000  # a bf16/fp16 export would have lost these
        assert result["tied"]  # one tensor under both names, as PyTorch's state_dict gives


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_export_dtype_compute_writes_the_compute_copy(precision):
    result = _export_worker(0, 1, precision, "offloaded", "compute")
    assert result["dtypes"] == [str(PRECISIONS[precision])] and result["mismatched"] == []


def test_without_an_optimizer_the_compute_dtype_is_written(tmp_path):
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, hf_elixir.ElixirConfig(precision="bf16"))
    reference = tiny_model("gpt2")
    state = model.state_dict()
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}
    assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in reference.state_dict().items()
               if v.is_floating_point())
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def _round_trip_worker(rank, world_size, folder):
    """Steps 0-2 with a save after step 1; then from_pretrained + prepare + step 2 again."""
    config = hf_elixir.ElixirConfig(precision="bf16", **LAYOUTS["offloaded"])
    model = tiny_model("gpt2")
    # SGD without momentum keeps no optimizer state: what the folder holds is all a continuation needs
    model, opt = hf_elixir.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), config)
    _train(model, opt, range(2), rank, world_size)
    model.save_pretrained(folder)
    if world_size > 1:
        torch.distributed.barrier()  # save_pretrained writes on rank 0 and does not wait
    written = json.loads((folder / "config.json").read_text())["dtype"]
    _train(model, opt, [2], rank, world_size)
    expected = _masters(opt)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    loaded_dtype = str(loaded.dtype)
    loaded, lopt = hf_elixir.prepare(loaded, torch.optim.SGD(loaded.parameters(), lr=0.05), config)
    _train(loaded, lopt, [2], rank, world_size)
    got = _masters(lopt)
    file_dtypes = sorted({str(v.dtype) for v in load_file(folder / "model.safetensors").values()})
    return {"written": written, "loaded_dtype": loaded_dtype, "file_dtypes": file_dtypes,
            "mismatched": [n for n in expected if not torch.equal(expected[n], got[n])]}


@pytest.mark.parametrize("world_size", [1, 2])
def test_save_pretrained_round_trip_continues_as_if_never_saved(tmp_path, world_size):
    if world_size == 1:
        results = [_round_trip_worker(0, 1, tmp_path)]
    else:
        results = run_distributed(_round_trip_worker, 2, tmp_path, timeout_s=240)
    for result in results:
        assert result["written"] == "float32" and result["file_dtypes"] == ["torch.float32"]
        assert result["loaded_dtype"] == "torch.float32"
        assert result["mismatched"] == []


def test_load_state_dict_keeps_fp32_values_as_the_masters():
    """model.load_state_dict of an fp32 state dict: the masters take the fp32 values, not their bf16 rounding."""
    source = tiny_model("gpt2", seed=5)
    target = tiny_model("gpt2")
    model, opt = hf_elixir.prepare(target, torch.optim.AdamW(target.parameters(), lr=1e-3),
                                   hf_elixir.ElixirConfig(precision="bf16", **LAYOUTS["offloaded"]))
    model.load_state_dict(source.state_dict())
    masters = _masters(opt)
    expected = source.state_dict()
    assert all(torch.equal(masters[n], expected[n]) for n in masters)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items() if v.is_floating_point())


def test_accelerate_get_state_dict_unwrap_save_and_trainer_save_model_write_fp32(tmp_path):
    from accelerate import Accelerator


    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_model("gpt2")
    model, opt = hf_elixir.ElixirPlugin(config=hf_elixir.ElixirConfig(**LAYOUTS["sharded"])).prepare(
        accelerator, model, torch.optim.AdamW(model.parameters(), lr=5e-3))
    for step in range(2):
        accelerator.backward(model(**rank_batch("gpt2", step, 0, 1, 2)).loss)
        opt.step()
        opt.zero_grad()
    masters = _masters(opt.optimizer)
    state = accelerator.get_state_dict(model)
    assert all(torch.equal(state[n], m) for n, m in masters.items())
    accelerator.unwrap_model(model).save_pretrained(tmp_path / "unwrapped")
    written = load_file(tmp_path / "unwrapped" / "model.safetensors")
    assert all(torch.equal(written[n], m) for n, m in masters.items() if n in written)
    assert json.loads((tmp_path / "unwrapped" / "config.json").read_text())["dtype"] == "float32"

    rows = [rank_batch("gpt2", s, 0, 1, 1) for s in range(4)]
    data = [{k: v[0] for k, v in row.items()} for row in rows]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=2, bf16=True,
                                          use_cpu=True, per_device_train_batch_size=2, report_to=[],
                                          save_strategy="no", logging_steps=1, learning_rate=5e-3)
    callback = hf_elixir.ElixirCallback(config=hf_elixir.ElixirConfig(**LAYOUTS["sharded"]))
    trainer = transformers.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    trainer.save_model(str(tmp_path / "trainer"))
    elixir_opt = trainer.optimizer.optimizer
    assert elixir_opt.config.precision == "bf16"
    trained = _masters(elixir_opt)
    saved = load_file(tmp_path / "trainer" / "model.safetensors")
    assert all(torch.equal(saved[n], m) for n, m in trained.items() if n in saved)
    assert json.loads((tmp_path / "trainer" / "config.json").read_text())["dtype"] == "float32"



def _parallel_worker(rank, world_size, kind, tp, ep, folder):
    """A tensor/expert-parallel model under bf16: this rank's state_dict is its local fp32 masters, the
    gathered (unmodified model's) state dict and folder are fp32."""
    from hf_elixir.parallel import build_mesh, gather_full_state_dict, local_state_dict, parallelize
    from tests.parallel_harness import make_batch, make_model

    model = make_model(kind)
    cfg = hf_elixir.ElixirConfig(tensor_parallel_size=tp, expert_parallel_size=ep)
    mesh = build_mesh(cfg)
    parallelize(model, cfg, mesh)
    index = mesh.device_mesh.get_local_rank("dp") if mesh.mp_axis == "tp" else rank
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        precision="bf16", tensor_parallel_size=tp, expert_parallel_size=ep, chunk_size_numel=CHUNK))
    for step in range(2):
        opt.backward(model(**make_batch(kind, step, index)).loss)
        opt.step()
        opt.zero_grad()
    local = local_state_dict(model)  # this rank's parts, as the optimizer's masters
    masters = _masters(opt)
    full = gather_full_state_dict(model, rank0_only=False)
    model.save_pretrained(folder)
    torch.distributed.barrier()
    return {"mismatched": [n for n, m in masters.items() if not torch.equal(local[n], m)],
            "num_masters": len(masters),
            "full_dtypes": sorted({str(v.dtype) for v in full.values() if v.is_floating_point()}),
            "written": json.loads((folder / "config.json").read_text())["dtype"]}


# (expert parallel is Switch-Transformers only today, whose router casts its classifier to fp32 in forward, which a
# bf16-prepared model refuses: Switch trains in fp32, where the parameters are the masters)
@pytest.mark.parametrize("kind,tp,ep", [("gpt2", 2, 1)])
def test_tensor_parallel_exports_are_fp32_masters(tmp_path, kind, tp, ep):
    for result in run_distributed(_parallel_worker, 2, kind, tp, ep, tmp_path, timeout_s=240):
        assert result["num_masters"] > 10 and result["mismatched"] == []
        assert result["full_dtypes"] == ["torch.float32"] and result["written"] == "float32"
