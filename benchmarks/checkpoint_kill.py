"""Kill a rank (SIGKILL) at a random point of ``hf_elixir.save_checkpoint`` under TP=2 and EP=2; every resume is exact.

Two gloo ranks train a tiny Llama with ``tensor_parallel_size=2`` (``--mode tp``) or a tiny Mixtral with
``expert_parallel_size=2`` (``--mode ep``), saving a checkpoint after every step into one directory. In each trial
one rank, chosen at random, kills itself with SIGKILL at a random line of the save: a line tracer records the
distinct lines the save code runs (``hf_elixir/checkpoint.py``, ``hf_elixir/parallel/_shard_io.py``,
``hf_elixir/optim/_shard_payload.py``) during the trial's first save, and in its second save the chosen rank kills
itself the first time it reaches one of them, drawn uniformly: anywhere from the first collective through the
file writes and fsyncs to the renames and the final barrier (the victim's own share of the path: rank 0 alone
writes the manifest and renames). The parent then kills the other rank (as a launcher does; it would wait in a collective). The next
trial's two fresh ranks resume from the directory and check, bit for bit, that

* the checkpoint loads, at the last completed step or the one being saved (when the kill came after the commit);
* this rank's tensors equal those of an uninterrupted run at that step (a reference run of the same two ranks
  that never saved), and every step after the resume equals the uninterrupted run's too (weights, so the Adam
  moments and step counts came back as well).

A final run resumes after the last kill. Usage::

    python benchmarks/checkpoint_kill.py                 # 10 kills under TP=2 and 10 under EP=2
    python benchmarks/checkpoint_kill.py --kills 3 --mode tp

Prints one JSON line per mode (``exact`` of ``resumes``, the kill points) and exits 1 unless every resume was
exact. ``run_kills`` is the same as a function (tests/test_checkpoint_kill.py runs a short version).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pickle
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

#: the save's code, whose lines the tracer counts
_SAVE_FILES = ("hf_elixir/checkpoint.py", "hf_elixir/parallel/_shard_io.py", "hf_elixir/optim/_shard_payload.py")
_STEPS_PER_TRIAL = 2  # a counted save, then the save that is killed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(mode: str, tied: bool = False, uneven: bool = False) -> torch.nn.Module:
    """The tiny fp32 model of ``mode`` (same seed every time): Llama for ``"tp"``, Mixtral (4 experts) for ``"ep"``;
    ``tied``: ``lm_head`` tied to the input embedding; ``uneven``: a vocabulary of 255 and an MLP width of 63, which
    two tp ranks do not divide."""
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=255 if uneven else 128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=tied)
    if mode == "tp":
        return T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=63 if uneven else 64, **common))
    return T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                router_jitter_noise=0.0, **common))


def _build(mode: str, tied: bool = False, parallel: bool = True, uneven: bool = False, precision: str = "fp32"):
    """The tiny model of ``mode`` (``tied``, ``uneven`` as :func:`_model`), parallelized (unless ``parallel=False``:
    plain ZeRO) and prepared at ``precision``."""
    import hf_elixir
    from hf_elixir.parallel import build_mesh, parallelize

    model = _model(mode, tied, uneven)
    if not parallel:
        cfg = hf_elixir.ElixirConfig(chunk_size_numel=4096, precision=precision)
        return hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), cfg)
    if mode == "tp":
        cfg = hf_elixir.ElixirConfig(tensor_parallel_size=2, chunk_size_numel=4096, precision=precision)
    else:
        cfg = hf_elixir.ElixirConfig(expert_parallel_size=2, placements={"*.mlp.experts": "expert"},
                                     chunk_size_numel=4096, precision=precision)
    parallelize(model, cfg, build_mesh(cfg))
    return hf_elixir.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), cfg)


def _step(model, opt, step: int, rank: int) -> float:
    """One AdamW step on this rank's batch of ``step`` (the tp ranks of a dp row share one); returns the loss."""
    from hf_elixir.parallel import get_parallel_state

    pstate = get_parallel_state(model)
    if pstate is not None and pstate.mesh.mp_axis == "tp":
        rank = pstate.mesh.device_mesh.get_local_rank("dp")
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1000 * step + rank))
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss)
    opt.step()
    return loss.item()


