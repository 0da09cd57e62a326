"""``search="auto"`` without an optimizer searches for inference: the profiled step is one forward under
``torch.no_grad()`` (no labels needed), the cost model prices it as the runtime of a model prepared without an
optimizer runs it (no backward, gradient buffers, reduces, optimizer states or refresh; least-recently-used
eviction in the first forward, Belady over the previous forward and prefetch in the later ones, the cache carried
from one forward to the next: [Note: forward-only pricing] in ``hf_elixir/search/_cost.py``), and the plan it
picks runs in the budget, keeps at least as much resident as a training plan at the same budget, and predicts
the steady forward's onloads, H2D bytes and peak exactly. Times are fixed (``tests/_models.fixed_times`` /
``fixed_cpu_hardware``) so that the plan does not depend on this machine's load."""

import dataclasses
import logging

import pytest
import torch

import hf_elixir
from hf_elixir import ElixirConfig
from hf_elixir.cli import main
from hf_elixir.plan import ElixirPlan
from hf_elixir.profiler import profile_step
from hf_elixir.profiler._step import static_profile
from hf_elixir.runtime._state import is_prepared
from hf_elixir.search import search
from hf_elixir.search._cost import Knobs, activation_bytes, build_chunked_step, predict

from _models import batch, fixed_cpu_hardware, fixed_times, priced_plan, tiny_model
from test_search_runtime import _fixed_auto_plan_inputs


@pytest.fixture(scope="module")
def hardware():
    return fixed_cpu_hardware()


def _inputs(kind: str, step: int = 0) -> dict:
    """A batch without labels: what evaluation or generation feeds the model."""
    return {"input_ids": batch(kind, step, 4, 16)["input_ids"]}


def _forward_profile(kind: str):
    return fixed_times(profile_step(tiny_model(kind), _inputs(kind), forward_only=True))


def _forward_stats(model, kind: str, forwards: int = 3) -> list[dict]:
    """``memory_stats`` of each of ``forwards`` forwards under ``torch.no_grad()`` (counters reset before each;
    without an optimizer there is no step, so the counters since the reset are the forward's)."""
    out = []
    model.eval()
    for step in range(forwards):
        hf_elixir.reset_memory_stats(model)
        with torch.no_grad():
            model(**_inputs(kind, step))
        out.append(hf_elixir.memory_stats(model))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
def test_forward_only_profile_is_one_forward_without_labels(kind):
    model = tiny_model(kind)
    model.train()
    train = profile_step(model, batch(kind, 0, 4, 16))
    infer = profile_step(model, _inputs(kind), forward_only=True)
    assert model.training  # restored
    assert infer.forward_only and not train.forward_only
    assert {e.phase for e in infer.events} == {"fwd"}
    assert [e.module for e in infer.events] == [e.module for e in train.events if e.phase == "fwd"]
    assert infer.param_names == train.param_names
    assert not any(infer.param_requires_grad) and set(infer.grad_ready_event) == {-1}
    assert all(v == 0 for v in infer.block_activation_bytes.values()) and infer.block_activation_bytes
    # nothing saved for backward: the activation peak is the forward's transient (the logits, 4 x 16 x 128 fp32)
    assert infer.activation_peak_bytes == 4 * 16 * 128 * 4 < train.activation_peak_bytes
    assert infer.model_data_bytes("fp32")["grads"] == infer.model_data_bytes("fp32")["optimizer"] == 0
    with pytest.raises(ValueError, match="could not find a loss"):  # a training profile still needs one
        profile_step(tiny_model(kind), _inputs(kind))
    static = static_profile(model, _inputs(kind), forward_only=True)  # what a model that cannot run on meta gets
    assert static.forward_only and {e.phase for e in static.events} == {"fwd"} and static.backward_flops == 0
    assert not any(static.param_requires_grad) and set(static.grad_ready_event) == {-1}


