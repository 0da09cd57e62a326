"""Training checkpoints of tensor/expert-parallel models ([Note: tensor/expert-parallel checkpoints] in
hf_elixir/checkpoint.py): every rank's shards on disk once, the mesh in the manifest, an exact resume (weights,
fp32 masters and Adam moments) on the same layout, another layout refused naming both (the weights alone
resharded), tied weights saved once (the keys transformers writes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_elixir
from benchmarks.checkpoint_kill import _build, _local, _model, _same, _step
from hf_elixir.optim._shard_payload import sharded_payload
from hf_elixir.parallel import gather_full_state_dict
from tests._dist import run_distributed


def _keys(path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return sorted(f.keys())


@torch.no_grad()
def _loss(model, ids) -> float:
    return model(input_ids=ids, labels=ids).loss.item()


def _equal_on(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``a`` is in ``b``, bit for bit (``b`` may hold a tied weight under both names)."""
    return a.keys() <= b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _same_optimizer(a, b) -> bool:
    """This rank's optimizer shards (Adam moments, fp32 masters under bf16/fp16) and each parameter's scalar
    states (``step``), bit for bit."""
    (tensors_a, meta_a), (tensors_b, meta_b) = sharded_payload(a), sharded_payload(b)
    return _same(tensors_a, tensors_b) and meta_a["slots"] == meta_b["slots"]


def _bf16_resume(rank, directory) -> list[bool]:
    """The uneven TP=2 Llama in bf16 (fp32 masters): saved after a step, the next step of the saved run and of a
    resumed one give the same fp32 masters and optimizer shards (masters, moments, steps), bit for bit."""
    kw = dict(tied=True, uneven=True, precision="bf16")
    model, opt = _build("tp", **kw)
    _step(model, opt, 1, rank)
    hf_elixir.save_checkpoint(directory, model, opt, step=1)
    _step(model, opt, 2, rank)
    fresh, fresh_opt = _build("tp", **kw)
    hf_elixir.load_checkpoint(directory, fresh, fresh_opt)
    _step(fresh, fresh_opt, 2, rank)
    return [_same(_local(model), _local(fresh)), _same_optimizer(opt, fresh_opt)]


def _legacy_error(rank, directory, mode, model) -> str:
    """A checkpoint as a tensor/expert-parallel run wrote it before manifests recorded the mesh (rank 0's local
    tensors as ``model.safetensors``, no ``mesh``), loaded without an optimizer into ``model``: the message."""
    legacy = Path(directory + "-legacy")
    if rank == 0:
        legacy.mkdir()
        save_file(load_file(f"{directory}/model.{mode}0.safetensors"), str(legacy / "model.safetensors"))
        manifest = json.loads((Path(directory) / "manifest.json").read_text())
        for key in ("mesh", "model_shards", "chunk_layout", "optimizer_shards", "tied"):
            del manifest[key]
        data = (legacy / "model.safetensors").read_bytes()
        manifest.update(optimizer_layout=None, files={"model.safetensors": {
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}})
        (legacy / "manifest.json").write_text(json.dumps(manifest))
    torch.distributed.barrier()
    try:
        hf_elixir.load_checkpoint(legacy, model, None)
    except ValueError as err:
        return str(err)
    return "loaded"


