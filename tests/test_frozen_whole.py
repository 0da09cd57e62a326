"""Frozen chunks kept whole on every rank ([Note: whole frozen chunks] in hf_elixir/chunk/_frozen_whole.py):

* floor: GPT-2 124M with peft LoRA r16 at 2 ranks (on the meta device, nothing allocated) places at half its model
  data with the frozen base whole (sharded it needs about three quarters); ``prepare`` refuses a budget one byte below
  the floor ``min_device_budget_bytes`` reports, naming it, and trains at it;
* parity: 5 AdamW steps with clipping on a tiny Llama + LoRA against peft on plain PyTorch (same seeds, fp32), at 1
  and 2 gloo ranks under a budget that evicts the whole frozen chunks: losses and adapter weights within 1e-5
  relative, the frozen chunks onloaded again after evictions, and never all-gathered (each chunk fill recorded);
* unchanged: a wholly trained model at 2 ranks gets the same chunks and bit-identical losses whatever
  ``frozen_placement`` says; ``"auto"`` is priced by the rates and the host budget;
* plans and checkpoints: a searched plan records the frozen layout and ``prepare`` follows it; a checkpoint of whole
  frozen chunks at 2 ranks resumes to the uninterrupted run's losses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests._dist import run_distributed
from tests._models import plain_step, rank_mean
from tests.test_lora_layout import SEQ, VOCAB, _adamw, _batch, _llama  # the same tiny Llama with LoRA r4

STEPS = 5
ROWS = 2
CHUNK = 16_384
BUDGET_BYTES = 300_000  # model data: under the frozen base's ~360 KB, so whole frozen chunks are evicted


def _clipped_step(model, opt, ids) -> float:
    """One step of a prepared model, its gradients clipped to norm 0.05 (the optimizer ``prepare`` returned clips)."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.clip_grad_norm(0.05)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _gpt2_lora_meta():
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["c_attn", "c_proj", "c_fc"],
                                             lora_dropout=0.0, fan_in_fan_out=True))


def test_gpt2_lora_floor_halves_with_whole_frozen_chunks():
    import hf_elixir

    model = _gpt2_lora_meta()
    trained = [p for p in model.parameters() if p.requires_grad]
    data = sum(p.numel() * (16 if p.requires_grad else 4) for p in model.parameters())  # the benchmark's model data

    def floor(placement: str) -> int:
        config = hf_elixir.ElixirConfig(device_memory_budget_bytes=data // 2, budget_covers_activations=False,
                                        search="auto", frozen_placement=placement)
        return hf_elixir.min_device_budget_bytes(model, torch.optim.AdamW(trained), config, 2)

    whole, sharded = floor("whole"), floor("sharded")
    assert whole <= data // 2 < sharded  # 50% places only with the base whole
    assert whole < 0.55 * sharded


def test_budget_below_the_whole_floor_is_refused_naming_it():
    import hf_elixir

    def config(budget: int):
        return hf_elixir.ElixirConfig(device_memory_budget_bytes=budget, chunk_size_numel=CHUNK, frozen_placement="whole",
                                      offload_optimizer=True, budget_covers_activations=False)

    model = _llama()
    need = hf_elixir.min_device_budget_bytes(model, _adamw(model), config(10**9))
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        hf_elixir.prepare(model, _adamw(model), config(need - 1))
    model = _llama()
    model, opt = hf_elixir.prepare(model, _adamw(model), config(need))
    ids = _batch(0, ROWS)
    assert torch.isfinite(torch.tensor(_clipped_step(model, opt, ids)))


def _refused_below_floor(world_size: int) -> int:
    """``prepare`` at one byte under ``min_device_budget_bytes`` (default ``frozen_placement``): refused naming it."""
    import hf_elixir

    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=10**9, chunk_size_numel=CHUNK, offload_optimizer=True,
                                    budget_covers_activations=False)
    model = _llama()
    need = hf_elixir.min_device_budget_bytes(model, _adamw(model), config, world_size)
    with pytest.raises(ValueError, match=f"needs {need} bytes"):
        hf_elixir.prepare(model, _adamw(model), dataclasses.replace(config, device_memory_budget_bytes=need - 1))
    return need


def _record_fills(monkeypatch_chunk):
    """Wrap ``Chunk._fill``: per fill, (trainable, whether it all-gathers). Returns the record list."""
    fills = []
    original = monkeypatch_chunk._fill

    def recording(self, counters, pool, async_op=False):
        fills.append((self.trainable, self.world_size > 1 and self.host_full_version != self.version))
        return original(self, counters, pool, async_op)

    monkeypatch_chunk._fill = recording
    return fills, original


