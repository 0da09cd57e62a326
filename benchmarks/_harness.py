"""Launch one benchmark peer as its own spawned process group and measure a few training steps.

Each call to :func:`launch` starts ``world_size`` fresh processes (``torch.multiprocessing`` with the
``spawn`` start method, a free TCP port for the gloo rendezvous), so no peer inherits another's
allocator state, hooks or threads. Every rank:

1. redirects its stdout/stderr to ``<work_dir>/<key>_rank<R>.log`` (``RunSpec.key()``: peer, world size and
   tag; DeepSpeed is chatty);
2. initialises ``torch.distributed`` with gloo (DeepSpeed peers through
   ``deepspeed.init_distributed(dist_backend="gloo")``);
3. builds the same model (``ModelSpec.family``: GPT-2 by default, OPT, Mixtral or Mistral; fp32, seed 0)
   and hands it to the peer's ``setup`` (see ``benchmarks/peers.py``), which returns a
   ``step(batch) -> loss`` callable;
4. runs ``warmup_steps`` untimed and ``steps`` timed steps on random token ids (a different stream
   per rank), with a barrier before each timed step so a step's time is the slowest rank's time;
5. writes a JSON record (step times in seconds, the process CPU seconds of each timed step, peak RSS in
   bytes, the peer's extra stats) that the parent reads back.

CPU time per step (``time.process_time`` around the step: every thread of the rank, gloo's included) is far
less sensitive to other jobs on a shared machine than wall-clock time, which also counts the time the rank
waits for a core; ``RunResult.cpu_median_s`` gives its median per rank.

Peak host RSS is the kernel's high-water mark for the rank's process (``getrusage(RUSAGE_SELF)
.ru_maxrss``, which catches short spikes that sampling would miss); the RSS just before the model is
built (``psutil``) is recorded too, so the model's own footprint is ``peak - baseline``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelSpec", "RunSpec", "RunResult", "launch", "launch_group", "free_port", "gpt2_config", "build_model",
           "count_params", "make_batches", "FAMILIES"]

#: ``ModelSpec.family`` values
FAMILIES = ("gpt2", "opt", "mixtral", "mistral")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder shape plus the batch every peer trains on.

    ``family``: ``"gpt2"`` (``GPT2LMHeadModel``), ``"opt"`` (``OPTForCausalLM``, ffn = 4 x n_embd),
    ``"mixtral"`` (``MixtralForCausalLM``: every layer's MLP is ``num_experts`` SwiGLU experts of width
    ``intermediate_size``, ``experts_per_tok`` of them per token, router auxiliary loss in the loss) or
    ``"mistral"`` (``MistralForCausalLM``: one dense SwiGLU MLP of width ``intermediate_size``). The
    Mixtral/Mistral fields map onto the configs as ``n_embd`` -> ``hidden_size``, ``n_layer`` ->
    ``num_hidden_layers``, ``n_head`` -> ``num_attention_heads``, ``n_kv_head`` -> ``num_key_value_heads``,
    ``n_positions`` -> ``max_position_embeddings``.

    ``batch_size`` is per rank; ``seq_len`` <= ``n_positions``.

    Raises:
        ValueError: an unknown family, ``seq_len > n_positions``, a width not divisible by the heads, or
            Mixtral/Mistral fields that do not fit the family (each message names the field and value).
    """

    family: str = "gpt2"  # "gpt2", "opt", "mixtral" or "mistral"
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 2048  # small next to the blocks, so the model packs into several chunks
    n_positions: int = 128
    batch_size: int = 4
    seq_len: int = 128
    word_embed_proj_dim: int = 0  # OPT only: embedding width projected to n_embd (0 = n_embd, no projection)
    layer_norm_before: bool = True  # OPT only: pre-LN (False: OPT-350m's post-LN)
    n_kv_head: int = 0  # Mixtral/Mistral: key/value heads (0 = n_head, no grouped-query attention)
    intermediate_size: int = 0  # Mixtral: one expert's MLP width; Mistral: the dense MLP width (required for both)
    num_experts: int = 0  # Mixtral only: experts per layer (num_local_experts)
    experts_per_tok: int = 0  # Mixtral only: experts each token is routed to (top-k)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ModelSpec.family={self.family!r} must be one of {', '.join(map(repr, FAMILIES))}")
        if self.seq_len > self.n_positions:
            raise ValueError(f"ModelSpec.seq_len={self.seq_len} exceeds n_positions={self.n_positions}")
        if self.n_embd % self.n_head:
            raise ValueError(f"ModelSpec.n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.family in ("mixtral", "mistral"):
            self._check_mistral_fields()
        elif self.num_experts or self.experts_per_tok or self.intermediate_size or self.n_kv_head:
            raise ValueError(f"ModelSpec.family={self.family!r} takes no n_kv_head / intermediate_size / num_experts / "
                             "experts_per_tok (Mixtral/Mistral fields); leave them 0")

    def _check_mistral_fields(self) -> None:
        if self.intermediate_size <= 0:
            raise ValueError(f"ModelSpec.intermediate_size={self.intermediate_size}: family {self.family!r} needs the "
                             "MLP width (Mixtral: one expert's), e.g. intermediate_size=2 * n_embd")
        if self.n_kv_head and self.n_head % self.n_kv_head:
            raise ValueError(f"ModelSpec.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.family == "mistral" and (self.num_experts or self.experts_per_tok):
            raise ValueError(f"ModelSpec.num_experts={self.num_experts}, experts_per_tok={self.experts_per_tok}: a "
                             "dense 'mistral' has no experts; use family='mixtral' or leave them 0")
        if self.family == "mixtral" and not 1 <= self.experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelSpec.experts_per_tok={self.experts_per_tok} must be in [1, num_experts="
                             f"{self.num_experts}] for family 'mixtral' (e.g. num_experts=8, experts_per_tok=2)")

    def label(self) -> str:
        name = {"gpt2": "GPT-2", "opt": "OPT", "mixtral": "Mixtral", "mistral": "Mistral"}[self.family]
        shape = f"{name} L={self.n_layer} d={self.n_embd} h={self.n_head}"
        if self.family == "mixtral":
            shape += f" experts={self.num_experts} top-{self.experts_per_tok} ffn={self.intermediate_size}/expert"
        elif self.family == "mistral":
            shape += f" ffn={self.intermediate_size}"
        return f"{shape} V={self.vocab_size}, batch {self.batch_size}/rank x seq {self.seq_len}"


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One peer at one world size.

    Attributes:
        peer: a key of ``benchmarks.peers.PEERS``.
        world_size: ranks (processes) in the group.
        model: the model and batch.
        warmup_steps / steps: untimed and timed training steps.
        threads_per_rank: ``torch.set_num_threads`` in every rank (1 keeps peers comparable on a
            shared 2-core machine).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (one GPU per rank, NCCL for CUDA tensors); the model is
            built on the CPU and each peer moves it the way that system expects.
        lr: AdamW learning rate (every peer uses AdamW, betas (0.9, 0.999), eps 1e-8, wd 0.0).
        options: peer-specific settings (e.g. ``budget_fraction`` for hf_elixir).
        tag: tells apart runs of one peer at one world size in the same work folder (``launch_group`` of
            several models); part of :meth:`key`, so of the record and log file names.
        worker: ``"module:function"``, ``function(rank, spec) -> record`` measuring in every rank instead of
            this module's step loop (``benchmarks/trl_sft.py``: the Trainer's own loop); the record has the
            keys :func:`_measure` returns.
    """

    peer: str
    world_size: int = 1
    model: ModelSpec = field(default_factory=ModelSpec)
    warmup_steps: int = 2
    steps: int = 10
    threads_per_rank: int = 1
    lr: float = 1e-4
    options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # "cpu" or "cuda" (benchmarks/gpu.py); batches are created on it
    tag: str = ""
    worker: str = ""  # "module:function" run in every rank instead of the step loop over ``peers.PEERS``


    def key(self) -> str:
        return f"{self.peer}_ws{self.world_size}" + (f"_{self.tag}" if self.tag else "")


@dataclass(kw_only=True)
class RunResult:
    """What one launch measured (``ok`` False -> ``error`` says why, nothing else is meaningful)."""

    spec: RunSpec
    ok: bool
    error: str = ""
    step_times_s: list[float] = field(default_factory=list)  # per step, slowest rank
    cpu_times_s: list[list[float]] = field(default_factory=list)  # per rank, per timed step: process CPU seconds
    peak_rss_bytes: list[int] = field(default_factory=list)  # per rank
    baseline_rss_bytes: list[int] = field(default_factory=list)  # per rank, before model build
    losses: list[float] = field(default_factory=list)  # rank 0, every step (warm-up included)
    num_params: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # rank 0's peer stats
    wall_s: float = 0.0

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def cpu_median_s(self) -> list[float]:
        """Median process CPU seconds per timed step, one value per rank (empty when not recorded)."""
        return [statistics.median(ts) for ts in self.cpu_times_s if ts]

    @property
    def tokens_per_s(self) -> float:
        m = self.spec.model
        return self.spec.world_size * m.batch_size * m.seq_len / self.median_s


def gpt2_config(spec: ModelSpec):
    """The ``transformers.GPT2Config`` for ``spec`` (dropout off so every peer computes the same)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head,
                      vocab_size=spec.vocab_size, n_positions=spec.n_positions,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=0, eos_token_id=0)