def test_forward_only_step_prices_no_training_work(hardware):
    """The same knobs priced for a forward-only step and for training: no backward events, gradient buffers,
    reduces, optimizer states (asked on the device or not), refresh or optimizer time in the first."""
    infer = build_chunked_step(_forward_profile("gpt2"), 4096, world_size=1, precision="bf16", hardware=hardware)
    train = build_chunked_step(fixed_times(profile_step(tiny_model("gpt2"), batch("gpt2", 0, 4, 16))), 4096,
                               world_size=1, precision="bf16", hardware=hardware)
    assert infer.forward_only and set(infer.event_phase) == {"fwd"} and "bwd" in train.event_phase
    assert infer.chunk_numels == train.chunk_numels
    assert not any(infer.trained_numels) and not infer.grad_arrive and infer.grad_peak_bytes == 0
    knobs = Knobs(resident=frozenset({0, 1}), device_shard=frozenset({0, 1}), device_optim=frozenset({0}))
    pool = 4 * sum(infer.full_bytes(c) for c in range(infer.num_chunks))  # roomy: training fits too
    i, t = (predict(s, knobs, hardware, pool_bytes=pool) for s in (infer, train))
    assert t.optimizer_s > 0 and t.breakdown["grad_buffers"] > 0 and t.breakdown["device_optimizer"] > 0
    assert i.optimizer_s == 0 and i.reduce_scatter_bytes == i.d2h_bytes == 0
    assert i.breakdown["grad_buffers"] == i.breakdown["device_optimizer"] == i.breakdown["refresh_staging"] == 0
    # host: the compute-dtype shards of the chunks not held, nothing else (no masters, moments, gradients)
    assert i.host_bytes == sum(infer.full_bytes(c) for c in range(2, infer.num_chunks)) < t.host_bytes
    assert i.step_s == i.forward_backward_s < t.forward_backward_s


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
def test_search_auto_inference_needs_no_labels_and_keeps_more_resident_than_training(kind, monkeypatch):
    """At a budget (covering activations, the default) where the training plan offloads, the inference plan
    keeps strictly more of the model resident (here all of it), runs forwards within the budget and gives the
    plain model's logits."""
    _fixed_auto_plan_inputs(monkeypatch.setattr)
    sample = batch(kind, 0, 4, 16)
    profile = fixed_times(profile_step(tiny_model(kind), sample))
    room = activation_bytes(profile, "fp32", True) + max(profile.param_numels) * 4  # a checkpointed training step
    budget = int((profile.num_params * 4 * 0.9 + room) / 0.95)
    resident = {}
    for optimizer in ("adamw", None):
        model = tiny_model(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
        model, opt = hf_elixir.prepare(model, opt, ElixirConfig(search="auto", device_memory_budget_bytes=budget),
                                       sample_batch=sample if optimizer else _inputs(kind))
        chunks = hf_elixir.get_state(model).manager.chunks
        resident[optimizer] = sum(c.chunk_numel for c in chunks if c.resident) / sum(c.chunk_numel for c in chunks)
    plan = hf_elixir.get_state(model).plan  # the inference one
    assert resident["adamw"] < 1.0, "the premise: training must offload at this budget"
    assert resident[None] > resident["adamw"] and resident[None] == 1.0
    assert plan.device_optim_chunks == [] and plan.prefetch_depth == 0
    assert set(plan.activation_policy.values()) == {"keep"} and not plan.activation_checkpointing
    assert plan.activation_peak_bytes == 4 * 16 * 128 * 4  # the logits: no gradient temporary, nothing saved
    assert any("inference (no optimizer)" in r for r in plan.reasons), plan.reasons
    reference = tiny_model(kind).eval()
    with torch.no_grad():
        expected = reference(**_inputs(kind, 2)).logits
    stats = _forward_stats(model, kind)
    for s in stats:
        assert s["device_peak_bytes"] <= budget and s["device_total_peak_bytes"] <= budget
    assert stats[-1]["num_onloads"] == 0
    with torch.no_grad():
        torch.testing.assert_close(model(**_inputs(kind, 2)).logits, expected)


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
@pytest.mark.parametrize("fraction", [0.75, 0.9, 1.1])
def test_inference_plan_predicts_the_steady_forward_exactly(kind, fraction, hardware):
    """Budgets where the inference plan must offload too (model-data budgets, as tests/test_search_runtime.py
    checks training): the searched plan's onloads, H2D bytes and model-data peak equal what the runtime counts
    in a steady forward (the second and later: the first starts from an empty cache and may onload more), and
    its predicted time is the forward's compute plus exactly those onloads priced (no optimizer, no backward).
    The training plan at the same budget keeps fewer chunks resident."""
    profile = _forward_profile(kind)
    budget = int(profile.num_params * 4 * fraction)
    result = search(profile, hardware, precision="fp32", device_memory_budget_bytes=budget)
    plan, pred = result.plan, result.best.prediction
    train = search(fixed_times(profile_step(tiny_model(kind), batch(kind, 0, 4, 16))), hardware, precision="fp32",
                   device_memory_budget_bytes=budget).plan
    # at least as many: Belady over the previous forward ([Note: forward steps]) may cache as well as residency does
    assert len(plan.resident_chunks) >= len(train.resident_chunks)
    assert pred.onloads > 0 and plan.prefetch_depth == 0 and plan.device_optim_chunks == []
    model = tiny_model(kind)
    model, _ = hf_elixir.prepare(model, None, ElixirConfig(plan=plan, device_memory_budget_bytes=budget,
                                                           budget_covers_activations=False))
    first, second, third = _forward_stats(model, kind)
    steady = [(s["num_onloads"], s["h2d_bytes"], s["device_peak_bytes"]) for s in (second, third)]
    assert steady == [(pred.onloads, pred.h2d_bytes, pred.device_peak_bytes)] * 2
    assert first["num_onloads"] >= pred.onloads and third["device_peak_bytes"] <= budget
    step = build_chunked_step(profile, plan.chunk_size_numel, world_size=1, precision="fp32", hardware=hardware)
    priced = (sum(step.event_compute_s) + len(step.groups) * hardware.hook_event_s
              + pred.onloads * hardware.onload_fixed_s + pred.h2d_bytes / hardware.h2d_bytes_per_s)
    assert pred.optimizer_s == 0 and pred.step_s == pytest.approx(priced, rel=1e-12)


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
def test_forward_step_eviction_is_priced_for_any_resident_set(kind, hardware):
    """Resident sets the search may or may not pick (tied embedding resident or not): without an optimizer the
    manager evicts the least recently used chunk in the first forward and by Belady over the previous forward in
    the later ones, and keeps its cache from one forward to the next; the cost model replays exactly that (Belady
    over the forward alone, from an empty cache, would miss the chunks left cached by the previous forward)."""
    profile = _forward_profile(kind)
    budget = int(profile.num_params * 4 * 0.9)
    step = build_chunked_step(profile, 4096, world_size=1, precision="fp32", hardware=hardware)
    for resident in ([], [0], [1, 3], [2, 5]):
        knobs = Knobs(resident=frozenset(resident), device_shard=frozenset(resident))
        pred = predict(step, knobs, hardware, pool_bytes=budget)
        assert pred is not None, resident
        plan = priced_plan(profile, resident, pred)
        model = tiny_model(kind)
        model, _ = hf_elixir.prepare(model, None, ElixirConfig(plan=plan, device_memory_budget_bytes=budget,
                                                               budget_covers_activations=False))
        third = _forward_stats(model, kind)[-1]
        assert (third["num_onloads"], third["h2d_bytes"], third["device_peak_bytes"]) == (
            pred.onloads, pred.h2d_bytes, pred.device_peak_bytes), resident


def test_search_auto_inference_errors_name_the_batch(monkeypatch):
    _fixed_auto_plan_inputs(monkeypatch.setattr)
    config = ElixirConfig(search="auto", device_memory_budget_bytes=2**20)
    with pytest.raises(ValueError, match=r"without an optimizer \(inference\) profiles one forward"):
        hf_elixir.prepare(tiny_model("gpt2"), None, config)
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="input_ids"):  # the model's own error for a batch it cannot run
        hf_elixir.prepare(model, None, config, sample_batch={})
    assert not is_prepared(model) and model.training  # nothing changed: preparing again works
    hf_elixir.prepare(model, None, config, sample_batch=_inputs("gpt2"))