def _local(model) -> dict[str, torch.Tensor]:
    from hf_elixir.parallel._shard_io import read_local_tensors

    return read_local_tensors(model)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _KillAtLine:
    """``sys.settrace`` hook on the save's files: records the distinct lines the save runs, in the order first run,
    and SIGKILLs this process the first time it reaches line ``at`` (``(file, line number)``)."""

    def __init__(self, at: tuple[str, int] | None, note: Path) -> None:
        self.files = tuple(str(_ROOT / f) for f in _SAVE_FILES)
        self.at, self.note, self.lines = at, note, {}

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in self.files else None

    def _line(self, frame, event, arg):
        if event == "line":
            here = (frame.f_code.co_filename, frame.f_lineno)
            self.lines.setdefault(here, frame.f_code.co_name)
            if here == self.at:
                where = f"{Path(here[0]).name}:{here[1]} ({frame.f_code.co_name})"
                _note(self.note, json.dumps({"where": where}))
                os.kill(os.getpid(), signal.SIGKILL)
        return self._line


def _traced_save(directory: str, model, opt, step: int, tracer: _KillAtLine | None) -> None:
    import hf_elixir

    sys.settrace(tracer)
    try:
        hf_elixir.save_checkpoint(directory, model, opt, step=step)
    finally:
        sys.settrace(None)


