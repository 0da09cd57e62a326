"""Host syncs in the training step's hot path are counted; one per optimizer step is the ceiling
(docs/design/rules.md, *The simulation is as strict as the hardware*; [Note: one host read] in
hf_elixir/optim/_step_read.py).

A ``TorchFunctionMode`` counts the calls that make the host wait for the device: ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()`` / ``float()`` / ``int()`` of a tensor, and blocking
device->host ``copy_``; ``torch.cuda.synchronize`` too; and an in-place op that writes a host buffer from a
device tensor (``host.add_(device)``: on CUDA that is a blocking ``.to("cpu")`` first, the old gradient
offload). The mode is thread-local: the host optimizer lane's worker thread waits for its copies off the
main thread ([Note: host lane] in hf_elixir/optim/_overlap.py), which is the point of it. On the simulated device a tensor is on the host
when it is (a view of) a registered host buffer ([Note: strict device]); reading such a tensor is free,
as it is on CUDA. Calls made from inside Triton's interpreter (it runs kernels on numpy copies) are the
stand-in for a kernel launch and are not counted.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest
import torch
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

import hf_elixir
from hf_elixir.chunk import strict
from hf_elixir.optim.optimizer import ElixirOptimizer
from tests._dist import run_distributed
from tests._models import batch, rank_batch, tiny_model, two_groups

STEPS = 3
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}
_BACKWARD = inspect.signature(torch.Tensor.backward)
_HOST_INPLACE = {torch.Tensor.add_, torch.Tensor.sub_, torch.Tensor.mul_, torch.Tensor.div_,
                 torch.Tensor.addcmul_, torch.Tensor.lerp_}


class SyncCounter(TorchFunctionMode):
    """Counts host syncs (see the module docstring); ``where`` names the caller of each."""

    active: list["SyncCounter"] = []  # counters entered, innermost last (see see_inside_pack_hooks)

    def __init__(self, host_to_device: bool = False) -> None:
        super().__init__()
        self.where: list[str] = []
        # also count blocking host->device ``copy_`` (on CUDA ``memcpy_and_sync``: the host waits for the stream)
        self.host_to_device = host_to_device

    def __enter__(self):
        SyncCounter.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        SyncCounter.active.pop()
        return super().__exit__(*exc)

    def _backward(self, args, kwargs) -> None:
        """``Tensor.backward`` with the mode active inside: a mode is off while its own handler runs, so
        calling ``func`` would hide every hook of the backward (gradient reduce and offload) from it."""
        bound = _BACKWARD.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        loss = a["self"]
        grad = a["gradient"] if a["gradient"] is not None else torch.ones_like(loss)
        keep = a["retain_graph"] if a["retain_graph"] is not None else a["create_graph"]
        with self:
            _engine_run_backward((loss,), (grad,), keep, a["create_graph"], tuple(a["inputs"] or ()),
                                 allow_unreachable=True, accumulate_grad=True)

    def _caller(self) -> str | None:
        """``module:line`` of the caller and the names of the functions above it; ``None`` inside Triton."""
        frame = sys._getframe(2)
        module = frame.f_globals.get("__name__", "")
        if module.startswith("triton"):
            return None
        where, chain = f"{module}:{frame.f_lineno}", []
        while frame is not None and len(chain) < 8:
            chain.append(frame.f_code.co_name)
            frame = frame.f_back
        return f"{where} in {'<'.join(chain)}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            return self._backward(args, kwargs)
        sync = False
        if func in _READS and isinstance(args[0], torch.Tensor) and not strict.is_host(args[0]):
            sync = True
        elif func is torch.Tensor.copy_ and strict.is_host(args[0]) and not strict.is_host(args[1]):
            sync = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
        elif (func is torch.Tensor.copy_ and self.host_to_device and isinstance(args[1], torch.Tensor)
              and strict.is_host(args[1]) and not strict.is_host(args[0])):
            sync = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
        elif func in _HOST_INPLACE and isinstance(args[0], torch.Tensor) and strict.is_host(args[0]):
            sync = any(isinstance(a, torch.Tensor) and a.numel() > 1 and not strict.is_host(a) for a in args[1:])
        if sync:
            caller = self._caller()
            if caller is not None:
                self.where.append(f"{func.__name__} at {caller}")
        return func(*args, **kwargs)


def see_inside_pack_hooks(monkeypatch) -> None:
    """Make the counter see the pack hooks of ``saved_tensors_hooks`` (activation offload copies): autograd
    calls them inside the op that saves a tensor, i.e. inside the counter's own handler, where a mode is off;
    each pack hook is wrapped to re-enter the innermost active counter."""
    init = torch.autograd.graph.saved_tensors_hooks.__init__

    def patched(self, pack_hook, unpack_hook):
        def pack(tensor):
            if not SyncCounter.active:
                return pack_hook(tensor)
            with SyncCounter.active[-1]:
                return pack_hook(tensor)

        init(self, pack, unpack_hook)

    monkeypatch.setattr(torch.autograd.graph.saved_tensors_hooks, "__init__", patched)


def _train(model, opt, batches, max_norm: float) -> list[list[str]]:
    """Run the steps; the syncs of each step after the first (warm-up builds tables once)."""
    per_step = []
    for b in batches:
        counter = SyncCounter()
        with counter:
            opt.backward(model(**b).loss)
            opt.clip_grad_norm(max_norm)
            opt.step()
            opt.zero_grad()
        per_step.append(counter.where)
    return per_step[1:]


def _check(per_step: list[list[str]]) -> None:
    for i, where in enumerate(per_step):  # forward, backward, clipping, step and zero_grad together
        assert len(where) <= 1, f"step {i + 1}: {len(where)} host syncs per optimizer step: {where}"
    assert any(per_step), "the step's one host read was not seen: is the counter blind?"


@pytest.mark.parametrize("precision,fused", [("fp32", False), ("fp16", False), ("fp16", True)])
def test_one_host_sync_per_step_on_one_rank(single_rank_group, monkeypatch, precision, fused):
    monkeypatch.setattr(ElixirOptimizer, "_force_fused", fused)  # the Triton kernels under the interpreter
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(precision=precision, chunk_size_numel=4096))
    assert bool(opt.fused_chunks) == fused
    _check(_train(model, opt, [batch("gpt2", s, 2) for s in range(STEPS)], max_norm=0.05))


def _worker(rank: int, world_size: int, precision: str, offload: bool = False, placement: str = "sharded"):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(two_groups(model), lr=1e-3)
    model, opt = hf_elixir.prepare(model, opt, hf_elixir.ElixirConfig(
        precision=precision, chunk_size_numel=4096, default_placement=placement, offload_optimizer=offload))
    if offload:
        assert opt._lane is not None and opt._lane.host_chunks, "the optimizer state must be on the host"
    return _train(model, opt, [rank_batch("gpt2", s, rank, world_size, 2) for s in range(STEPS)], max_norm=0.05)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_host_sync_per_step_on_two_ranks(precision):
    for per_step in run_distributed(_worker, 2, precision, timeout_s=300):
        _check(per_step)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_host_sync_per_step_with_the_optimizer_on_the_host_one_rank(single_rank_group, precision):
    """Offloaded optimizer: gradient shards reach the host by non-blocking copies ([Note: gradient
    offload] in hf_elixir/chunk/_grad_shards.py), the host step runs on the host lane."""
    _check(_worker(0, 1, precision, True))


@pytest.mark.parametrize("placement", ["sharded", "replicated"])
def test_one_host_sync_per_step_with_the_optimizer_on_the_host_two_ranks(placement):
    for per_step in run_distributed(_worker, 2, "fp32", True, placement, timeout_s=300):
        _check(per_step)


def test_a_gradient_spill_is_no_host_sync(single_rank_group):
    """[Note: gradient spill] in hf_elixir/chunk/_grad_buffers.py: tiny OPT in bf16 at its floor spills a partial
    gradient buffer to the host in every backward and restores it; both copies are non-blocking (the blocking ones
    counted a device->host and a host->device sync per spill). Counted here with blocking host->device copies too."""
    model = tiny_model("opt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = hf_elixir.ElixirConfig(precision="bf16", chunk_size_numel=4096, budget_covers_activations=False)
    need = hf_elixir.min_device_budget_bytes(model, opt, config)
    model, opt = hf_elixir.prepare(model, opt, dataclasses.replace(config, device_memory_budget_bytes=need))
    per_step, spills = [], []
    for step in range(STEPS):
        before = opt.manager.num_grad_spills
        counter = SyncCounter(host_to_device=True)
        with counter:
            opt.backward(model(**batch("opt", step, 2)).loss)
            opt.step()
            opt.zero_grad()
        per_step.append(counter.where)
        spills.append(opt.manager.num_grad_spills - before)
    assert all(n > 0 for n in spills), f"no spill in some step: {spills}"
    _check(per_step)


def test_counter_sees_the_old_per_chunk_reads():
    """The counter is not blind: a per-chunk ``.cpu()`` and a ``float()`` of a device norm count."""
    counter = SyncCounter()
    grads = [torch.ones(3), torch.ones(4)]
    with counter:
        local = sum(g.norm().cpu() for g in grads)
        float(local)
        strict.to_host(torch.ones(2)).tolist()  # reading a host copy is free; making it is the sync
    assert len(counter.where) == 4, counter.where


def test_counter_sees_inside_backward():
    """Hooks that run during ``backward`` (where gradients are reduced and offloaded) are counted too."""
    param = torch.nn.Parameter(torch.ones(3))
    host = strict.register_host(torch.zeros(3))

    def offload(p: torch.Tensor) -> None:
        host.add_(p.grad * 1.0)  # a device gradient added into a host buffer: a blocking copy on CUDA

    param.register_post_accumulate_grad_hook(offload)
    counter = SyncCounter()
    with counter:
        (param * 2).sum().backward()
    assert len(counter.where) == 1 and "add_" in counter.where[0], counter.where


def test_counter_sees_inside_pack_hooks(monkeypatch):
    """A blocking device->host copy in a saved-tensor pack hook (an activation offload) counts once
    :func:`see_inside_pack_hooks` is on."""
    see_inside_pack_hooks(monkeypatch)
    x = torch.ones(3, requires_grad=True)
    counter = SyncCounter()
    with counter, torch.autograd.graph.saved_tensors_hooks(strict.to_host, lambda t: t):
        x.sin()  # saves its input once
    assert len(counter.where) == 1 and "to_host" in counter.where[0], counter.where