def _train_whole(rank: int, world_size: int, placement: str) -> dict:
    import hf_elixir
    from hf_elixir.chunk.chunk import Chunk

    need = _refused_below_floor(world_size)
    fills, original = _record_fills(Chunk)
    try:
        ref, model = _llama(), _llama()
        ref_opt = _adamw(ref)
        config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=CHUNK,
                                        offload_optimizer=True, budget_covers_activations=False,
                                        frozen_placement=placement)
        model, opt = hf_elixir.prepare(model, _adamw(model), config=config)
        state = hf_elixir.get_state(model)
        frozen = [c for c in state.manager.chunks if not c.trainable]
        fills.clear()  # the step's fills only
        losses, ref_losses = [], []
        for step in range(STEPS):
            ids = _batch(step, ROWS * world_size)
            losses.append(_clipped_step(model, opt, ids[rank * ROWS:(rank + 1) * ROWS]))
            torch.manual_seed(step)
            ref_losses.append(_ref_clipped(ref, ref_opt, ids))
    finally:
        Chunk._fill = original
    losses = rank_mean(losses, world_size)
    got, want = model.state_dict(), ref.state_dict()
    adapters = [k for k in want if "lora_" in k]
    num = sum(float((got[k] - want[k]).double().norm() ** 2) for k in adapters)
    den = sum(float(want[k].double().norm() ** 2) for k in adapters)
    return dict(losses=losses, ref_losses=ref_losses, rel_l2=(num / den) ** 0.5, floor=need,
                frozen_world_sizes={c.world_size for c in frozen}, frozen_offloaded=sum(not c.shard_on_device for c in frozen),
                frozen_fills=sum(1 for trainable, _ in fills if not trainable),
                frozen_gathers=sum(1 for trainable, gathers in fills if not trainable and gathers),
                evictions=hf_elixir.memory_stats(model)["num_evictions"])


def _ref_clipped(ref, ref_opt, ids) -> float:
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.05)
    ref_opt.step()
    ref_opt.zero_grad()
    return float(loss.detach())


def _check(result: dict) -> None:
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert result["rel_l2"] < 1e-5
    assert result["frozen_world_sizes"] == {1}  # whole on every rank
    assert result["frozen_offloaded"] > 0 and result["evictions"] > 0
    # evicted and copied in again: more fills of frozen chunks than there are offloaded ones, none of them a gather
    assert result["frozen_fills"] > result["frozen_offloaded"]
    assert result["frozen_gathers"] == 0
    assert result["floor"] <= BUDGET_BYTES  # the budget trained at is at or above the floor refused below


def test_whole_frozen_chunks_match_peft_one_rank():
    _check(_train_whole(0, 1, "whole"))  # one rank: "auto" keeps the sharded layout, which is whole there


def test_whole_frozen_chunks_match_peft_two_ranks():
    # "auto": nothing measured (or gloo's rates) and a whole copy fits the host: whole
    for result in run_distributed(_train_whole, 2, "auto", timeout_s=240):
        _check(result)


def _wholly_trained(rank: int, world_size: int, placement: str):
    import hf_elixir

    model = _llama(lora=False)
    config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, device_memory_budget_bytes=BUDGET_BYTES * 2,
                                    offload_optimizer=True, budget_covers_activations=False, frozen_placement=placement)
    model, opt = hf_elixir.prepare(model, _adamw(model), config)
    chunks = hf_elixir.get_state(model).manager.chunks
    losses = [_clipped_step(model, opt, _batch(step, ROWS * world_size)[rank * ROWS:(rank + 1) * ROWS])
              for step in range(3)]
    return [[s.name for s in c.slots] for c in chunks], [c.world_size for c in chunks], losses


def test_wholly_trained_model_unchanged_by_frozen_placement():
    def run(placement):
        return run_distributed(_wholly_trained, 2, placement, timeout_s=240)

    whole, sharded = run("whole"), run("sharded")
    assert whole == sharded and set(whole[0][1]) == {2}


