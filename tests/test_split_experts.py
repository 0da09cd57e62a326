"""Fused MoE experts split into one hook unit per expert (``ElixirConfig.split_fused_experts``, [Note: split fused
experts] in ``hf_elixir/parallel/_expert_units.py``): parity with plain PyTorch under ZeRO alone (1 rank, a budget
that forces evictions, strict device mode from conftest, AdamW with weight decay + clipping, an expert that never
gets a token), the unmodified model's names and shapes in ``state_dict`` / ``save_pretrained`` / ``full_gradients``,
the device floor of one expert instead of E, and the all-or-nothing rollback."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch

import hf_elixir
from hf_elixir.placement._experts import SPLIT_ATTR
from tests._moe_ep_cases import LR, MAX_NORM, WEIGHT_DECAY, _adamw, _batch, _silence_experts, rel
from tests._moe_models import make_moe_model

STEPS = 5
TOL = 2e-5


def _config(**kw) -> hf_elixir.ElixirConfig:
    return hf_elixir.ElixirConfig(budget_covers_activations=False, default_placement="sharded", **kw)


def _tight(model, opt, cfg) -> hf_elixir.ElixirConfig:
    """5% above the smallest budget prepare accepts (chunks get evicted and offloaded)."""
    need = hf_elixir.min_device_budget_bytes(model, opt, cfg)
    return dataclasses.replace(cfg, device_memory_budget_bytes=int(need * 1.05) + 1024)


def _train(family: str, idle: bool = False):
    """STEPS steps of the split, prepared model and of plain PyTorch on the unmodified one."""
    model = make_moe_model(family)
    if idle:
        _silence_experts(model, (2, 3))
    ref = copy.deepcopy(model)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    opt, opt_ref = _adamw(model), _adamw(ref)
    cfg = _tight(model, opt, _config())
    model, opt = hf_elixir.prepare(model, opt, cfg)
    loss_rel = norm_rel = 0.0
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(**_batch(step, 0)).loss
        opt.backward(loss)
        norm = opt.clip_grad_norm(MAX_NORM)
        opt.step()
        opt_ref.zero_grad()
        ref_loss = ref(**_batch(step, 0)).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt_ref.step()
        loss_rel = max(loss_rel, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        norm_rel = max(norm_rel, abs(float(norm) - float(ref_norm)) / float(ref_norm))
    return model, opt, ref, init, loss_rel, norm_rel


@pytest.mark.parametrize("family,idle", [("mixtral", False), ("gpt_oss", True)])
def test_split_experts_match_plain_pytorch(family, idle):
    model, opt, ref, init, loss_rel, norm_rel = _train(family, idle)
    experts = model.model.layers[0].mlp.experts
    assert getattr(experts, SPLIT_ATTR).num_pieces == 4 and experts.get_submodule("3").num_experts == 1
    assert loss_rel < TOL and norm_rel < TOL, (loss_rel, norm_rel)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)  # the fused names, in the unmodified model's order
    assert all(sd[k].shape == ref_sd[k].shape for k in sd)
    worst = max((rel(sd[k], ref_sd[k]), k) for k in ref_sd if ref_sd[k].norm() > 0)
    assert worst[0] < TOL, worst
    assert hf_elixir.memory_stats(model)["num_evictions"] > 0  # the budget forced chunks off the device
    if idle:  # never-routed experts 2, 3: a zero gradient, so AdamW only decays their slices, as in PyTorch
        decay = (1 - LR * WEIGHT_DECAY) ** STEPS
        for k in ref_sd:
            if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
                assert rel(sd[k][2:], init[k][2:] * decay) < 1e-6, k
                assert rel(sd[k][2:], init[k][2:]) > 1e-4, k


def test_split_experts_save_pretrained_and_full_gradients(tmp_path):
    """``save_pretrained`` of the split model (transformers' own reverse conversion sees the fused names) reloads
    equal with plain ``from_pretrained``; ``full_gradients`` gives the fused names and shapes, equal to PyTorch's."""
    import transformers

    model = make_moe_model("mixtral")
    ref = copy.deepcopy(model)
    opt = _adamw(model)
    fused = weakref.ref(model.model.layers[0].mlp.experts.gate_up_proj)
    model, opt = hf_elixir.prepare(model, opt, _config(chunk_size_numel=4096, split_fused_experts=True))
    gc.collect()
    assert fused() is None  # the fused tensor (and its storage) is gone: the pieces live in their chunks
    assert any(".experts.3.gate_up_proj" in n for n, _ in model.named_parameters())
    batch = _batch(0, 0)
    opt.zero_grad()
    opt.backward(model(**batch).loss)
    ref(**batch).loss.backward()
    with hf_elixir.full_gradients(model) as grads:
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert list(grads) == list(ref_grads)
        for name, grad in grads.items():
            assert grad.shape == ref_grads[name].shape and rel(grad, ref_grads[name]) < 1e-5, name
    piece = model.model.layers[0].mlp.experts.get_submodule("1").down_proj
    assert rel(hf_elixir.get_full_grad(piece, model), ref.model.layers[0].mlp.experts.down_proj.grad[1:2]) < 1e-5
    opt.step()
    sd = model.state_dict()
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    reloaded_sd = reloaded.state_dict()
    assert list(reloaded_sd) == list(sd)
    for key, value in sd.items():
        assert torch.equal(reloaded_sd[key], value), key
    # load_state_dict takes the fused names back (split by the load pre-hook) into the chunks
    model.load_state_dict(ref.state_dict())
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_split_experts_save_checkpoint_resumes(tmp_path):
    """``hf_elixir.save_checkpoint`` of a split model (weights under the fused names, optimizer state per piece)
    loads back into a fresh split model with ``load_checkpoint``, and the next step is the same; into a model with
    the experts kept fused (``"auto"`` at another budget) it refuses, naming ``split_fused_experts`` and the fix."""
    def build(split=True):
        model = make_moe_model("mixtral")
        return hf_elixir.prepare(model, _adamw(model), _config(chunk_size_numel=8192, split_fused_experts=split))

    model, opt = build()
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(**_batch(step, 0)).loss)
        opt.step()
    hf_elixir.save_checkpoint(tmp_path / "ck", model, opt, step=2)
    opt.zero_grad()
    opt.backward(model(**_batch(2, 0)).loss)
    opt.step()
    expected = model.state_dict()
    fresh, fresh_opt = build()
    assert hf_elixir.load_checkpoint(tmp_path / "ck", fresh, fresh_opt)["step"] == 2
    fresh_opt.zero_grad()
    fresh_opt.backward(fresh(**_batch(2, 0)).loss)
    fresh_opt.step()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    fused, fused_opt = build(split=False)
    with pytest.raises(ValueError, match=r"split per expert and this model has them fused .*split_fused_experts=True"):
        hf_elixir.load_checkpoint(tmp_path / "ck", fused, fused_opt)


