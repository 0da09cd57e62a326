"""One ``state_dict`` contract on every placement, and collective calls made on some ranks only.

* ``model.state_dict()`` of a tensor- or expert-parallel model (Llama tp=2, Mixtral ep=2 with fused experts,
  Switch ep=2 with ``expert_{i}`` modules; prepared by hf_elixir or only parallelized) gives the unmodified model's
  keys, full shapes and values on every rank, as under ZeRO; ``torch.save`` of it loads into the stock class, and
  ``accelerator.get_state_dict`` gives the same. ``hf_elixir.parallel.local_state_dict`` gives this rank's parts;
  ``model.load_state_dict`` takes either back.
* ``if rank == 0: model.state_dict()`` and ``if accelerator.is_main_process: model.save_pretrained(dir)`` raise on
  the calling rank within seconds, naming the call and the fix (they used to hang); the ranks are processes
  killed past a deadline, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import hf_elixir
from tests._dist import run_distributed

ENTRY_TIMEOUT_S = 2  # HF_ELIXIR_COLLECTIVE_TIMEOUT_S in the entry cases


def _model(kind: str):
    import transformers as T

    from tests._moe_models import make_moe_model
    from tests.parallel_harness import make_model

    if kind == "mixtral":
        return make_moe_model("mixtral")
    if kind == "llama_tied":
        torch.manual_seed(0)
        return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                                tie_word_embeddings=True))
    return make_model(kind)


def _parallel(kind: str, world_size: int, prepare: bool, precision: str = "fp32"):
    """``kind`` parallelized over ``world_size`` ranks (tp for dense models, ep for MoE), optionally prepared."""
    from hf_elixir.parallel import build_mesh, parallelize

    model = _model(kind)
    ref = _model(kind)
    moe = kind in ("mixtral", "switch")
    sizes = dict(expert_parallel_size=world_size) if moe else dict(tensor_parallel_size=world_size)
    cfg = hf_elixir.ElixirConfig(**sizes)
    mesh = build_mesh(cfg)
    parallelize(model, cfg, mesh)
    if prepare:
        model, _ = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), hf_elixir.ElixirConfig(
            **sizes, chunk_size_numel=4096, precision=precision))
    return model, ref


def _contract_worker(rank, world_size, kind, prepare, tmp):
    from accelerate import Accelerator

    from hf_elixir.parallel import gather_full_state_dict, local_state_dict

    model, ref = _parallel(kind, world_size, prepare)
    want = ref.state_dict()
    full = model.state_dict()
    local = {k: v.clone() for k, v in local_state_dict(model).items()}  # plain modules: views of the parameters
    out = {
        "same_keys": list(full) == list(want),
        "same_values": all(torch.equal(full[k], v) for k, v in want.items()),
        "gather_same": all(torch.equal(a, full[k]) for k, a in gather_full_state_dict(model, rank0_only=False).items()),
        # this rank's parts: smaller than the whole over two ranks, the whole at one
        "local_parts": (sum(v.numel() for v in local.values()) < sum(v.numel() for v in want.values())) ==
                       (world_size > 1),
        "local_keys_known": set(local) <= set(want),
        "accelerate_same": all(torch.equal(v, full[k])
                               for k, v in Accelerator(cpu=True).get_state_dict(model, unwrap=False).items()),
    }
    path = os.path.join(tmp, f"{kind}-{prepare}.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    else:
        model.state_dict()
    dist.barrier()
    stock = _model(kind)
    stock.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, every full shape
    out["torch_save_loads"] = all(torch.equal(v, want[k]) for k, v in stock.state_dict().items())
    # load_state_dict takes the full dict (each rank cuts its part) and this rank's parts back
    moved = {k: v + 1 if v.is_floating_point() else v for k, v in want.items()}
    model.load_state_dict(moved)
    after = model.state_dict()
    out["full_load"] = all(torch.equal(after[k], v) for k, v in moved.items())
    model.load_state_dict(local)
    out["local_load"] = all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    ties = [k for k in full if k.endswith("lm_head.weight")]
    if kind == "llama_tied":
        out["tied_shared"] = full["lm_head.weight"] is full["model.embed_tokens.weight"] and bool(ties)
    return out


@pytest.mark.parametrize("kind,prepare", [("llama", False), ("mixtral", True), ("switch", True),
                                          ("llama_tied", True)])
def test_state_dict_is_full_on_every_placement_two_ranks(tmp_path, kind, prepare):
    for result in run_distributed(_contract_worker, 2, kind, prepare, str(tmp_path), timeout_s=180):
        assert all(result.values()), result


def test_state_dict_is_full_one_rank(tmp_path, single_rank_group):
    result = _contract_worker(0, 1, "llama", True, str(tmp_path))
    assert all(result.values()), result


# -- collective calls made on some ranks only --------------------------------------------------------

def _entry_worker(rank, world_size, pattern, precision, folder):
    """Run ``pattern`` as a user would; returns (rank, error message or None, seconds the call took)."""
    from accelerate import Accelerator

    if pattern == "tp_state_dict":
        model, _ = _parallel("llama", world_size, True, precision)
    else:
        from tests._models import tiny_model

        model = tiny_model("gpt2")
        model, _ = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                     hf_elixir.ElixirConfig(default_placement="sharded", precision=precision))
    if pattern == "trainer_save_model":
        trainer = _trained_trainer(folder)
    is_main = Accelerator(cpu=True).is_main_process if pattern == "save_pretrained" else rank == 0
    error, start = None, time.perf_counter()
    try:
        if pattern == "trainer_save_model" and trainer.is_world_process_zero():
            trainer.save_model(folder)
        elif is_main and pattern == "save_pretrained":
            model.save_pretrained(folder)
        elif is_main:
            model.state_dict()
    except hf_elixir.CollectiveEntryError as err:
        error = str(err)
    elapsed = time.perf_counter() - start
    dist.barrier()  # where the other ranks were meanwhile
    return rank, error, elapsed


def _trained_trainer(folder):
    """A Trainer that took one step of a sharded tiny GPT-2 under ``ElixirCallback``."""
    from transformers import Trainer, TrainingArguments

    from hf_elixir.integrations import ElixirCallback
    from tests._models import batch, tiny_model

    rows = [{k: v[0] for k, v in batch("gpt2", i, 1).items()} for i in range(4)]
    args = TrainingArguments(str(folder) + "-run", max_steps=1, per_device_train_batch_size=1, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    callback = ElixirCallback(hf_elixir.ElixirConfig(default_placement="sharded"))
    trainer = Trainer(tiny_model("gpt2"), args, train_dataset=rows, callbacks=[callback])
    trainer.train()
    return trainer


ENTRY_CASES = [("state_dict", "fp32"), ("state_dict", "bf16"), ("save_pretrained", "fp32"), ("tp_state_dict", "fp32"),
               ("trainer_save_model", "fp32")]


@pytest.mark.parametrize("pattern,precision", ENTRY_CASES)
def test_calls_on_rank_zero_alone_raise_within_seconds_naming_the_fix(tmp_path, monkeypatch, pattern, precision):
    monkeypatch.setenv("HF_ELIXIR_COLLECTIVE_TIMEOUT_S", str(ENTRY_TIMEOUT_S))
    folder = tmp_path / "saved"
    # the ranks are processes killed past join_timeout_s: a hang fails the test instead of stalling it
    (_, error, elapsed), (_, other, _) = run_distributed(_entry_worker, 2, pattern, precision, str(folder),
                                                        timeout_s=60, join_timeout_s=150)
    assert error is not None, "rank 0's call did not raise"
    assert other is None
    assert elapsed < ENTRY_TIMEOUT_S + 10, f"raised after {elapsed:.1f} s"
    if pattern == "trainer_save_model":  # named as the user wrote it, with the Trainer's fix
        assert "trainer.save_model(...) (its model.state_dict())" in error, error
        assert "on every rank, not inside `if trainer.is_world_process_zero():`" in error, error
    else:
        call = "save_pretrained" if pattern == "save_pretrained" else "state_dict()"
        assert call in error and "every rank" in error and "is_main_process" in error, error
    assert "ranks [1]" in error and "HF_ELIXIR_COLLECTIVE_TIMEOUT_S" in error, error
    assert not (folder / "model.safetensors").exists()  # nothing half-written


def _replicated_worker(rank, world_size):
    from tests._models import tiny_model

    model = tiny_model("gpt2")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = hf_elixir.prepare(model, torch.optim.AdamW(model.parameters()),
                                   hf_elixir.ElixirConfig(default_placement="replicated"))
    start = time.perf_counter()
    same = None
    if rank == 0:  # whole on every rank: nothing to gather, a local call as under DDP
        same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    elapsed = time.perf_counter() - start
    dist.barrier()
    return same, elapsed


def test_a_replicated_models_state_dict_on_rank_zero_alone_works(monkeypatch):
    monkeypatch.setenv("HF_ELIXIR_COLLECTIVE_TIMEOUT_S", "60")
    (same, elapsed), _ = run_distributed(_replicated_worker, 2, timeout_s=60, join_timeout_s=150)
    assert same and elapsed < 20


def _mismatch_worker(rank, world_size):
    from hf_elixir.runtime._entry_check import check_entry

    check_entry("model.state_dict()")  # every rank: passes
    start = time.perf_counter()
    try:
        check_entry("model.state_dict()" if rank == 0 else "hf_elixir.full_parameters(model)")
    except hf_elixir.CollectiveEntryError as err:
        return str(err), time.perf_counter() - start
    return None, time.perf_counter() - start


def test_ranks_in_different_collective_calls_raise_at_once_naming_both(monkeypatch):
    monkeypatch.setenv("HF_ELIXIR_COLLECTIVE_TIMEOUT_S", "60")
    for error, elapsed in run_distributed(_mismatch_worker, 2, timeout_s=60):
        assert error is not None and elapsed < 20  # no timeout waited out
        assert "rank 0: model.state_dict()" in error and "rank 1: hf_elixir.full_parameters(model)" in error


def test_the_timeout_variable_is_validated(monkeypatch):
    from hf_elixir.runtime._entry_check import timeout_s

    monkeypatch.setenv("HF_ELIXIR_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="HF_ELIXIR_COLLECTIVE_TIMEOUT_S='soon'"):
        timeout_s()
    monkeypatch.setenv("HF_ELIXIR_COLLECTIVE_TIMEOUT_S", "2.5")
    assert timeout_s() == 2.5
