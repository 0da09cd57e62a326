"""Python garbage a training step leaves: no more reference cycles than plain PyTorch, a handful of objects per hooked
module call (each makes the interpreter collect sooner; a full collection costs ~0.2 s on a large heap)."""

from __future__ import annotations

import torch

import hf_elixir
from tests._models import batch, tiny_model
from tests.test_core_features import _prepare, _train_elixir


def _cyclic_garbage_of_one_step(model, opt, b) -> int:
    import gc

    for _ in range(2):  # warm-up: first steps build caches
        opt.zero_grad()
        model(**b).loss.backward()
        opt.step()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        opt.zero_grad()
        model(**b).loss.backward()
        opt.step()
        gc.collect()
        return len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_a_training_step_leaves_no_more_cyclic_garbage_than_plain_pytorch():
    """Reference cycles made every step (e.g. torch's Python tree_flatten closure in a module hook)
    make the interpreter run full garbage collections, ~0.2 s each on a large heap, every ~100 steps."""
    b = batch("gpt2", 0, 2)
    ref = tiny_model("gpt2")
    plain = _cyclic_garbage_of_one_step(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), b)
    model, opt = _prepare(tiny_model("gpt2"))
    assert _cyclic_garbage_of_one_step(model, opt, b) <= plain


def test_forward_hooks_allocate_few_python_objects_per_module():
    """Every module call's hooks allocate Python objects that live until backward; many of them make the
    interpreter collect garbage every step and run a full (~0.2 s on a large heap) collection every
    ~100 steps. One tensor hook per single-output module keeps it to a handful per module call
    (``register_multi_grad_hook`` alone made ~14)."""
    import gc

    model, opt = _prepare(tiny_model("gpt2"))
    b = batch("gpt2", 0, 2)
    _train_elixir(model, opt, [[b], [b]])
    units = len(hf_elixir.api.get_state(model).handles)
    kinds = {"function", "method", "partial", "cell", "dict", "OrderedDict", "defaultdict", "tuple", "list", "lock"}
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        loss = model(**b).loss
        new = [o for o in gc.get_objects() if id(o) not in before and type(o).__name__ in kinds]
    finally:
        gc.enable()
    loss.backward()
    opt.zero_grad()
    assert len(new) <= 6 * units, f"{len(new)} Python objects for {units} hooked modules"
