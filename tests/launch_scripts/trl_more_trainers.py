"""More TRL trainers (RLOO, KTO, distillation, TRL's experimental ones) with and without ElixirCallback, on the tiny
Llama, tokenizer, data and budget of ``trl_trainers.py``: ``python trl_more_trainers.py OUT CASE [CASE ...]`` (or under
torchrun; the repository on ``PYTHONPATH``) writes ``OUT/CASE.json`` on rank 0 as that script does, with the gradient
norms, how far training moved the weights and, where TRL syncs a reference or teacher from the trained model between
steps, that model's distance too."""

from __future__ import annotations

import os
import sys

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from hf_elixir import ElixirConfig
from tests.launch_scripts import trl_trainers as base
from tests.launch_scripts.trl_trainers import common, llama, lora, preference, sentences, tokenizer


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _saved(out: str, model, name: str = "base", processing_class=None) -> str:
    """``model`` (and ``processing_class``) saved where every rank reads it (rank 0 writes once the process group
    exists): TRL loads references, teachers and their tokenizers from such a folder itself."""
    if torch.distributed.is_initialized():
        path = os.path.join(os.path.dirname(out), name)
        if torch.distributed.get_rank() == 0 and processing_class is not None:
            processing_class.save_pretrained(path)
        model.save_pretrained(path)
        torch.distributed.barrier()
    else:
        path = os.path.join(os.path.dirname(out), f"{name}-{os.environ.get('RANK', '0')}")
        model.save_pretrained(path)
        if processing_class is not None:
            processing_class.save_pretrained(path)
    return path


def reward_len(completions, **kwargs):  # a reward function: shorter completions score higher
    return [-float(len(c)) for c in completions]


def rloo(case: str, out: str, callbacks: list):
    from trl import RLOOConfig, RLOOTrainer

    sync = dict(sync_ref_model=True, ref_model_sync_steps=1) if case == "rloo_sync" else {}  # TR-DPO-style sync
    args = RLOOConfig(**common(out), num_generations=2, max_completion_length=6, generation_batch_size=2 * _world(),
                      **sync)
    return RLOOTrainer(model=LlamaForCausalLM.from_pretrained(_saved(out, llama())), reward_funcs=reward_len, args=args,
                       train_dataset=Dataset.from_dict({"prompt": sentences(16, 1)}), processing_class=tokenizer(),
                       callbacks=callbacks)


def kto(case: str, out: str, callbacks: list):
    from trl import KTOConfig, KTOTrainer

    data = Dataset.from_dict({"prompt": sentences(16, 1), "completion": sentences(16, 2),
                              "label": [i % 3 != 0 for i in range(16)]})
    peft = case == "kto_lora"  # no ref_model: the reference is the policy with its adapters off
    args = KTOConfig(**common(out), max_length=24)
    return KTOTrainer(model=llama(), ref_model=None if peft else llama(), args=args, train_dataset=data,
                      processing_class=tokenizer(), callbacks=callbacks, peft_config=lora() if peft else None)


def teacher():
    cfg = llama().config  # a wider teacher with the student's vocabulary
    cfg.hidden_size, cfg.intermediate_size = 48, 96
    torch.manual_seed(1)
    return LlamaForCausalLM(cfg)


def distillation(case: str, out: str, callbacks: list):
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(**common(out), max_completion_length=6)
    return DistillationTrainer(model=llama(), teacher_model=teacher(), args=args,
                               train_dataset=Dataset.from_dict({"prompt": sentences(16, 1)}),
                               processing_class=tokenizer(), callbacks=callbacks,
                               peft_config=lora() if case == "distillation_lora" else None)


def chats() -> Dataset:
    return Dataset.from_dict({"messages": [[{"role": "user", "content": a}, {"role": "assistant", "content": b}]
                                           for a, b in zip(sentences(16, 1), sentences(16, 2))]})


def gkd(case: str, out: str, callbacks: list):
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    args = GKDConfig(**common(out), max_length=24, max_new_tokens=6)
    return GKDTrainer(model=llama(), teacher_model=teacher(), args=args, train_dataset=chats(),
                      processing_class=tokenizer(), callbacks=callbacks)


def orpo(case: str, out: str, callbacks: list):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    args = ORPOConfig(**common(out), max_length=24)
    return ORPOTrainer(model=llama(), args=args, train_dataset=preference(), processing_class=tokenizer(),
                       callbacks=callbacks)


def cpo(case: str, out: str, callbacks: list):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(**common(out), max_length=24)
    return CPOTrainer(model=llama(), args=args, train_dataset=preference(), processing_class=tokenizer(),
                      callbacks=callbacks)


def online_dpo(case: str, out: str, callbacks: list):
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    args = OnlineDPOConfig(**common(out), max_new_tokens=6, max_length=24)
    return OnlineDPOTrainer(model=llama(), ref_model=llama(), reward_funcs=reward_len, args=args,
                            train_dataset=Dataset.from_dict({"prompt": sentences(16, 1)}),
                            processing_class=tokenizer(), callbacks=callbacks)


def tpo(case: str, out: str, callbacks: list):
    from trl.experimental.tpo import TPOConfig, TPOTrainer

    data = preference().add_column("reference", sentences(16, 4))
    args = TPOConfig(**common(out), max_length=24)
    return TPOTrainer(model=llama(), args=args, train_dataset=data, processing_class=tokenizer(), callbacks=callbacks)


def gmpo(case: str, out: str, callbacks: list):
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    args = GMPOConfig(**common(out), num_generations=2, max_completion_length=6, generation_batch_size=2 * _world())
    return GMPOTrainer(model=LlamaForCausalLM.from_pretrained(_saved(out, llama())), reward_funcs=reward_len, args=args,
                       train_dataset=Dataset.from_dict({"prompt": sentences(16, 1)}), processing_class=tokenizer(),
                       callbacks=callbacks)


