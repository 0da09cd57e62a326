"""``hf-elixir profile``: one real step of a small model on this machine, a plan searched for a budget, and the
PNG of the predicted device memory over the step beside the measured and predicted step times."""

from __future__ import annotations

import argparse
from dataclasses import replace

from hf_elixir.cli._plan import check_config, run_search, splits_experts
from hf_elixir.cli._units import human_s
from hf_elixir.plan import policy_summary

__all__ = ["cmd_profile"]


def cmd_profile(args: argparse.Namespace) -> int:
    """``hf-elixir profile``: a real step of a small model here, a plan for a budget, the PNG."""
    import torch

    from hf_elixir._hardware_probe import probe_hardware  # with the runtime probe ([Note: runtime probe])
    from hf_elixir.profiler import profile_step
    from hf_elixir.parallel._expert_units import split_fused_experts
    from hf_elixir.profiler._model_zoo import load_config, meta_model_and_batch
    from hf_elixir.search import build_chunked_step, predict

    torch.manual_seed(0)
    config = load_config(args.model)
    check_config(args, config)
    model, batch = meta_model_and_batch(config, batch_size=args.batch_size, seq_len=args.seq_len, device="cpu")
    if splits_experts(args, model, args.budget):  # [Note: split fused experts]
        split_fused_experts(model)
    # probe_hardware() below describes the GPU where there is one: price the CPU-profiled step by its FLOPs there
    profile = profile_step(model, batch, device="cpu", count_flops=torch.cuda.is_available(),
                           forward_only=args.optimizer == "none")
    hardware = probe_hardware(budget_bytes=1)  # the CPU's rates; the budget is set below
    budget = args.budget or _budget_from_fraction(args, profile, hardware)
    hardware = replace(hardware, device_total_bytes=budget, device_free_bytes=budget)
    result = run_search(args, profile, hardware, budget, chunk_size_numel=args.chunk_size_numel)
    best = result.best
    step = build_chunked_step(profile, best.chunk_size_numel, world_size=args.num_gpus, precision=args.precision,
                              hardware=hardware, activation_checkpointing=best.activation_checkpointing,
                              activation_policy=best.activation_policy or None,
                              replicated=best.data_parallel == "replicated")
    pred = predict(step, best.knobs, hardware, activations_on_device=args.activations_on_device, timeline=True)
    assert pred is not None, "the search's best candidate must fit when priced again"
    measured = (profile.forward_s or 0.0) + (profile.backward_s or 0.0)
    import matplotlib.pyplot as plt

    plt.close(_draw_profile(args, best, pred, budget, measured))
    print(f"wrote {args.output}: measured {_step_name(args)} {human_s(measured)} (fp32 step on this CPU), predicted "
          f"{human_s(pred.forward_backward_s)}, {pred.onloads} onloads, peak {pred.device_model_bytes} bytes of model "
          f"data in a budget of {budget} ({args.num_gpus} rank(s), {args.precision})")
    return 0


def _step_name(args: argparse.Namespace) -> str:
    """What the profiled step runs: ``"forward"`` for ``--optimizer none`` (inference), else
    ``"forward+backward"``."""
    return "forward" if args.optimizer == "none" else "forward+backward"


def _budget_from_fraction(args: argparse.Namespace, profile, hardware) -> int:
    """``--budget-fraction`` F: ``lo + F * (hi - lo)`` bytes, where ``lo`` is the smallest budget the search
    accepts and ``hi`` the smallest at which its plan onloads no chunk (both found by bisection to 1%, with
    the same flags; a search of a small model takes milliseconds). Below 1.0 the step offloads and onloads.

    Raises:
        ValueError: no budget up to 64x the model data fits.
    """
    ceiling = 64 * profile.model_data_bytes(args.precision, args.num_gpus)["total"] + 2**24

    def best_at(budget: int):
        try:
            return run_search(args, profile, hardware, budget, chunk_size_numel=args.chunk_size_numel).best
        except ValueError:
            return None

    def smallest(ok) -> int:
        lo, hi = 0, ceiling  # ok(hi) holds, ok(lo) does not
        while hi - lo > max(64, lo // 100):
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    if best_at(ceiling) is None:
        raise ValueError(f"no budget up to {ceiling} bytes fits {args.model} at batch {args.batch_size} x "
                         f"{args.seq_len}; pass a smaller --batch-size/--seq-len or more --num-gpus")
    lo = smallest(lambda b: best_at(b) is not None)
    hi = max(lo, smallest(lambda b: (c := best_at(b)) is not None and c.prediction.onloads == 0))
    return int(lo + args.budget_fraction * (hi - lo))


def _draw_profile(args: argparse.Namespace, best, pred, budget: int, measured_s: float):
    """The PNG: device model data over the predicted step (y from 0, onloads marked, legend outside the
    axes, an entry only for series that have points) and measured vs predicted forward+backward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times_ms = [0.0] + [t * 1e3 for t, _, _ in pred.timeline]
    used_mib = [pred.timeline[0][1] / 2**20] + [u / 2**20 for _, u, _ in pred.timeline]
    onload_ms = [t * 1e3 for (t, _, label) in pred.timeline
                 if label.endswith(" onloads") and not label.endswith(":0 onloads")]
    fig, (ax, bar) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 1]})
    ax.step(times_ms, used_mib, where="post", label="device model data")
    ax.axhline(budget / 2**20, color="red", linestyle="--", label="budget")
    activations = pred.breakdown.get("activations", 0)
    if activations:
        ax.axhline((budget - activations) / 2**20, color="orange", linestyle=":", label="budget minus activations")
    for i, t in enumerate(onload_ms):  # one legend entry for the series, none when it is empty
        ax.axvline(t, color="gray", alpha=0.35, linewidth=1, label="chunk onload" if i == 0 else None)
    ax.set_ylim(bottom=0, top=max(budget / 2**20, max(used_mib)) * 1.08)
    ax.set_xlim(left=0)
    ax.set_xlabel("predicted time in step (ms)")
    ax.set_ylabel("MiB")
    k = best.knobs
    ax.set_title(f"{args.model}, {args.num_gpus} rank(s), {args.precision}: chunk {best.chunk_size_numel}, "
                 f"resident {len(k.resident)}, cache blocks {k.cache_blocks}, ckpt {best.activation_checkpointing} "
                 f"(activations: {policy_summary(best.activation_policy)})",
                 fontsize=10, pad=28)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(labels), frameon=False,
              fontsize=9)  # above the axes: never over the curve
    bar.bar(["measured\n(fp32, CPU)", "predicted"], [measured_s * 1e3, pred.forward_backward_s * 1e3])
    bar.set_title(_step_name(args), fontsize=10)
    bar.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(args.output, dpi=100, bbox_inches="tight")
    return fig