def test_split_experts_floor_is_one_expert():
    """The device floor of a tiny Mixtral with split experts: at most the unsplit floor less the E - 1 other experts'
    parameter bytes of one layer (a unit then holds one expert's chunk, not E)."""
    model = make_moe_model("mixtral")
    opt = _adamw(model)
    fused = hf_elixir.min_device_budget_bytes(model, opt, _config(split_fused_experts=False))  # default chunk size
    split = hf_elixir.min_device_budget_bytes(model, opt, _config())
    experts = model.model.layers[0].mlp.experts
    num_experts = experts.num_experts
    layer_bytes = 4 * sum(p.numel() for p in experts.parameters())  # fp32 parameters of one layer's experts
    assert split <= fused - (num_experts - 1) * layer_bytes // num_experts, (split, fused, layer_bytes)
    assert SPLIT_ATTR not in vars(experts) and experts.gate_up_proj.shape[0] == num_experts  # put back


def test_split_experts_undone_when_prepare_fails():
    """prepare is all or nothing: a budget below the floor raises, and the model has its fused parameters (the
    same objects) and the optimizer its groups again; a second prepare then works."""
    model = make_moe_model("qwen3_moe")
    experts = model.model.layers[1].mlp.experts
    fused = experts.gate_up_proj
    opt = _adamw(model)
    groups = [list(g["params"]) for g in opt.param_groups]
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="bytes"):
        hf_elixir.prepare(model, opt, _config(device_memory_budget_bytes=1024))
    assert experts.gate_up_proj is fused and SPLIT_ATTR not in vars(experts) and "forward" not in vars(experts)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(a == b for a, b in zip([list(g["params"]) for g in opt.param_groups], groups))
    hf_elixir.prepare(model, opt, _config(split_fused_experts=True))
    assert len(opt.param_groups[0]["params"]) > len(groups[0])  # each fused tensor: its 4 pieces