def a2po(case: str, out: str, callbacks: list):
    from trl.experimental.a2po import A2POConfig, A2POTrainer

    args = A2POConfig(**common(out), max_completion_length=6)
    return A2POTrainer(model=llama(), reward_funcs=reward_len, args=args,
                       train_dataset=Dataset.from_dict({"prompt": sentences(16, 1)}), processing_class=tokenizer(),
                       callbacks=callbacks)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (as Llama 3's, Qwen's) trained offline on the word list: GOLD aligns tokens by byte offsets."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<unk>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(sentences(64, 9), bpe)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = tokenizer().chat_template
    return tok


def _with_vocab(model, vocab_size: int):
    cfg = model.config
    cfg.vocab_size = vocab_size
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def gold(case: str, out: str, callbacks: list):
    from trl.experimental.gold import GOLDConfig, GOLDTrainer

    tok = byte_level_tokenizer()
    args = GOLDConfig(**common(out), max_length=24, max_completion_length=6)
    return GOLDTrainer(model=_with_vocab(llama(), len(tok)), teacher_model=_with_vocab(teacher(), len(tok)), args=args,
                       train_dataset=chats(), processing_class=tok, callbacks=callbacks)


def iw_opd(case: str, out: str, callbacks: list):
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    # the teacher comes from a folder: IWOPD checks its tokenizer (loaded from there) against the student's
    teacher_path = _saved(out, teacher(), "teacher", tokenizer())
    args = IWOPDConfig(**common(out), max_length=24, max_completion_length=6)
    return IWOPDTrainer(model=llama(), teacher_model=LlamaForCausalLM.from_pretrained(teacher_path), args=args,
                        train_dataset=chats(), processing_class=tokenizer(), callbacks=callbacks)


def privileged() -> Dataset:
    return Dataset.from_dict({"prompt": sentences(16, 1), "privileged_context": sentences(16, 2)})


def sdft(case: str, out: str, callbacks: list):
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    args = SDFTConfig(**common(out), max_completion_length=6, num_generations=2, generation_batch_size=2 * _world(),
                      distillation_topk=8)
    return SDFTTrainer(model=LlamaForCausalLM.from_pretrained(_saved(out, llama())), args=args,
                       train_dataset=privileged(), processing_class=tokenizer(), callbacks=callbacks)


def sdpo(case: str, out: str, callbacks: list):
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    # the default teacher is an EMA of the student, synced after every step ([Note: reference and teacher syncs
    # between steps] in hf_elixir/integrations/_target_sync.py); a completion of <= 10 characters is a demonstration
    args = SDPOConfig(**common(out), max_completion_length=6, num_generations=2, generation_batch_size=2 * _world(),
                      success_reward_threshold=-10.0)
    return SDPOTrainer(model=LlamaForCausalLM.from_pretrained(_saved(out, llama())), reward_funcs=reward_len,
                       args=args, train_dataset=privileged(), processing_class=tokenizer(), callbacks=callbacks)


MORE = {"rloo": rloo, "rloo_sync": rloo, "kto": kto, "kto_lora": kto, "distillation": distillation,
        "distillation_lora": distillation, "gkd": gkd, "gold": gold, "iw_opd": iw_opd, "orpo": orpo, "cpo": cpo,
        "online_dpo": online_dpo, "tpo": tpo, "gmpo": gmpo, "a2po": a2po, "sdft": sdft, "sdpo": sdpo}


#: a 300-token vocabulary (9600-element embedding) takes larger chunks; still under its fp32 weights and gradients
BUDGETS = {"gold": ElixirConfig(device_memory_budget_bytes=190_000, budget_covers_activations=False,
                                chunk_size_numel=10240)}


def _rel_l2(got: dict, want: dict) -> float:
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want)
    den = sum(float(want[k].double().norm() ** 2) for k in want)
    return (num / den) ** 0.5


def _synced(trainer):
    """The model TRL keeps in step with the trained one between steps (reference or teacher), if any."""
    if getattr(trainer.args, "sync_ref_model", False):
        return trainer.ref_model
    if getattr(trainer.args, "teacher_model_kind", None) == "ema":
        return trainer.teacher_model
    return None


def run(case: str, out: str) -> dict:
    """Both runs of ``case``: losses and gradient norms step by step, the distance of the final weights (and of a
    reference / teacher that TRL syncs from the trained model), how far training moved the weights."""
    def logged(trainer, key):
        return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]

    el = MORE[case](case, os.path.join(out, case, "elixir"), [base.ElixirCallback(BUDGETS.get(case, base.BUDGET))])
    el.train()
    evictions = base.memory_stats(el.model)["num_evictions"]
    ref = MORE[case](case, os.path.join(out, case, "ref"), [])
    init = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    target_init = {k: v.detach().clone() for k, v in _synced(ref).state_dict().items()} if _synced(ref) else None
    ref.train()
    got, want = el.accelerator.get_state_dict(el.model), ref.accelerator.get_state_dict(ref.model)
    result = dict(losses=logged(el, "loss"), ref_losses=logged(ref, "loss"), grad_norms=logged(el, "grad_norm"),
                  ref_grad_norms=logged(ref, "grad_norm"), rel_l2=_rel_l2(got, want), moved=_rel_l2(want, init),
                  evictions=evictions, world=int(os.environ.get("WORLD_SIZE", "1")), keys=sorted(got) == sorted(want))
    if target_init is not None:
        target = _synced(ref).state_dict()
        result.update(target_rel_l2=_rel_l2(_synced(el).state_dict(), target),
                      target_moved=_rel_l2(target, target_init))
    return result


def main(out: str, cases: list[str]) -> None:
    base.run_cases(out, cases, run)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