def build_model(spec: ModelSpec):
    """A freshly initialised fp32 model on the CPU for ``spec`` (seed the RNG before calling)."""
    if spec.family == "gpt2":
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(gpt2_config(spec))
    if spec.family in ("mixtral", "mistral"):
        return _build_mistral_family(spec)
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(hidden_size=spec.n_embd, num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                       ffn_dim=4 * spec.n_embd, vocab_size=spec.vocab_size,
                       word_embed_proj_dim=spec.word_embed_proj_dim or spec.n_embd,
                       do_layer_norm_before=spec.layer_norm_before,
                       max_position_embeddings=spec.n_positions, dropout=0.0, attention_dropout=0.0,
                       pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return OPTForCausalLM(config)


def _build_mistral_family(spec: ModelSpec):
    """``MixtralForCausalLM`` / ``MistralForCausalLM`` from a config built offline (dropout and router jitter off,
    so every run computes the same; Mixtral's loss includes its router auxiliary loss)."""
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.n_embd, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                  num_key_value_heads=spec.n_kv_head or spec.n_head, max_position_embeddings=spec.n_positions,
                  attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if spec.family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(num_local_experts=spec.num_experts,
                                                num_experts_per_tok=spec.experts_per_tok, router_jitter_noise=0.0,
                                                output_router_logits=True, **common))
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(sliding_window=None, **common))