def test_search_auto_encoder_decoder_batch_without_decoder_inputs_names_the_keys_to_add(monkeypatch):
    """Switch-Transformers with sample_batch={"input_ids": ...} (the README's inference form) raised the model's
    own "You must specify exactly one of input_ids or inputs_embeds" from inside the profiler; now a ValueError
    names the missing decoder inputs and the fix, nothing is prepared, and the fixed batch searches and
    generates as the plain model does."""
    _fixed_auto_plan_inputs(monkeypatch.setattr)
    config = ElixirConfig(search="auto", device_memory_budget_bytes=2**22)
    model = tiny_model("switch")
    ids = _inputs("switch")["input_ids"]
    with pytest.raises(ValueError, match=r"SwitchTransformersForConditionalGeneration, an encoder-decoder model, has "
                                         r"no decoder_input_ids.*torch.full\(\(batch_size, 1\), 0\)"):
        hf_elixir.prepare(model, None, config, sample_batch={"input_ids": ids})
    with pytest.raises(ValueError, match="encoder-decoder model.*add labels"):
        hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()), config, sample_batch={"input_ids": ids})
    assert not is_prepared(model) and model.training
    start = torch.full((ids.shape[0], 1), model.config.decoder_start_token_id)
    model, _ = hf_elixir.prepare(model, None, config, sample_batch={"input_ids": ids, "decoder_input_ids": start})
    reference = tiny_model("switch").eval()
    model.eval()
    with torch.no_grad():
        out = model.generate(ids[:2], max_new_tokens=5, do_sample=False, output_router_logits=False)
        expected = reference.generate(ids[:2], max_new_tokens=5, do_sample=False, output_router_logits=False)
    assert torch.equal(out, expected)