def _resume_worker(rank, world_size, mode, directory):
    """Save at step 2; the same run trains on to step 4; a fresh run resumes and trains to step 4; a third run never
    saves. Returns what the test checks. Under TP the Llama's vocabulary (255) and MLP width (63) are uneven over the
    two ranks ([Note: uneven tensor-parallel slices] in hf_elixir/chunk/_tp_slices.py)."""
    kw = dict(tied=mode == "tp", uneven=mode == "tp")
    model, opt = _build(mode, **kw)
    for step in (1, 2):
        _step(model, opt, step, rank)
    hf_elixir.save_checkpoint(directory, model, opt, step=2)
    expected = [(_step(model, opt, step, rank), _local(model)) for step in (3, 4)]
    fresh, fresh_opt = _build(mode, **kw)
    info = hf_elixir.load_checkpoint(directory, fresh, fresh_opt)
    resumed = [(_step(fresh, fresh_opt, step, rank), _local(fresh)) for step in (3, 4)]
    never_saved, never_saved_opt = _build(mode, **kw)
    for step in (1, 2, 3, 4):
        _step(never_saved, never_saved_opt, step, rank)
    errors = []
    dense, dense_opt = _build(mode, **kw, parallel=False)  # the same model, plain ZeRO over both ranks
    try:
        hf_elixir.load_checkpoint(directory, dense, dense_opt)
    except ValueError as err:
        errors.append(str(err))
    _step(dense, dense_opt, 1, rank)  # away from the initial weights every fresh model starts from
    hf_elixir.save_checkpoint(directory + "-dense", dense, dense_opt, step=1)
    try:  # and a dense checkpoint into the parallel model
        hf_elixir.load_checkpoint(directory + "-dense", fresh, fresh_opt)
    except ValueError as err:
        errors.append(str(err))
    # the weights alone (optimizer=None) reshard either way: the parallel checkpoint into the dense model, the dense
    # one into the parallel model; each then computes the loss of the model it was loaded from
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    resharded, _ = _build(mode, **kw, parallel=False)
    hf_elixir.load_checkpoint(directory, resharded, None)
    same, same_opt = _build(mode, **kw)
    hf_elixir.load_checkpoint(directory, same, same_opt)
    into_parallel, _ = _build(mode, **kw)
    hf_elixir.load_checkpoint(directory + "-dense", into_parallel, None)
    losses = [_loss(m, ids) for m in (resharded, same, into_parallel, dense)]
    # the full tensors rebuilt from both ranks' files are the parallel model's, and the slices cut from the dense
    # checkpoint the dense model's: both exactly (copies, cut and merged by tp_slice)
    rebuilt, full_same = _local(resharded), gather_full_state_dict(same, rank0_only=False)
    cut, dense_local = gather_full_state_dict(into_parallel, rank0_only=False), _local(dense)
    return {"step": info["step"], "legacy": _legacy_error(rank, directory, mode, same),
            "bf16_equal": _bf16_resume(rank, directory + "-bf16") if mode == "tp" else [True, True],
            "reshard_exact": [_equal_on(rebuilt, full_same), _equal_on(dense_local, cut)],
            "reshard_rel": [abs(losses[0] - losses[1]) / losses[1], abs(losses[2] - losses[3]) / losses[3]],
            "losses_equal": [e[0] for e in expected] == [r[0] for r in resumed],
            "tensors_equal": all(_same(e[1], r[1]) for e, r in zip(expected, resumed)),
            "uninterrupted_equal": _same(resumed[-1][1], _local(never_saved)),
            "optimizer_equal": [_same_optimizer(o, fresh_opt) for o in (opt, never_saved_opt)],
            "errors": errors}


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_parallel_checkpoint_resumes_exactly_and_refuses_another_layout(tmp_path, mode):
    directory = str(tmp_path / "ckpt")
    results = run_distributed(_resume_worker, 2, mode, directory, timeout_s=240)
    for result in results:
        assert result["step"] == 2
        assert result["losses_equal"] and result["tensors_equal"]  # bit for bit, both steps after the resume
        assert result["uninterrupted_equal"]  # and equal to a run that never saved
        assert result["optimizer_equal"] == [True, True]  # Adam moments and steps: the saved run's, the unsaved one's
        assert result["bf16_equal"] == [True, True]  # and under bf16: fp32 masters, moments
        assert max(result["reshard_rel"]) < 1e-5, result["reshard_rel"]  # fp32, another reduction order
        assert len(result["errors"]) == 2, result["errors"]
        saved, other = (f"{mode}=2", "tp=1 ep=1 dp=2")
        for message in result["errors"]:  # both layouts named, whichever way round
            assert saved in message and other in message, message
        assert result["reshard_exact"] == [True, True]  # rebuilt / cut by tp_slice, bit for bit
        # a checkpoint from before the mesh record: one rank's shards, refused naming the record and the fixes
        assert "no layout record" in result["legacy"] and "'mesh'" in result["legacy"], result["legacy"]
        assert "Re-save" in result["legacy"] and "save_pretrained" in result["legacy"], result["legacy"]
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    assert manifest["mesh"] == {"tp": 2 if mode == "tp" else 1, "ep": 2 if mode == "ep" else 1, "dp": 1,
                                "world_size": 2, "split_fused_experts": False}  # 'auto' keeps these experts fused
    files = {s["file"]: s for s in manifest["model_shards"]}
    assert sorted(files) == [f"model.{mode}0.safetensors", f"model.{mode}1.safetensors"]
    on_disk = {name: _keys(Path(directory) / name) for name in files}
    for name, shard in files.items():
        assert sorted(shard["tensors"]) == on_disk[name]
    every = [k for keys in on_disk.values() for k in keys]
    replicated = [k for k, v in files[f"model.{mode}0.safetensors"]["tensors"].items() if v["role"] == "replicated"]
    sharded = set(every) - set(replicated)
    assert len(set(replicated) & set(on_disk[f"model.{mode}1.safetensors"])) == 0  # replicated tensors: once
    assert all(k in on_disk[f"model.{mode}0.safetensors"] and k in on_disk[f"model.{mode}1.safetensors"]
               for k in sharded)  # each rank's own slices / experts
    if mode == "tp":
        q = files["model.tp1.safetensors"]["tensors"]["model.layers.0.self_attn.q_proj.weight"]
        assert q["role"] == "tp" and q["local_shape"] == [16, 32] and q["global_shape"] == [32, 32]
        assert "lm_head.weight" not in every  # tied to the embedding: saved once
        for name, full, first, last in (("model.embed_tokens.weight", 255, 128, 127),  # uneven: ceil-sized, then less
                                        ("model.layers.1.mlp.up_proj.weight", 63, 32, 31)):
            roles = [files[f"model.tp{r}.safetensors"]["tensors"][name] for r in (0, 1)]
            assert [r["local_shape"][0] for r in roles] == [first, last] and roles[1]["full_size"] == full
    else:
        experts = [k for k in sharded if ".mlp.experts." in k]
        assert experts and all(files["model.ep1.safetensors"]["tensors"][k]["role"] == "experts" for k in experts)


