"""QLoRA: a frozen base quantized to NF4 with torchao, kept packed in its chunks ([Note: NF4 in chunks] in
hf_elixir/chunk/_nf4.py), with peft LoRA adapters trained on top.

* parity: peft's QLoRA on plain PyTorch with the same NF4 base (same seeds, fp32 compute) against the same model
  prepared by hf_elixir, 5 AdamW steps, at 1 rank (also with activation checkpointing) and at 2 gloo ranks
  (sharded), under a device budget that evicts chunks and offloads the optimizer: losses and adapter weights within
  1e-5 relative; and through TRL's ``SFTTrainer(peft_config=...)`` with ``ElixirCallback`` against the plain run;
* bytes: what the NF4 base really occupies in its chunks (their allocated storage) against the same base in
  bf16 and fp32, and against the planner's ``--quantize nf4`` price (one formula);
* bad input: a trainable NF4 parameter, NF4 blocks that do not match the weight, a failed prepare undone.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import run_distributed
from tests._models import plain_step, rank_mean

STEPS = 5
ROWS = 2
SEQ = 12
VOCAB = 128
TARGETS = ["q_proj", "v_proj", "up_proj"]
#: device bytes for model data (activations not counted): under the chunks' ~220 KB (NF4 base, fp32 embeddings,
#: norms, head and adapters): chunks are evicted and re-gathered
BUDGET_BYTES = 300_000


def _quantize_base(model: torch.nn.Module) -> None:
    """What a torchao/torchtune QLoRA user does: every linear of the decoder layers to NF4, frozen."""
    from torchao.quantization import to_nf4

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)


def _nf4_llama(**kw):
    """A tiny Llama whose decoder linears are NF4 (torchao's default blocks need numel % 16384 == 0)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, **kw)
    model = transformers.LlamaForCausalLM(cfg)
    _quantize_base(model)
    return model


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def _qlora_model(checkpointing: bool = False):
    from peft import get_peft_model

    model = get_peft_model(_nf4_llama(), _lora())
    if checkpointing:  # HF activation checkpointing: the NF4 weights are read again in backward's recomputation
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.no_grad():  # peft starts lora_B at zero: make the adapters matter from the first step
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _train(rank: int, world_size: int, checkpointing: bool = False) -> dict:
    import hf_elixir

    ref = _qlora_model(checkpointing)
    model = _qlora_model(checkpointing)
    ref_opt = _adamw(ref)
    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=16_384,
                                    offload_optimizer=True, budget_covers_activations=False,
                                    frozen_placement="sharded")  # the NF4 base sharded, as the docstring says
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
    got, want = model.state_dict(), ref.state_dict()
    adapters = [k for k in want if "lora_" in k]
    num = sum(float((got[k] - want[k]).double().norm() ** 2) for k in adapters)
    den = sum(float(want[k].double().norm() ** 2) for k in adapters)
    start = _qlora_model().state_dict()
    moved = sum(float((want[k] - start[k]).double().norm() ** 2) for k in adapters) ** 0.5
    manager = hf_elixir.get_state(model).manager
    carriers = [s for c in manager.chunks for s in c.slots if s.name.endswith("parametrizations.weight.original")]
    return dict(losses=losses, ref_losses=ref_losses, rel_l2=(num / den) ** 0.5, num_adapters=len(adapters),
                moved=moved, evictions=hf_elixir.memory_stats(model)["num_evictions"], num_carriers=len(carriers),
                onloads=hf_elixir.memory_stats(model)["num_onloads"],
                carrier_dtypes={str(s.param.dtype) for s in carriers}, sharded=manager.chunks[0].world_size)


def _check(result: dict, world_size: int) -> None:
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5)
    assert result["rel_l2"] < 1e-5
    assert result["num_adapters"] == 2 * len(TARGETS) * 2  # A and B, 3 targets, 2 layers
    assert result["moved"] > 1e-2  # the adapters really trained
    assert result["evictions"] > 0 and result["onloads"] > 0  # the budget really evicted chunks, onloaded again
    assert result["num_carriers"] == 7 * 2  # every linear of both layers stored packed
    assert result["carrier_dtypes"] == {"torch.float32"}
    assert result["sharded"] == world_size


@pytest.mark.parametrize("checkpointing", [False, True])
def test_qlora_matches_peft_one_rank(checkpointing):
    _check(_train(0, 1, checkpointing), 1)


def test_qlora_matches_peft_two_ranks():
    for result in run_distributed(_train, 2, timeout_s=240):
        _check(result, 2)


def _sft(callbacks: list, out: str):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.launch_scripts.trl_trainers import common, sentences, tokenizer

    model = _nf4_llama(pad_token_id=0, eos_token_id=1, bos_token_id=1)
    args = SFTConfig(**common(out), max_length=24)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": sentences(16, 1)}),
                      processing_class=tokenizer(), callbacks=callbacks, peft_config=_lora())