def _reference(rank: int, mode: str, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's tensors after every step of an uninterrupted run (step 0: before training)."""
    model, opt = _build(mode)
    ref = {0: _local(model)}
    for step in range(1, steps + 1):
        _step(model, opt, step, rank)
        ref[step] = _local(model)
    return ref


def _trial(rank: int, mode: str, directory: str, ref: dict, plan: dict, out_dir: Path) -> dict:
    """Resume (if there is a checkpoint), check it, then save twice; the victim rank dies in the second save."""
    import hf_elixir

    model, opt = _build(mode)
    result: dict = {"resumed_step": None, "exact": None}
    step = 0
    if Path(directory).exists() or Path(directory).parent.joinpath(f".{Path(directory).name}.previous").exists():
        step = hf_elixir.load_checkpoint(directory, model, opt)["step"]
        exact = _same(_local(model), ref[step])
        for _ in range(plan["check_steps"]):
            step += 1
            _step(model, opt, step, rank)
            exact = exact and _same(_local(model), ref[step])
        result.update(resumed_step=step - plan["check_steps"], exact=exact)
    _write(out_dir / f"rank{rank}.partial", result)  # the parent reads it after the kill
    if plan.get("final"):
        return result
    victim = rank == plan["victim"]
    counter = _KillAtLine(None, out_dir / "kill.json")
    step += 1
    _step(model, opt, step, rank)
    _traced_save(directory, model, opt, step, counter if victim else None)
    _note(out_dir / f"rank{rank}.saved", str(step))
    step += 1
    _step(model, opt, step, rank)
    lines = list(counter.lines)  # a line drawn uniformly among those the counted save ran
    at = lines[min(len(lines) - 1, int(plan["fraction"] * len(lines)))] if victim else None
    _traced_save(directory, model, opt, step, _KillAtLine(at, out_dir / "kill.json") if victim else None)
    _note(out_dir / f"rank{rank}.saved", str(step))
    if victim:  # this save ran fewer lines than the counted one: killed as it returns
        _note(out_dir / "kill.json", json.dumps({"where": "save_checkpoint returned"}))
        os.kill(os.getpid(), signal.SIGKILL)
    return result


def _note(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.rename(tmp, path)


def _write(path: Path, value) -> None:
    """Write, then rename: a rank the parent kills while it writes leaves no half file."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.rename(tmp, path)


def _rank_main(rank: int, port: int, job: str, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
        if job == "reference":
            result = ("ok", _reference(rank, *args))
        else:
            mode, directory, ref_dir, plan = args
            ref = torch.load(Path(ref_dir) / f"ref{rank}.pt")
            result = ("ok", _trial(rank, mode, directory, ref, plan, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    _write(out / f"rank{rank}.pkl", result)
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch(job: str, args: tuple, out_dir: Path, timeout_s: float) -> list:
    """Run ``job`` on two forked ranks; when one dies by SIGKILL, kill the other. Returns each rank's exit code."""
    ctx = multiprocessing.get_context("fork")  # the ranks inherit torch / transformers / hf_elixir: fast starts
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, job, args, str(out_dir)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs):
        if any(p.exitcode == -signal.SIGKILL for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.01)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def _read(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _run_reference(mode: str, steps: int, work: Path, timeout_s: float) -> Path:
    out = work / "reference"
    out.mkdir()
    codes = _launch("reference", (mode, steps), out, timeout_s)
    for rank in range(2):
        status, value = _read(out / f"rank{rank}.pkl")
        if status != "ok" or codes[rank] != 0:
            raise RuntimeError(f"reference rank {rank} failed ({codes[rank]}):\n{value}")
        torch.save(value, out / f"ref{rank}.pt")
    return out


def _one_trial(mode: str, index: int, plan: dict, directory: Path, ref_dir: Path, work: Path, timeout_s: float):
    """One run of two ranks: returns ``(resume record or None, kill record or None)``."""
    out = work / f"trial{index}"
    out.mkdir()
    codes = _launch("trial", (mode, str(directory), str(ref_dir), plan), out, timeout_s)
    partial = [_read(out / f"rank{r}.partial") if (out / f"rank{r}.partial").exists() else None for r in range(2)]
    for rank in range(2):
        if (out / f"rank{rank}.pkl").exists():
            status, value = _read(out / f"rank{rank}.pkl")
            if status != "ok" and -signal.SIGKILL not in codes:  # the survivor of a kill sees its peer vanish
                raise RuntimeError(f"trial {index} rank {rank} failed:\n{value}")
    if any(p is None for p in partial):
        raise RuntimeError(f"trial {index}: a rank died before it checked its resume (exit codes {codes})")
    resume = None
    if partial[0]["resumed_step"] is not None:
        resume = {"step": partial[0]["resumed_step"], "exact": all(p["exact"] for p in partial),
                  "same_step": partial[0]["resumed_step"] == partial[1]["resumed_step"]}
    kill = None
    if not plan.get("final"):
        saved = [int((out / f"rank{r}.saved").read_text()) if (out / f"rank{r}.saved").exists() else 0
                 for r in range(2)]
        note = json.loads((out / "kill.json").read_text()) if (out / "kill.json").exists() else None
        kill = {"victim": plan["victim"], "fraction": round(plan["fraction"], 3), "codes": codes,
                "last_complete": min(saved), "at": note}
    return resume, kill


def run_kills(mode: str, kills: int = 10, seed: int = 0, check_steps: int = 1, timeout_s: float = 180.0) -> dict:
    """``kills`` SIGKILLs at random points of ``save_checkpoint`` under ``mode`` (``"tp"`` or ``"ep"``), each
    followed by a resume that is checked against an uninterrupted run. Returns a summary dict."""
    if mode not in ("tp", "ep"):
        raise ValueError(f"mode={mode!r}; use 'tp' or 'ep'")
    rng = random.Random(seed)
    start = time.perf_counter()
    _model(mode)  # the first model of a family imports its modules (seconds): once here, not in every forked rank
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        steps = (kills + 1) * (_STEPS_PER_TRIAL + check_steps) + 2
        ref_dir = _run_reference(mode, steps, work, timeout_s)
        directory = work / "ckpt"
        resumes, killed, expected = [], [], None
        for index in range(kills + 1):
            plan = {"victim": rng.randrange(2), "fraction": rng.random() or 1.0, "check_steps": check_steps,
                    "final": index == kills}
            resume, kill = _one_trial(mode, index, plan, directory, ref_dir, work, timeout_s)
            if resume is not None:
                resume["expected"] = expected
                resume["ok"] = (resume["exact"] and resume["same_step"]
                                and resume["step"] in (expected["last_complete"], expected["last_complete"] + 1))
                resumes.append(resume)
            if kill is not None:
                killed.append(kill)
                expected = kill
    exact = sum(r["ok"] for r in resumes)
    return {"mode": mode, "kills": sum(k["at"] is not None for k in killed), "resumes": len(resumes),
            "exact": exact, "summary": f"{exact} of {len(resumes)} resumes exact",
            "kill_points": [k["at"]["where"] if k["at"] else None for k in killed],
            "victims": [k["victim"] for k in killed], "resumed_steps": [r["step"] for r in resumes],
            "wall_s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--mode", choices=("tp", "ep", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import hf_elixir  # noqa: F401 - imported once here, inherited by every forked rank

    ok = True
    for offset, mode in enumerate(("tp", "ep") if args.mode == "both" else (args.mode,)):
        summary = run_kills(mode, args.kills, args.seed + offset)  # other draws for the second mode
        print(json.dumps(summary))
        ok = ok and summary["exact"] == summary["resumes"] == args.kills and summary["kills"] == args.kills
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
