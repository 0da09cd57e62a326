"""Plain LoRA's layout: the frozen base never shares a chunk with the adapters ([Note: frozen chunks apart] in
hf_elixir/chunk/_frozen_apart.py), in ``prepare``'s chunks and in the search's packing alike.

* bytes: a tiny Llama + peft LoRA (fp32 base) against the same model laid out by the old rule (frozen and trained
  parameters in shared chunks, model order): far fewer trainable chunks, and less device and host memory as the run
  measures it (its chunks' and optimizer's allocated buffers), not as the plan prices it;
* agreement: the chunks the search packs for the profiled step (``search='auto'``'s plan) hold exactly the
  parameters of the chunks ``prepare`` builds from that plan;
* parity: 5 AdamW steps against peft on plain PyTorch (same seeds, fp32), at 1 rank and at 2 gloo ranks under a
  budget that evicts chunks and offloads the optimizer: losses and adapter weights within 1e-5 relative;
* unchanged: a model wholly trained, or wholly frozen, gets the layout the old rule gave, and bit-identical losses.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests._models import plain_step, rank_mean

STEPS = 5
ROWS = 2
SEQ = 12
VOCAB = 128
CHUNK = 16_384
#: device bytes for model data: under the chunks' ~460 KB, so chunks are evicted and gathered again
BUDGET_BYTES = 400_000


def _llama(lora: bool = True):
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    if not lora:
        return model
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():  # peft starts lora_B at zero: make the adapters matter from the first step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.fixture
def old_rule(monkeypatch):
    """Lay out as before the split: trained and frozen parameters share buckets (model order)."""
    import hf_elixir.chunk._build as build
    from hf_elixir.chunk._frozen_apart import frozen_apart

    def apply():
        monkeypatch.setattr(build, "frozen_apart", lambda keys, trained: frozen_apart(keys, [True for _ in trained]))

    return apply


def _membership(model) -> list[list[str]]:
    import hf_elixir

    return [[s.name for s in c.slots] for c in hf_elixir.get_state(model).manager.chunks]


def _steps(model, opt, steps: int = 2) -> list[float]:
    losses = []
    for step in range(steps):
        ids = _batch(step, ROWS)
        loss = model(input_ids=ids, labels=ids).loss
        if opt is not None:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _measured(**config) -> dict:
    """Trainable chunks and the bytes the run allocated: model data on the device (its peak), everything on the host,
    and the optimizer's fp32 masters and states (their storages)."""
    import hf_elixir

    model = _llama()
    model, opt = hf_elixir.prepare(model, _adamw(model), hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, **config))
    _steps(model, opt)
    stats = hf_elixir.memory_stats(model)
    chunks = hf_elixir.get_state(model).manager.chunks
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in opt.masters.values()}
    mixed = [c.chunk_id for c in chunks if len({s.trainable for s in c.slots}) > 1]
    return dict(trainable=sum(c.trainable for c in chunks), chunks=len(chunks), mixed=mixed,
                device_peak=stats["device_peak_bytes"], host=stats["host_bytes"], masters=sum(storages.values()))