def test_forward_only_search_ignores_training_knobs_and_says_so(hardware, caplog):
    profile = _forward_profile("gpt2")
    with caplog.at_level(logging.WARNING, logger="hf_elixir.search._plan_search"):
        result = search(profile, hardware, device_memory_budget_bytes=int(profile.num_params * 4 * 1.2),
                        activations_on_device=True, activation_checkpointing=True, prefetch_depths=(0, 1, 2))
    assert "activation_checkpointing=True" in caplog.text
    assert "prefetch_depths" not in caplog.text  # searched: the runtime prefetches by the previous forward
    plan = result.plan
    assert set(plan.activation_policy.values()) == {"keep"}
    assert {c.knobs.prefetch_depth for c in result.alternatives} <= {0, 1, 2}


def test_plan_command_optimizer_none_searches_for_inference(tmp_path, capsys, monkeypatch):
    """``hf-elixir plan --optimizer none``: a forward-only plan, which fits a budget no training plan fits."""
    import json

    monkeypatch.setenv("HF_ELIXIR_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256,
                               "n_positions": 64}))
    shape = ["plan", "--model", str(cfg), "--gpu-memory", "512KiB", "--seq-len", "16", "--precision", "fp32"]
    assert main([*shape, "--optimizer", "adamw"]) == 2
    assert "no configuration fits device_memory_budget_bytes=524288" in capsys.readouterr().err
    out = tmp_path / "plan.yaml"
    assert main([*shape, "--optimizer", "none", "--output", str(out)]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    plan = ElixirPlan.load(out)
    assert any("inference (no optimizer)" in r for r in plan.reasons), plan.reasons
    assert plan.device_optim_chunks == [] and plan.resident_chunks
    assert plan.predicted_peak_device_bytes <= 512 * 1024
    assert "device memory per GPU at the step's peak" in text


PREFETCH_FRACTIONS = (0.75, 0.9, 1.05, 1.2)


def _two_rank_worker(rank: int, world_size: int):
    """Per rank: a sharded inference plan searched at 0.9 x the parameter bytes (model data; the search's own
    prediction kept), the same searched with prefetch depth 2 at ``PREFETCH_FRACTIONS`` and run without host
    copies (re-priced so), and ``search="auto"`` at 1.4 x, where a replicated copy fits; three forwards of each."""
    _fixed_auto_plan_inputs(setattr)
    hw = fixed_cpu_hardware(world_size=world_size)

    def inputs(step):
        return {"input_ids": _inputs("gpt2", step)["input_ids"][rank * 2:(rank + 1) * 2]}

    profile = fixed_times(profile_step(tiny_model("gpt2"), inputs(0), forward_only=True))
    out = {}
    budget = int(profile.num_params * 4 * 0.9)
    result = search(profile, hw, world_size=world_size, device_memory_budget_bytes=budget, data_parallel="sharded")
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, ElixirConfig(
        plan=result.plan, device_memory_budget_bytes=budget, budget_covers_activations=False,
        default_placement="sharded"))
    pred = result.best.prediction
    out["sharded"] = (result.plan, (pred.onloads, pred.h2d_bytes, pred.allgather_bytes, pred.device_peak_bytes),
                      budget, [_counters(model, inputs(s)) for s in range(3)])
    out["prefetch"] = {}
    for fraction in PREFETCH_FRACTIONS:  # the same, searched with gathers issued ahead ([Note: forward steps])
        budget = int(profile.num_params * 4 * fraction)
        result = search(profile, hw, world_size=world_size, device_memory_budget_bytes=budget,
                        data_parallel="sharded", prefetch_depths=(2,))
        # without rank-local host copies: every refill is an all-gather, the kind issued ahead at two ranks
        plan = dataclasses.replace(result.plan, host_copy_chunks=[])
        step = build_chunked_step(profile, plan.chunk_size_numel, world_size=world_size, precision="fp32",
                                  hardware=hw)
        pred = predict(step, dataclasses.replace(result.best.knobs, host_copies=False), hw, pool_bytes=budget)
        model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, ElixirConfig(
            plan=plan, device_memory_budget_bytes=budget, budget_covers_activations=False,
            default_placement="sharded"))
        out["prefetch"][fraction] = (
            plan, (pred.onloads, pred.h2d_bytes, pred.allgather_bytes, pred.device_peak_bytes,
                   pred.gathers_ahead.get("fwd", 0)),
            budget, [_counters(model, inputs(s)) + (hf_elixir.memory_stats(model)["step_num_prefetched_gathers"],)
                     for s in range(3)])
    budget = int(profile.num_params * 4 * 1.4)
    config = ElixirConfig(search="auto", device_memory_budget_bytes=budget)
    model, _ = hf_elixir.prepare(tiny_model("gpt2"), None, config, sample_batch=inputs(0))
    reference = tiny_model("gpt2").eval()
    with torch.no_grad():
        same = torch.equal(model(**inputs(1)).logits, reference(**inputs(1)).logits)
    out["auto"] = (hf_elixir.get_state(model).plan, same, budget, [_counters(model, inputs(s)) for s in range(3)])
    return out