@pytest.mark.parametrize("budget", ["none", "between", "fused_floor"])
def test_split_auto_splits_only_where_the_budget_needs_it(budget):
    """``split_fused_experts="auto"`` (the default) keeps the fused tensors (one call per layer's experts) without a
    budget or at a budget the fused layout fits, and splits at one between the split and the fused floors."""
    model = make_moe_model("mixtral")
    opt = _adamw(model)
    fused = hf_elixir.min_device_budget_bytes(model, opt, _config(split_fused_experts=False))
    split = hf_elixir.min_device_budget_bytes(model, opt, _config())  # "auto": the smallest budget prepare takes
    assert split < fused
    given = {"none": None, "between": (split + fused) // 2, "fused_floor": fused}[budget]
    model, opt = hf_elixir.prepare(model, opt, _config(device_memory_budget_bytes=given))
    is_split = any(".experts.3.gate_up_proj" in n for n, _ in model.named_parameters())
    assert is_split == (budget == "between")
    assert hf_elixir.get_state(model).config.split_fused_experts is (budget == "between")
    opt.backward(model(**_batch(0, 0)).loss)
    opt.step()


def test_plan_command_plans_the_split_model(tmp_path, monkeypatch, capsys):
    """``hf-elixir plan --split-fused-experts`` lays out the split model: its plan (parameter order of the pieces,
    placements naming the experts module once) is accepted by ``prepare`` with the default config, which splits as
    the plan was made; ``--no-split-fused-experts`` plans the fused tensors, which ``"auto"`` then keeps; without
    either flag the plan splits only when ``--gpu-memory`` is below the fused model's floor."""
    import json

    from hf_elixir.cli import main
    from hf_elixir.plan import ElixirPlan
    from tests._models import fixed_cpu_hardware

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("hf_elixir.profiler.probe_hardware", lambda *a, **k: fixed_cpu_hardware())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 64}))
    argv = ["plan", "--model", str(config), "--gpu", "h100", "--num-gpus", "1", "--gpu-memory", "8MiB",
            "--host-memory", "1GiB", "--batch-size", "1", "--seq-len", "16", "--precision", "fp32", "--output"]
    for split in (True, False):
        path = tmp_path / f"plan_{split}.json"
        assert main(argv + [str(path)] + (["--split-fused-experts"] if split else ["--no-split-fused-experts"])) == 0
        plan = ElixirPlan.load(path)
        assert any(".experts.3.gate_up_proj" in n for n in plan.param_order) == split
        assert plan.placements["model.layers.0.mlp.experts"] == "sharded"
        model = make_moe_model("mixtral")
        model, opt = hf_elixir.prepare(model, _adamw(model), hf_elixir.ElixirConfig(plan=plan))  # "auto" follows it
        assert any(".experts.3.gate_up_proj" in n for n, _ in model.named_parameters()) == split
        opt.backward(model(**_batch(0, 0)).loss)
        opt.step()
    # no flag: as prepare's "auto", split only when the GPU memory is below the fused floor (fp32, offloaded optimizer)
    model = make_moe_model("mixtral")
    fused = hf_elixir.min_device_budget_bytes(model, torch.optim.SGD(model.parameters(), lr=0.0), hf_elixir.ElixirConfig(
        budget_covers_activations=False, offload_optimizer=True, split_fused_experts=False))
    for memory, split in ((fused - 1, True), (fused, False)):
        path = tmp_path / f"plan_auto_{memory}.json"
        auto_argv = [a if a != "8MiB" else str(memory) for a in argv] + [str(path)]
        capsys.readouterr()
        assert main(auto_argv) == 0
        assert any(".experts.3.gate_up_proj" in n for n in ElixirPlan.load(path).param_order) == split, memory
        report = " ".join(capsys.readouterr().out.split())  # the report says which layout it planned
        assert ("experts split per expert" in report, "experts kept fused" in report) == (split, not split), report


def test_split_experts_two_ranks_zero_match_plain_pytorch():
    """2 gloo ranks, ZeRO alone (chunks sharded over both), split experts, each rank on its own batch, a budget 5%
    above the floor: parity with plain PyTorch on the mean loss of both batches; gpt-oss with two experts that never
    get a token (their slices only decay, on both ranks' shards)."""
    from tests._dist import run_distributed
    from tests._moe_ep_cases import run_cases

    cases = [("mixtral", {"family": "mixtral", "budget": "tight", "ep": 1}),
             ("gpt_oss_idle", {"family": "gpt_oss", "budget": "tight", "ep": 1, "idle": True})]
    for per_rank in run_distributed(run_cases, 2, cases, timeout_s=300):
        for name, m in per_rank.items():
            assert m["loss_rel"] < TOL and m["norm_rel"] < TOL and m["param_rel"] < TOL, (name, m)
            assert m["param_rel_worst_tensor"] < (1e-4 if "idle" in name else TOL), (name, m)  # see test_moe_expert_parallel
            assert m["same_keys"] and m["split_pieces"] == [4] and m["num_evictions"] > 0, (name, m)
            if "idle" in name:
                assert m["idle_decay_rel"] < 1e-6 and m["idle_moved"] > 1e-4, (name, m)


@pytest.mark.parametrize("split", [False, True])
def test_trainer_resume_restores_moe_experts(tmp_path, split):
    """``save_model`` writes Mixtral's experts per expert (``block_sparse_moe.experts.{e}.w1``); the Trainer's own
    ``resume_from_checkpoint`` loaded the file with plain ``load_state_dict`` and left the gate and the experts at
    their fresh values. Through ElixirCallback the resumed run ends with the uninterrupted run's weights."""
    from transformers import Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(2, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def run(resume=None):
        model = make_moe_model("mixtral")
        args = TrainingArguments(str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-3, use_cpu=True, report_to=[], seed=0)
        trainer = Trainer(model, args, train_dataset=Data(),
                          callbacks=[hf_elixir.ElixirCallback(_config(split_fused_experts=split))])
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    expected = run()
    resumed = run(str(tmp_path / "checkpoint-2"))
    for key, value in expected.items():
        assert torch.equal(resumed[key], value), key