def test_qlora_through_trl_sft_trainer(tmp_path):
    """The path a TRL user takes: a torchao NF4 base, ``SFTTrainer(peft_config=LoraConfig(...))`` and
    ``callbacks=[ElixirCallback(...)]``, against the same run without the callback: losses and adapters."""
    import hf_elixir

    config = hf_elixir.ElixirConfig(device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=16_384,
                                    budget_covers_activations=False)
    el = _sft([hf_elixir.ElixirCallback(config)], str(tmp_path / "elixir"))
    el.train()
    ref = _sft([], str(tmp_path / "ref"))
    ref.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (el, ref)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    got, want = el.model.state_dict(), ref.model.state_dict()
    adapters = [k for k in want if "lora_" in k]
    num = sum(float((got[k] - want[k]).double().norm() ** 2) for k in adapters)
    den = sum(float(want[k].double().norm() ** 2) for k in adapters)
    assert len(adapters) == 2 * len(TARGETS) * 2 and (num / den) ** 0.5 < 1e-5
    assert hf_elixir.memory_stats(el.model)["num_evictions"] > 0


def _linear_stack(dtype: torch.dtype, nf4: bool) -> torch.nn.Module:
    """Four bias-free 256 x 256 linears (262,144 weights), the base in ``dtype``, or quantized from it to NF4."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False, dtype=dtype) for _ in range(4)])
    if nf4:
        from torchao.quantization import to_nf4

        for module in model:
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    else:
        model.requires_grad_(False)
    return model


def _chunk_storage_bytes(model) -> tuple[int, list]:
    """Bytes the chunks' buffers really allocate (each storage once), and the chunks' slots."""
    import hf_elixir

    manager = hf_elixir.get_state(model).manager
    storages = {c.full.untyped_storage().data_ptr(): c.full.untyped_storage().nbytes() for c in manager.chunks}
    return sum(storages.values()), [s for c in manager.chunks for s in c.slots]


def test_nf4_base_bytes_in_chunks():
    """The NF4 base takes ~0.516 B/param in its chunks' allocated storage (the planner's price, plus at most 16
    alignment bytes per tensor), a quarter of bf16's and an eighth of fp32's; and computes what torchao computes."""
    import dataclasses

    import hf_elixir
    from hf_elixir.chunk._nf4 import nf4_bytes_per_element, nf4_packed_bytes
    from hf_elixir.cli._plan import frozen_as_nf4

    numel = 4 * 256 * 256
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    measured = {}
    for name, dtype, precision, nf4 in [("fp32", torch.float32, "fp32", False), ("bf16", torch.bfloat16, "bf16", False),
                                        ("nf4", torch.bfloat16, "bf16", True)]:
        model = _linear_stack(dtype, nf4)
        want = model(x.to(dtype)) if nf4 else None
        model, _ = hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(precision=precision, chunk_size_numel=300_000))
        measured[name], slots = _chunk_storage_bytes(model)
        if nf4:
            assert torch.equal(model(x), want)  # the same dequantized weights as torchao's F.linear
            assert all(s.name.endswith("parametrizations.weight.original") and s.param.dtype == torch.bfloat16
                       for s in slots)
    per_param = measured["nf4"] / numel
    assert measured["fp32"] == 4 * numel and measured["bf16"] == 2 * numel
    assert nf4_bytes_per_element(2) <= per_param <= nf4_bytes_per_element(2) + 4 * 16 / numel
    assert measured["nf4"] / measured["bf16"] == pytest.approx(0.258, abs=1e-3)
    assert measured["nf4"] / measured["fp32"] == pytest.approx(0.129, abs=1e-3)

    @dataclasses.dataclass
    class _Profile:  # the planner's view of these four frozen weights
        param_numels: list
        param_requires_grad: list

    priced = frozen_as_nf4(_Profile([256 * 256] * 4, [False] * 4), "bf16").param_numels
    assert 0 <= measured["nf4"] - 2 * sum(priced) <= 4 * 16
    assert nf4_packed_bytes(numel, 2) == pytest.approx(numel * nf4_bytes_per_element(2))


def test_trainable_nf4_parameter_is_refused_by_name():
    import hf_elixir
    from torchao.quantization import to_nf4

    model = _linear_stack(torch.float32, nf4=False)
    model[2].weight = torch.nn.Parameter(to_nf4(model[2].weight.detach()), requires_grad=True)
    with pytest.raises(ValueError, match=r"NF4 parameter '2.weight' has requires_grad=True.*requires_grad=False"):
        hf_elixir.prepare(model, None)


def test_nf4_blocks_that_do_not_divide_are_refused_by_name():
    """A hand-built NF4 tensor whose inner tensors do not match its block sizes (a layout the carrier would read
    wrongly) is refused, naming the parameter, the block sizes and the fix."""
    import hf_elixir

    model = _linear_stack(torch.float32, nf4=True)
    model[1].weight.block_size = 128  # inner tensors made for 64-element blocks
    with pytest.raises(ValueError, match=r"NF4 parameter '1.weight' .*block_size=128.*quantized_scalers of 1024 "
                                         r"elements where 512 are expected.*to_nf4\(weight, block_size"):
        hf_elixir.prepare(model, None)


def test_failed_prepare_leaves_the_nf4_parameters_in_place():
    """All or nothing: a prepare that fails after the NF4 weights became carriers puts the NF4 parameters back (same
    objects, no parametrization), and a fixed call then works."""
    import hf_elixir
    from torch.nn.utils import parametrize

    model = _linear_stack(torch.float32, nf4=True)
    before = [m.weight for m in model]
    with pytest.raises(ValueError, match="device_memory_budget_bytes"):
        hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(device_memory_budget_bytes=1000, chunk_size_numel=40_000))
    assert all(m.weight is w and not parametrize.is_parametrized(m) for m, w in zip(model, before))
    x = torch.randn(2, 256)
    want = model(x)
    model, _ = hf_elixir.prepare(model, None, hf_elixir.ElixirConfig(chunk_size_numel=40_000))
    assert torch.equal(model(x), want)


def test_min_budget_prices_the_packed_base():
    """``min_device_budget_bytes`` on the NF4 model (before ``prepare``) prices the packed bytes ``prepare`` stores:
    ``prepare`` accepts that budget, refuses one byte less, and the model is left with its NF4 parameters."""
    import dataclasses

    import hf_elixir
    from hf_elixir.chunk._nf4 import is_nf4

    config = hf_elixir.ElixirConfig(chunk_size_numel=16_384, budget_covers_activations=False)
    model = _qlora_model()
    floor = hf_elixir.min_device_budget_bytes(model, _adamw(model), config)
    assert sum(is_nf4(p) for p in model.parameters()) == 14
    with pytest.raises(ValueError, match="device_memory_budget_bytes"):
        hf_elixir.prepare(model, _adamw(model), dataclasses.replace(config, device_memory_budget_bytes=floor - 1))
    hf_elixir.prepare(model, _adamw(model), dataclasses.replace(config, device_memory_budget_bytes=floor))


def _codes_read_by_forward(model, names: list[str], steps: int) -> dict:
    """Train ``steps`` AdamW steps; the NF4 codes each named module read in the last forward."""
    seen = {}
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, _n=name: seen.__setitem__(_n, module.weight.quantized_data.clone()))
    opt = model._qlora_opt
    for step in range(steps):
        ids = _batch(step, ROWS)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("search", ["off", "auto"])
def test_nf4_codes_survive_bf16_training(search):
    """[Note: carriers in frozen chunks]: with bf16 compute the adapters' fp32 masters are cast back into their chunks
    at every step, which would turn packed bytes that read as NaN into bf16's one NaN; the carriers, as every frozen
    parameter, get chunks without trained parameters, so after three steps the base reads the same NF4 codes, also with a searched plan (whose
    packing splits the same way)."""
    import hf_elixir

    model = _qlora_model()
    want = {n.rpartition(".")[0]: p.quantized_data.clone() for n, p in model.named_parameters() if hasattr(p, "nf4")}
    ids = _batch(0, ROWS)
    config = hf_elixir.ElixirConfig(precision="bf16", device_memory_budget_bytes=300_000, chunk_size_numel=16_384,
                                    budget_covers_activations=False)
    if search == "auto":
        config = hf_elixir.ElixirConfig(precision="bf16", search="auto", device_memory_budget_bytes=2_000_000)
    model, model._qlora_opt = hf_elixir.prepare(model, _adamw(model), config,
                                                sample_batch=dict(input_ids=ids, labels=ids))
    manager = hf_elixir.get_state(model).manager
    for chunk in manager.chunks:
        carriers = [s.name.endswith(".parametrizations.weight.original") for s in chunk.slots]
        assert not (any(carriers) and chunk.trainable)  # frozen parameters only, no trained one
    seen = _codes_read_by_forward(model, list(want), steps=3)
    assert sorted(seen) == sorted(want) and all(torch.equal(seen[n], want[n]) for n in want)
    state = model.state_dict()  # the packed bytes, exported in bf16 (an fp32 round trip would rewrite NaN patterns),
    nf4 = {k.removesuffix(".weight"): v for k, v in state.items() if hasattr(v, "nf4")}  # read as torchao's NF4Tensor
    assert sorted(nf4) == sorted(want) and all(torch.equal(nf4[n].quantized_data, want[n]) for n in want)
    assert not any(".original" in k for k in state)
    model.load_state_dict(state)
    seen = _codes_read_by_forward(model, list(want), steps=1)
    assert all(torch.equal(seen[n], want[n]) for n in want)


def test_generate_and_adapters_off_match_peft():
    """Under an evicting budget, ``generate`` and peft's ``disable_adapter()`` (the reference model of DPO with
    ``ref_model=None``) read the NF4 base as plain PyTorch does."""
    import hf_elixir

    ref, model = _qlora_model(), _qlora_model()
    model, _ = hf_elixir.prepare(model, _adamw(model), hf_elixir.ElixirConfig(
        device_memory_budget_bytes=BUDGET_BYTES, chunk_size_numel=16_384, budget_covers_activations=False))
    ids = _batch(0, ROWS)[:, :4]
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=5, do_sample=False),
                       ref.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
    with model.disable_adapter(), ref.disable_adapter():
        assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    assert hf_elixir.memory_stats(model)["num_evictions"] > 0
