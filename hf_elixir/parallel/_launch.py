"""A launch of several processes that each see one: raise before each trains the whole model alone.

[Note: silent single-process runs] ``accelerate launch --num_processes 2 train.py`` on a machine without a GPU,
without ``--multi_gpu`` (or ``distributed_type: MULTI_GPU``) and without ``Accelerator(cpu=True)`` /
``ACCELERATE_USE_CPU=1``, starts two processes with ``WORLD_SIZE=2`` in their environment whose accelerators
report ``distributed_type=NO, num_processes=1``: no process group is made, so each process trains alone on its
batches, two identical independent runs, without a word. ``torchrun --nproc_per_node 2`` of a script that never
calls ``init_process_group`` does the same. The launcher's ``WORLD_SIZE`` (set by torchrun and ``accelerate
launch``) is what the user asked for; a process group (or an accelerator) of one beside it is the mistake, and
``prepare`` is the first place hf_elixir sees both.
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["check_launch_world_size"]

ACCELERATE_CPU_FIX = (
    "On a machine without a GPU, accelerate starts CPU processes that see each other only with `--multi_gpu` (or "
    "`distributed_type: MULTI_GPU` in the config file) together with `Accelerator(cpu=True)` in the script or "
    "ACCELERATE_USE_CPU=1 in the environment (the Trainer: TrainingArguments(use_cpu=True)), e.g. "
    "`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train.py`. With GPUs, give "
    "`--multi_gpu` and make CUDA_VISIBLE_DEVICES show one GPU per process.")


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def check_launch_world_size(num_processes: int | None = None, source: str = "hf_elixir.prepare") -> None:
    """Raise when the launch asked for several processes and this one sees only itself ([Note: silent
    single-process runs]).

    Args:
        num_processes: what the accelerator reports (``accelerator.num_processes``); ``None``: the default process
            group's size (1 when torch.distributed is not initialized).
        source: the call named in the error.

    Raises:
        ValueError: ``WORLD_SIZE`` > 1 in the environment and one process seen, naming the cause and the fix.
    """
    launched = _launched_world_size()
    if launched <= 1:
        return
    if num_processes is not None:
        if num_processes == 1:
            raise ValueError(
                f"{source}: the launcher started {launched} processes (WORLD_SIZE={launched}) but the accelerator "
                f"reports num_processes=1 (distributed_type=NO): each process would train the whole model alone, "
                f"{launched} identical independent runs. {ACCELERATE_CPU_FIX}")
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{source}: the launcher started {launched} processes (WORLD_SIZE={launched}) but torch.distributed is "
            "not initialized in this one, so each process would train the whole model alone. Call "
            "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPUs) before hf_elixir.prepare, or use "
            f"accelerate (ElixirPlugin / ElixirCallback). {ACCELERATE_CPU_FIX}")
    if dist.get_world_size() == 1:
        raise ValueError(
            f"{source}: the launcher started {launched} processes (WORLD_SIZE={launched}) but the default process "
            "group has 1 rank, so each process would train the whole model alone; initialise it with "
            f"world_size={launched} (torch.distributed.init_process_group reads WORLD_SIZE when it is not given)")
