"""Tests do not leak Accelerate's process-wide state into each other (conftest's ``_reset_accelerate_state``).

The two tests run in file order: the first leaves ``AcceleratorState`` with ``mixed_precision="bf16"``, as a
``Trainer(bf16=True)`` does; the second builds ``Accelerator(cpu=True)`` and must get full precision, as it would
in a fresh process (without the reset it got ``bf16``, which turned an fp32-vs-PyTorch parity test in
tests/test_loud_failures.py into a bf16 one when it ran after tests/test_trainer_callback.py).
"""

from __future__ import annotations


def test_a_bf16_accelerator_leaves_its_state_behind():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True, mixed_precision="bf16")
    assert AcceleratorState().mixed_precision == "bf16"


def test_b_next_accelerator_starts_from_a_fresh_state():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.mixed_precision == "no"
    assert not accelerator.native_amp
