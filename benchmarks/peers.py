"""The systems a user would pick instead of hf_elixir, each behind the same small interface.

A :class:`Peer` knows how to start ``torch.distributed`` for itself and how to wrap a freshly built
``GPT2LMHeadModel`` (fp32, on the CPU) into a :class:`Runner` whose ``step(input_ids)`` does one
full training step (forward, backward, AdamW update, zero grads) and returns the loss.

Peers (``PEERS`` keys):

- ``plain``: one process, ``torch.optim.AdamW`` (the speed reference); ``ddp``: the same under
  ``DistributedDataParallel`` (2 ranks).
- ``fsdp2`` / ``fsdp2_offload``: ``torch.distributed.fsdp.fully_shard`` on every ``GPT2Block`` and
  the root, without / with ``CPUOffloadPolicy(pin_memory=False)`` (pinning needs an accelerator).
- ``ds_zero2_offload`` / ``ds_zero3_offload``: DeepSpeed ZeRO-2 with the optimizer offloaded and
  ZeRO-3 with optimizer and parameters offloaded, ``DeepSpeedCPUAdam``, ``DS_ACCELERATOR=cpu``.
- ``elixir_resident`` / ``elixir_budget`` / ``elixir_search`` / ``elixir_min``: hf_elixir with
  everything resident; with ``device_memory_budget_bytes = options["budget_fraction"] x
  (everything-resident peak)`` and the core's heuristic placement, or the plan
  ``hf_elixir.search.auto_plan`` finds; and with the smallest budget that runs (see
  ``benchmarks/_elixir.py``). ``elixir_resident`` uses ``default_placement="auto"`` (replicated when
  everything fits, at 2 ranks); ``elixir_resident_sharded`` forces ZeRO-3 sharding with everything
  resident; ``elixir_search_sharded`` is the searched 50% budget plan restricted to ZeRO-3 sharding (gather
  prefetch where the search chooses it); ``elixir_budget_replicated`` is the 50% budget with ``default_placement="replicated"``
  (whole parameters on the device, optimizer states on the host, gradients all-reduced).

Every peer uses AdamW with the same hyper-parameters (lr from the spec, betas (0.9, 0.999), eps 1e-8,
weight decay 0), no gradient clipping, fp32.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from benchmarks._runner import ADAM_KW, Runner

__all__ = ["Peer", "Runner", "PEERS", "peer_available", "deepspeed_engine", "simple_step"]


@dataclass(frozen=True)
class Peer:
    """How to run one system.

    Attributes:
        name: ``PEERS`` key. label: the name in tables. world_sizes: the ranks it is run at.
        setup: ``(model, spec, rank) -> Runner``. needs: importable module it requires.
        deepspeed: start torch.distributed through ``deepspeed.init_distributed``.
        offloads: moves parameters/gradients/optimizer state between host and device by design.
    """

    name: str
    label: str
    world_sizes: tuple[int, ...]
    setup: Callable[..., Runner]
    needs: str = ""
    deepspeed: bool = False
    offloads: str = ""

    def init_distributed(self, spec) -> None:
        import torch.distributed as dist

        cuda = spec.device.startswith("cuda")
        if self.deepspeed:  # DeepSpeed adopts an already-initialised world group
            if not cuda:
                os.environ["DS_ACCELERATOR"] = "cpu"
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        elif not dist.is_initialized() and (spec.world_size > 1 or self.name != "plain"):
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
            dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=spec.world_size)


def peer_available(peer: Peer) -> str:
    """'' if ``peer`` can run here, else why not."""
    if peer.needs and importlib.util.find_spec(peer.needs) is None:
        return f"python package {peer.needs!r} is not installed"
    return ""


def simple_step(model, optimizer, backward=None):
    """``step(input_ids) -> loss``: forward with ``labels=input_ids``, backward, ``optimizer.step()``, zero grads."""
    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        (backward or (lambda l: l.backward()))(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


# -- plain PyTorch / DDP -------------------------------------------------------------------------


def _setup_plain(model, spec, rank) -> Runner:
    model.to(spec.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM_KW)
    return Runner(simple_step(model, optimizer))


def _setup_ddp(model, spec, rank) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    model.to(spec.device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if spec.device.startswith("cuda") else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=spec.lr, **ADAM_KW)
    return Runner(simple_step(ddp, optimizer))


# -- FSDP2 ---------------------------------------------------------------------------------------


def _setup_fsdp2(model, spec, rank, offload: bool = False) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    cuda = spec.device.startswith("cuda")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (spec.world_size,))
    # pin_memory=True (the default) needs an accelerator; on CPU it fails, so it is off there
    policy = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()
    model.to(spec.device)
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.decoder.layers  # GPT-2 / OPT
    for block in blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM_KW)
    return Runner(simple_step(model, optimizer))


def _setup_fsdp2_offload(model, spec, rank) -> Runner:
    return _setup_fsdp2(model, spec, rank, offload=True)


# -- DeepSpeed -----------------------------------------------------------------------------------


def deepspeed_engine(model, spec, stage: int, gradient_clipping: float = 0.0):
    """``deepspeed.initialize`` with ``DeepSpeedCPUAdam`` (AdamW mode) over the parameters that train, the optimizer
    (and at stage 3 the parameters) offloaded to the host, fp32; returns the engine."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    pin = spec.device.startswith("cuda")
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    config = {"train_micro_batch_size_per_gpu": spec.model.batch_size, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "fp16": {"enabled": False}, "bf16": {"enabled": False},
              "gradient_clipping": gradient_clipping, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = DeepSpeedCPUAdam(trained, lr=spec.lr, adamw_mode=True, **ADAM_KW)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _setup_deepspeed(model, spec, rank, stage: int) -> Runner:
    engine = deepspeed_engine(model, spec, stage)

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return Runner(step)


def _setup_ds_zero2(model, spec, rank) -> Runner:
    return _setup_deepspeed(model, spec, rank, stage=2)


def _setup_ds_zero3(model, spec, rank) -> Runner:
    return _setup_deepspeed(model, spec, rank, stage=3)


# -- hf_elixir -----------------------------------------------------------------------------------


def _setup_elixir(model, spec, rank) -> Runner:
    from benchmarks._elixir import setup_elixir

    return setup_elixir(model, spec, rank)


PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("plain", "PyTorch (1 proc)", (1,), _setup_plain),
    Peer("ddp", "PyTorch DDP", (2,), _setup_ddp),
    Peer("fsdp2", "FSDP2", (1, 2), _setup_fsdp2),
    Peer("fsdp2_offload", "FSDP2 + CPUOffload", (1, 2), _setup_fsdp2_offload, offloads="params+grads+optim"),
    Peer("ds_zero2_offload", "DeepSpeed ZeRO-2 + opt offload", (1, 2), _setup_ds_zero2, needs="deepspeed",
         deepspeed=True, offloads="grads+optim"),
    Peer("ds_zero3_offload", "DeepSpeed ZeRO-3 + opt+param offload", (1, 2), _setup_ds_zero3,
         needs="deepspeed", deepspeed=True, offloads="params+grads+optim"),
    Peer("elixir_resident", "hf_elixir (all resident)", (1, 2), _setup_elixir),
    Peer("elixir_resident_sharded", "hf_elixir (all resident, forced sharded)", (2,), _setup_elixir),
    Peer("elixir_budget", "hf_elixir (50% budget, heuristic)", (1, 2), _setup_elixir, offloads="planned"),
    Peer("elixir_search", "hf_elixir (50% budget, searched plan)", (1, 2), _setup_elixir, offloads="planned"),
    Peer("elixir_min", "hf_elixir (smallest budget)", (1, 2), _setup_elixir, offloads="planned"),
    Peer("elixir_budget_replicated", "hf_elixir (50% budget, replicated + host optimizer)", (2,), _setup_elixir,
         offloads="planned"),
    Peer("elixir_search_sharded", "hf_elixir (50% budget, searched plan, sharded only)", (2,), _setup_elixir,
         offloads="planned"),
]}