def _tied_keys_worker(rank, world_size, directory):
    import transformers as T

    model = _model("tp", tied=True)
    if rank == 0:
        model.save_pretrained(directory + "/plain")
    parallel, opt = _build("tp", tied=True)
    parallel.save_pretrained(directory + "/tp")
    hf_elixir.save_checkpoint(directory + "/ck", parallel, opt, step=0)
    torch.distributed.barrier()
    on_disk = [k for r in range(2) for k in _keys(f"{directory}/ck/model.tp{r}.safetensors")]
    return {"plain": _keys(directory + "/plain/model.safetensors"), "tp": _keys(directory + "/tp/model.safetensors"),
            "tp_loads": isinstance(T.LlamaForCausalLM.from_pretrained(directory + "/tp"), T.LlamaForCausalLM),
            "checkpoint_names": sorted(set(on_disk))}


def test_tied_weights_are_saved_once_under_tensor_parallel(tmp_path):
    """A tied Llama at TP=2: ``save_pretrained`` writes transformers' own 20 keys (it wrote lm_head.weight as a 21st)
    and the training checkpoint stores the embedding once per rank's slice, never under lm_head.weight."""
    result = run_distributed(_tied_keys_worker, 2, str(tmp_path), timeout_s=240)[0]
    assert result["tp"] == result["plain"] and "lm_head.weight" not in result["plain"]
    assert result["tp_loads"]
    assert set(result["checkpoint_names"]) == set(result["plain"])


def test_tied_weights_are_saved_once_on_one_rank(tmp_path):
    """One rank, a tied Llama: the checkpoint's model file has the keys transformers writes, the manifest records
    the (trivial) mesh, and it resumes."""
    plain = _model("tp", tied=True)
    plain.save_pretrained(tmp_path / "plain")
    model, opt = _build("tp", tied=True, parallel=False)
    _step(model, opt, 1, 0)
    hf_elixir.save_checkpoint(tmp_path / "ck", model, opt, step=1)
    assert _keys(tmp_path / "ck" / "model.safetensors") == _keys(tmp_path / "plain" / "model.safetensors")
    manifest = hf_elixir.checkpoint.read_manifest(tmp_path / "ck")
    assert manifest["mesh"] == {"tp": 1, "ep": 1, "dp": 1, "world_size": 1, "split_fused_experts": False}
    expected = _step(model, opt, 2, 0)
    fresh, fresh_opt = _build("tp", tied=True, parallel=False)
    hf_elixir.load_checkpoint(tmp_path / "ck", fresh, fresh_opt)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert _step(fresh, fresh_opt, 2, 0) == expected


def test_consolidate_merges_uneven_slices_by_the_split_rule():
    """The reshard path rebuilds a tensor from its tp slices by the rule ``parallelize`` cut them with (ceil-sized,
    the last shorter; packed ``gate|up`` parts each so), and refuses slices of other lengths by name."""
    from hf_elixir.parallel._shard_io import consolidate_shards
    from hf_elixir.parallel._tensor_parallel import _split

    full = {"vocab": (torch.randn(255, 4), 0, 1), "gate_up": (torch.randn(4, 126), 1, 2),
            "q": (torch.randn(32, 4), 0, 1)}  # (full tensor, split dim, packed parts)
    shards = []
    for rank in (1, 0):  # any order of records
        tensors = {n: {"role": "tp", "dim": d, "parts": p, "full_size": t.shape[d], "global_shape": list(t.shape)}
                   for n, (t, d, p) in full.items()}
        del tensors["q"]["full_size"]  # a record from before uneven splits: even slices, summed
        shards.append({"file": f"model.tp{rank}.safetensors", "mp_rank": rank, "tensors": tensors})
    files = {f"model.tp{r}.safetensors": {n: _split(t, d, p, r, 2) for n, (t, d, p) in full.items()} for r in (0, 1)}
    assert files["model.tp1.safetensors"]["gate_up"].shape == (4, 62)  # 31 of gate, 31 of up
    merged = consolidate_shards("'ck'", shards, files)
    assert all(torch.equal(merged[n], t) for n, (t, _, _) in full.items())
    files["model.tp0.safetensors"]["vocab"] = files["model.tp0.safetensors"]["vocab"][:127]  # evenly cut: 127 + 128
    files["model.tp1.safetensors"]["vocab"] = full["vocab"][0][127:]
    with pytest.raises(ValueError, match=r"'vocab' have lengths \[127, 128\] along dim 0, but 255 features split over "
                                         r"2 ranks are \[128, 127\]"):
        consolidate_shards("'ck'", shards, files)