def test_lora_base_chunks_carry_no_training_state(old_rule):
    adapters = sum(p.numel() for p in _llama().parameters() if p.requires_grad)
    evicting = dict(device_memory_budget_bytes=BUDGET_BYTES, offload_optimizer=True, budget_covers_activations=False)
    new, new_offloaded = _measured(), _measured(**evicting)
    old_rule()
    old, old_offloaded = _measured(), _measured(**evicting)
    assert old["mixed"] and not new["mixed"] and not new_offloaded["mixed"]
    assert new["chunks"] == old["chunks"] and new["trainable"] == -(-adapters // CHUNK) == 1 < old["trainable"]
    # all on the device: the frozen base's gradient buffers, masters and AdamW state are gone
    assert new["device_peak"] < 0.35 * old["device_peak"]
    assert new["masters"] < 0.25 * old["masters"] and new["masters"] >= 4 * adapters
    # optimizer offloaded under a budget that evicts: the host keeps the adapters' state only
    assert new_offloaded["host"] < 0.3 * old_offloaded["host"]
    assert new_offloaded["masters"] < 0.25 * old_offloaded["masters"]


def test_search_packs_the_chunks_prepare_builds():
    """``search='auto'`` profiles the LoRA step and prices the chunks ``_pack`` lays out; ``prepare`` builds the chunks
    of that plan: the same parameters in the same chunks, the frozen base's chunks without trained parameters."""
    import hf_elixir
    from hf_elixir.profiler import profile_step
    from hf_elixir.search._chunked_step import _pack

    ids = _batch(0, ROWS)
    model = _llama()
    profile = profile_step(_llama(), {"input_ids": ids, "labels": ids})
    config = hf_elixir.ElixirConfig(search="auto", device_memory_budget_bytes=4 * BUDGET_BYTES)
    model, opt = hf_elixir.prepare(model, _adamw(model), config, sample_batch={"input_ids": ids, "labels": ids})
    plan = hf_elixir.get_state(model).plan
    assert plan.predicted_step_s is not None and plan.param_order == profile.param_names  # a searched plan
    layout, _ = _pack(profile, plan.chunk_size_numel, 1, False, None, 1)
    priced = [[profile.param_names[i] for i in members] for members in layout.members]
    assert priced == _membership(model)
    trained = {n for n, p in _llama().named_parameters() if p.requires_grad}
    assert [any(n in trained for n in c) for c in priced].count(True) == 1
    assert all(set(c) <= trained or not set(c) & trained for c in priced)
    _steps(model, opt)


def _train(rank: int, world_size: int) -> dict:
    import hf_elixir

    ref, model = _llama(), _llama()
    ref_opt = _adamw(ref)
    # the frozen base sharded and all-gathered (tests/test_frozen_whole.py: kept whole on every rank)
    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=CHUNK,
                                    offload_optimizer=True, budget_covers_activations=False, frozen_placement="sharded")
    model, opt = hf_elixir.prepare(model, _adamw(model), config=config)
    losses, ref_losses = [], []
    for step in range(STEPS):
        ids = _batch(step, ROWS * world_size)
        mine = ids[rank * ROWS:(rank + 1) * ROWS]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        ref_losses.append(plain_step(ref, ref_opt, ids))
    losses = rank_mean(losses, world_size)
    got, want, start = model.state_dict(), ref.state_dict(), _llama().state_dict()
    adapters = [k for k in want if "lora_" in k]
    num = sum(float((got[k] - want[k]).double().norm() ** 2) for k in adapters)
    den = sum(float(want[k].double().norm() ** 2) for k in adapters)
    moved = sum(float((want[k] - start[k]).double().norm() ** 2) for k in adapters) ** 0.5
    base = max(float((got[k] - start[k]).abs().max()) for k in want if "lora_" not in k)
    chunks = hf_elixir.get_state(model).manager.chunks
    stats = hf_elixir.memory_stats(model)
    return dict(losses=losses, ref_losses=ref_losses, rel_l2=(num / den) ** 0.5, moved=moved, base=base,
                evictions=stats["num_evictions"], onloads=stats["num_onloads"], trainable=sum(c.trainable for c in chunks),
                sharded=chunks[0].world_size)


def _check(result: dict, world_size: int) -> None:
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert result["rel_l2"] < 1e-5
    assert result["moved"] > 1e-2  # the adapters really trained
    assert result["base"] == 0.0  # the frozen base is not touched
    assert result["evictions"] > 0 and result["onloads"] > 0  # the budget really evicted chunks, onloaded again
    assert result["trainable"] == 1 and result["sharded"] == world_size


def test_lora_matches_peft_one_rank():
    _check(_train(0, 1), 1)


def test_lora_matches_peft_two_ranks():
    for result in run_distributed(_train, 2, timeout_s=240):
        _check(result, 2)


@pytest.mark.parametrize("trained", [True, False], ids=["full-fine-tune", "frozen"])
def test_wholly_trained_or_frozen_model_keeps_its_layout(old_rule, trained):
    """No split where every parameter is trained (full fine-tuning) or none is (a frozen model, no optimizer): the
    old rule's chunks, and bit-identical losses."""
    import hf_elixir

    def run():
        model = _llama(lora=False).requires_grad_(trained)
        opt = _adamw(model) if trained else None
        config = hf_elixir.ElixirConfig(chunk_size_numel=CHUNK, device_memory_budget_bytes=BUDGET_BYTES,
                                        offload_optimizer=True, budget_covers_activations=False)
        model, opt = hf_elixir.prepare(model, opt, config)
        return _membership(model), _steps(model, opt, 3)

    new = run()
    old_rule()
    assert run() == new and len(new[0]) > 1