def test_auto_prices_whole_against_sharded():
    from hf_elixir.chunk._frozen_whole import choose_frozen_whole

    gib = 2**30
    # gloo on a CPU: the all-gather is far slower than a memcpy -> whole
    assert choose_frozen_whole("auto", 2, gib, 8 * gib, 1.2e9, 1.0e8)[0]
    # a GPU whose NVLink gathers faster than h2d * W / (W - 1) -> sharded
    assert not choose_frozen_whole("auto", 8, gib, 64 * gib, 25e9, 300e9)[0]
    # a whole copy does not fit the host budget -> sharded, whatever the rates
    whole, reason = choose_frozen_whole("auto", 2, 8 * gib, 4 * gib, 1.2e9, 1.0e8)
    assert not whole and "host budget" in reason
    # nothing measured yet: whole (partition only when memory requires); one rank and parallel models: sharded
    assert choose_frozen_whole("auto", 2, gib, 8 * gib, None, None)[0]
    assert not choose_frozen_whole("auto", 1, gib, 8 * gib, None, None)[0]
    assert not choose_frozen_whole("whole", 2, gib, 8 * gib, None, None, is_parallel=True)[0]
    # nothing measured on a GPU: sharded (NCCL's all-gather outpaces whole host copies); measured rates still decide
    whole, reason = choose_frozen_whole("auto", 8, gib, 64 * gib, None, None, device_type="cuda")
    assert not whole and "hf-elixir probe" in reason
    assert choose_frozen_whole("auto", 2, gib, 8 * gib, 1.2e9, 1.0e8, device_type="cuda")[0]
    # a model that trains nothing (a reference model, a teacher) is stored once, sharded
    whole, reason = choose_frozen_whole("auto", 2, gib, 8 * gib, 1.2e9, 1.0e8, trains=False)
    assert not whole and "trains nothing" in reason


def test_frozen_placement_is_validated():
    import hf_elixir

    with pytest.raises(ValueError, match="frozen_placement='replicated'.*'whole'"):
        hf_elixir.ElixirConfig(frozen_placement="replicated")


def test_a_searched_plan_carries_its_frozen_layout():
    """A plan ``search='auto'`` made with whole frozen chunks says so (``ElixirPlan.frozen_whole``): ``prepare`` given
    that plan lays the same chunks out under ``"auto"``, and refuses ``"sharded"`` naming the mismatch."""
    import hf_elixir

    ids = _batch(0, ROWS)
    batch = {"input_ids": ids, "labels": ids}
    model = _llama()
    config = hf_elixir.ElixirConfig(search="auto", device_memory_budget_bytes=4 * BUDGET_BYTES, frozen_placement="whole")
    model, _ = hf_elixir.prepare(model, _adamw(model), config, sample_batch=batch)
    plan = hf_elixir.get_state(model).plan
    assert plan.frozen_whole and plan.predicted_step_s is not None
    def layout(m):  # bucket-packed frozen chunks are trimmed to what they hold: their numels tell the layouts apart
        return [([s.name for s in c.slots], c.chunk_numel) for c in hf_elixir.get_state(m).manager.chunks]

    built = layout(model)
    again = _llama()
    again, _ = hf_elixir.prepare(again, _adamw(again), hf_elixir.ElixirConfig(plan=hf_elixir.ElixirPlan.from_dict(
        plan.to_dict()), device_memory_budget_bytes=4 * BUDGET_BYTES))
    assert layout(again) == built
    with pytest.raises(ValueError, match="frozen_placement='sharded' but the plan was made with the frozen chunks whole"):
        other = _llama()
        hf_elixir.prepare(other, _adamw(other), hf_elixir.ElixirConfig(plan=plan, frozen_placement="sharded"))


def _resume(rank: int, world_size: int, directory: str) -> tuple[list[float], list[float]]:
    """4 steps straight, against 2 steps, a checkpoint, a fresh prepare that loads it, and 2 more steps."""
    import hf_elixir
    from hf_elixir.checkpoint import load_checkpoint, save_checkpoint

    def prepared():
        model = _llama()
        config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=CHUNK,
                                        offload_optimizer=True, budget_covers_activations=False, frozen_placement="whole")
        return hf_elixir.prepare(model, _adamw(model), config)

    def step(model, opt, k):
        return _clipped_step(model, opt, _batch(k, ROWS * world_size)[rank * ROWS:(rank + 1) * ROWS])

    model, opt = prepared()
    straight = [step(model, opt, k) for k in range(4)]
    model, opt = prepared()
    resumed = [step(model, opt, k) for k in range(2)]
    save_checkpoint(directory, model, opt, step=2)
    model, opt = prepared()
    assert {c.world_size for c in hf_elixir.get_state(model).manager.chunks if not c.trainable} == {1}
    load_checkpoint(directory, model, opt)
    return straight, resumed + [step(model, opt, k) for k in range(2, 4)]


def test_whole_frozen_chunks_checkpoint_and_resume_two_ranks(tmp_path):
    for straight, resumed in run_distributed(_resume, 2, str(tmp_path / "ckpt"), timeout_s=240):
        assert resumed == pytest.approx(straight, rel=1e-6)