def count_params(spec: ModelSpec) -> int:
    """Parameters of the model for ``spec`` with the tied lm_head counted once: GPT-2 analytically (exact),
    the other families by building it on the meta device (nothing allocated)."""
    if spec.family != "gpt2":
        import torch

        with torch.device("meta"):
            return sum(p.numel() for p in build_model(spec).parameters())
    d, v, p, layers = spec.n_embd, spec.vocab_size, spec.n_positions, spec.n_layer
    per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return v * d + p * d + layers * per_layer + 2 * d


def make_batches(spec: ModelSpec, count: int, device: str = "cpu", seed: int = 1000) -> list:
    """``count`` batches of random token ids, ``(batch_size, seq_len)`` each, on ``device`` (seeded: every peer and
    every run of one seed trains on the same tokens)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len), generator=gen).to(device)
            for _ in range(count)]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# parent side


def launch(spec: RunSpec, work_dir: str | Path, timeout_s: float = 600.0) -> RunResult:
    """Run ``spec`` in a fresh spawned process group and return what it measured.

    Never raises for a peer failure: a crash, a non-zero exit or a timeout gives ``ok=False`` with the
    reason and the tail of rank 0's log in ``error``.
    """
    return launch_group([spec], work_dir, timeout_s)[0]


def launch_group(specs: list[RunSpec], work_dir: str | Path, timeout_s: float = 600.0) -> list[RunResult]:
    """Run several specs (same world size) one after another inside ONE spawned process group.

    Only for smoke tests (``run_cpu.py --quick``): it saves the process start-up per peer, but the
    peers then share a process, so peak RSS is the group's, not the peer's. Each spec still gets its
    own model and its own record; the world process group is created by the first peer that needs one
    and shared by the rest (DeepSpeed caches groups, so it cannot be torn down and re-created).
    """
    import torch.multiprocessing as mp

    assert specs and len({s.world_size for s in specs}) == 1, "one world size per process group"
    world_size = specs[0].world_size
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        for rank in range(world_size):
            _record_path(work_dir, spec, rank).unlink(missing_ok=True)
    port = free_port()
    start = time.perf_counter()
    context = mp.start_processes(_worker_main, args=(specs, str(work_dir), port), nprocs=world_size,
                                 join=False, start_method="spawn")
    group_error = ""
    deadline = start + timeout_s * len(specs)
    try:
        while not context.join(timeout=1.0):
            if time.perf_counter() > deadline:
                group_error = f"timed out after {timeout_s * len(specs):.0f} s"
                break
    except Exception as exc:  # a rank raised or died: ProcessRaisedException / ProcessExitedException
        text = str(exc).strip()
        group_error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else exc}"
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    wall_s = time.perf_counter() - start
    return [_collect(spec, work_dir, group_error, wall_s / len(specs)) for spec in specs]


def _collect(spec: RunSpec, work_dir: Path, group_error: str, wall_s: float) -> RunResult:
    records = []
    for rank in range(spec.world_size):
        path = _record_path(work_dir, spec, rank)
        if path.exists():
            records.append(json.loads(path.read_text()))
    error = next((r["error"] for r in records if r.get("error")), "")
    if not error and len(records) < spec.world_size:
        error = group_error or f"only {len(records)}/{spec.world_size} ranks wrote results"
    if error:
        return RunResult(spec=spec, ok=False, error=error + _log_tail(work_dir, spec), wall_s=wall_s)
    per_rank_times = [r["step_times_s"] for r in records]
    step_times = [max(ts) for ts in zip(*per_rank_times)]
    return RunResult(spec=spec, ok=True, step_times_s=step_times,
                     cpu_times_s=[r.get("cpu_times_s", []) for r in records],
                     peak_rss_bytes=[r["peak_rss_bytes"] for r in records],
                     baseline_rss_bytes=[r["baseline_rss_bytes"] for r in records],
                     losses=records[0]["losses"], num_params=records[0]["num_params"],
                     extra=records[0]["extra"], wall_s=wall_s)


def _record_path(work_dir: Path, spec: RunSpec, rank: int) -> Path:
    return work_dir / f"{spec.key()}_rank{rank}.json"


def _log_path(work_dir: Path, spec: RunSpec, rank: int) -> Path:
    return work_dir / f"{spec.key()}_rank{rank}.log"


def _log_tail(work_dir: Path, spec: RunSpec, num_lines: int = 15) -> str:
    path = _log_path(work_dir, spec, 0)
    if not path.exists():
        return ""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return "\n--- rank 0 log tail ---\n" + "\n".join(lines[-num_lines:])


# ---------------------------------------------------------------------------------------------
# worker side


def _redirect_output(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _worker_main(rank: int, specs: list[RunSpec], work_dir: str, port: int) -> None:
    work = Path(work_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if specs[0].device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run interpreted on CPU
    failed = None
    for spec in specs:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(spec.world_size),
                          OMP_NUM_THREADS=str(spec.threads_per_rank))
        _redirect_output(_log_path(work, spec, rank))
        try:
            record = _worker(spec)(rank, spec)
        except Exception as exc:  # record it; in a group, go on with the next peer
            traceback.print_exc()
            record = {"error": f"rank {rank}: {type(exc).__name__}: {exc}"[:2000]}
            failed = failed or exc
        _record_path(work, spec, rank).write_text(json.dumps(record))
        sys.stdout.flush()
    _abandon_distributed()
    if failed is not None and len(specs) == 1:
        raise failed


def _worker(spec: RunSpec):
    if not spec.worker:
        return _measure
    import importlib

    module, _, name = spec.worker.partition(":")
    return getattr(importlib.import_module(module), name)


def _abandon_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the group may be broken after a peer failure; nothing more to do
            pass


def _measure(rank: int, spec: RunSpec) -> dict[str, Any]:
    import resource

    import psutil
    import torch
    import torch.distributed as dist

    from benchmarks.peers import PEERS

    torch.set_num_threads(spec.threads_per_rank)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 params, TF32 matmuls: same for every peer
        torch.backends.cudnn.allow_tf32 = True
    if spec.options.get("fail"):
        raise RuntimeError(f"--fail-peers {spec.peer}: failing on purpose (checks the benchmark's exit status)")
    peer = PEERS[spec.peer]
    peer.init_distributed(spec)
    baseline_rss = psutil.Process().memory_info().rss

    torch.manual_seed(0)
    model = build_model(spec.model)
    num_params = sum(p.numel() for p in model.parameters())
    runner = peer.setup(model, spec, rank)
    batches = make_batches(spec.model, spec.warmup_steps + spec.steps, spec.device, seed=1000 + rank)
    cuda = spec.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, times, cpu_times = [], [], []
    for index, ids in enumerate(batches):
        if dist.is_initialized():
            dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = runner.step(ids)  # returns loss.item(), which synchronises with the device
        if cuda:
            torch.cuda.synchronize()
        elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
        losses.append(float(loss))
        if index >= spec.warmup_steps:
            times.append(elapsed)
            cpu_times.append(cpu_elapsed)
    extra = runner.stats()
    if spec.options.get("cpu_profile"):
        extra["profile_top"] = _profile_one_step(runner, batches[-1])
    if cuda:
        extra["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        extra["cuda_max_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    if dist.is_initialized():
        dist.barrier()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    runner.close()
    return {"step_times_s": times, "cpu_times_s": cpu_times, "losses": losses, "num_params": num_params,
            "peak_rss_bytes": peak_rss, "baseline_rss_bytes": baseline_rss, "extra": extra}


def _profile_one_step(runner, ids, top: int = 10) -> list[list]:
    """One extra (untimed) step under ``torch.profiler``: the ``top`` ops by self CPU time.

    Returns ``[[name, self_cpu_ms, calls], ...]`` plus a ``["(step total)", ms, 1]`` row.
    """
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(ids)
    total_ms = (time.perf_counter() - start) * 1e3
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [["(step total, profiled)", round(total_ms, 2), 1]] + [
        [e.key, round(e.self_cpu_time_total / 1e3, 2), e.count] for e in rows]


def result_to_dict(result: RunResult) -> dict[str, Any]:
    """JSON-able form of a result (for ``results.json``)."""
    out = dataclasses.asdict(result)
    out["spec"] = dataclasses.asdict(result.spec)
    return out
