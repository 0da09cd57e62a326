"""QLoRA through TRL's ``SFTTrainer(peft_config=...)`` with ``ElixirCallback`` at 2 gloo ranks: a torchao NF4 base
kept packed in its chunks ([Note: NF4 in chunks] in hf_elixir/chunk/_nf4.py), the peft adapters trained, under a
device budget that evicts, against peft's QLoRA on plain PyTorch in one process on the global batch (the exact
data-parallel reference): losses step by step and the adapters' final weights within 1e-5 relative; the full
``state_dict`` has the plain model's keys ([Note: NF4 state_dict names] in hf_elixir/chunk/_nf4_state_dict.py).

The reference is not plain DDP at 2 ranks: DDP's construction broadcasts every parameter (``_sync_module_states``),
and an NF4 parameter comes back through torchao's ``copy_``, which quantizes its dequantized values again. That
moves the base weights by ~2e-4 (the block scales change), so DDP + NF4 trains another base than one process does.
"""

from __future__ import annotations

import os

import pytest

from tests._dist import run_distributed
from tests.test_qlora import BUDGET_BYTES, TARGETS, _lora, _nf4_llama

ROWS = 2  # per rank and step


def _sft(callbacks: list, out: str, rows: int):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.launch_scripts.trl_trainers import common, sentences, tokenizer

    model = _nf4_llama(pad_token_id=0, eos_token_id=1, bos_token_id=1)
    args = SFTConfig(**{**common(out), "per_device_train_batch_size": rows}, max_length=24)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": sentences(16, 1)}),
                      processing_class=tokenizer(), callbacks=callbacks, peft_config=_lora())


def _trained(trainer) -> dict:
    state = trainer.accelerator.get_state_dict(trainer.model)
    return dict(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h], keys=list(state),
                adapters={k: v.detach().clone() for k, v in state.items() if "lora_" in k})


def _elixir(rank: int, world_size: int, out: str) -> dict:
    import hf_elixir

    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=16_384,
                                    budget_covers_activations=False)
    trainer = _sft([hf_elixir.ElixirCallback(config)], os.path.join(out, f"elixir-{rank}"), ROWS)
    trainer.train()
    manager = hf_elixir.get_state(trainer.model).manager
    return dict(_trained(trainer), evictions=hf_elixir.memory_stats(trainer.model)["num_evictions"],
                world_sizes={c.world_size for c in manager.chunks}, world=world_size)


def test_qlora_through_sft_trainer_two_ranks_matches_one_process_on_the_global_batch(tmp_path):
    ref = _sft([], str(tmp_path / "ref"), 2 * ROWS)
    ref.train()
    want = _trained(ref)
    for got in run_distributed(_elixir, 2, str(tmp_path), timeout_s=300):
        # the adapters' chunks sharded over both ranks; the NF4 base whole on each ("auto" on this machine)
        assert got["world"] == 2 and got["world_sizes"] == {1, 2} and got["evictions"] > 0
        assert len(got["losses"]) == 3 and got["losses"] == pytest.approx(want["losses"], rel=1e-5)
        assert got["keys"] == want["keys"]  # the plain model's names, NF4 weights included, in its order
        adapters = want["adapters"]
        assert len(adapters) == 2 * len(TARGETS) * 2 and got["adapters"].keys() == adapters.keys()
        num = sum(float((got["adapters"][k] - v).double().norm() ** 2) for k, v in adapters.items())
        den = sum(float(v.double().norm() ** 2) for v in adapters.values())
        assert (num / den) ** 0.5 < 1e-5, (num / den) ** 0.5