def _counters(model, inputs: dict) -> tuple:
    """``(onloads, H2D bytes, all-gather bytes, model-data peak)`` of one forward under ``torch.no_grad()``."""
    model.eval()
    hf_elixir.reset_memory_stats(model)
    with torch.no_grad():
        model(**inputs)
    s = hf_elixir.memory_stats(model)
    return s["num_onloads"], s["h2d_bytes"], s["allgather_bytes"], s["device_peak_bytes"]


def test_inference_at_two_ranks_sharded_exact_traffic_and_replicated_where_it_fits():
    """Two gloo ranks. Sharded: the steady forward's onloads, H2D and all-gather bytes and its model-data peak
    are what the plan's prediction says (a resident chunk's shard is a slice of its full buffer,
    ``Chunk.shard_in_full``, in both). The same with prefetch depth 2 and no host copies at four budgets: the
    second and later forwards issue all-gathers ahead ([Note: forward steps] in ``hf_elixir/chunk/_steps.py``),
    as many as the cost model prices as ahead, with the counts and peak predicted.
    ``search="auto"`` where a replicated copy fits (no gradients or optimizer states needed) replicates: no
    onload, no all-gather, the plain model's logits."""
    from _dist import run_distributed

    for rank, out in enumerate(run_distributed(_two_rank_worker, 2, timeout_s=300)):
        plan, (onloads, h2d, gathered, peak), budget, counts = out["sharded"]
        assert plan.device_optim_chunks == [] and onloads > 0, rank
        assert [c[:3] for c in counts[1:]] == [(onloads, h2d, gathered)] * 2, (rank, counts)
        assert plan.resident_chunks and peak == counts[2][3] <= budget, (rank, peak, counts, plan.resident_chunks)
        ahead = 0
        for fraction, (plan, (onloads, h2d, gathered, peak, priced_ahead), budget, counts) in out["prefetch"].items():
            # with gathers issued ahead by the previous forward's order ([Note: forward steps] in chunk/_steps.py): the
            # second and third forwards onload, all-gather and peak exactly as predicted; the first issues none
            assert plan.prefetch_depth == 2 and plan.host_copy_chunks == [] and gathered > 0, (rank, fraction)
            assert [c[:4] for c in counts[1:]] == [(onloads, h2d, gathered, peak)] * 2, (rank, fraction, counts)
            assert counts[0][4] == 0 and counts[1][4] == counts[2][4] == priced_ahead, (rank, fraction, counts)
            assert peak <= budget
            ahead += counts[2][4]
        assert ahead > 0, (rank, out["prefetch"])
        plan, same, budget, counts = out["auto"]
        assert set(plan.placements.values()) == {"replicated"} and same, (rank, plan.reasons)
        assert any("inference (no optimizer)" in r for r in plan.reasons)
        assert all(c[:3] == (0, 0, 0) and c[3] <= budget for c in counts), (rank, counts)
