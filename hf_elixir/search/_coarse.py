"""How the configuration search (``_plan_search.py``) spends its effort: a coarse pass over every step, a fine
pass over the few that can win, bounds that skip the rest, and progress lines while it runs.

[Note: coarse to fine]
A step is one (data-parallel kind, chunk size, activation policy) at one parallel degree; its grid prices a few
hundred configurations by simulating the step event by event (``predict``), which for a MoE model of 30 B+
parameters takes milliseconds each: the full grid over every step of every degree took 6 to 12 minutes for
Mixtral-8x7B on 8 ranks and more than 30 for DeepSeek-V3 on 64. So the search

* prices every step once coarsely (:func:`coarse_effort`: fewer resident counts, the deepest prefetch only, the
  spare bytes spent all or none: a few dozen configurations a step);
* skips a step whose compute alone (:func:`step_lower_bound_s`: the sum of its events' compute and hook times,
  which no configuration can beat, as ``predict`` adds both to the compute stream at every event) is no faster
  than a plan already found, at this degree or at another one (``incumbent_s``); a degree all of whose steps are
  skipped this way raises :class:`DegreePruned`;
* prices the full grid only for the steps whose coarse best is within :data:`FINE_SLACK` of the best coarse
  step, at most :data:`FINE_STEPS` of them (:func:`fine_steps_to_search`);
* refines locally only a degree whose best is within ``REFINE_SLACK`` of the best found at another degree.

What is skipped cannot hold a faster plan than the lower bound says; what the coarse pass ranks low could, by
the difference the fine grid makes within one step (a few percent on the models of the plan tables), which is
why the fine pass takes every step within :data:`FINE_SLACK` rather than only the best one.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Any, Callable, Iterator

from hf_elixir.search._grid import _policy_key

__all__ = ["DegreePruned", "FINE_SLACK", "FINE_STEPS", "coarse_effort", "fine_steps_to_search",
           "progress_reporter", "report_progress", "step_lower_bound_s"]

#: a step whose coarse best is within this fraction of the best coarse step gets the fine grid
FINE_SLACK = 0.05
#: at most this many steps get the fine grid at one degree
FINE_STEPS = 3
#: the coarse pass spends the spare device bytes on optimizer states and shards all or none (the fine grid: five
#: shares)
COARSE_FILL_FRACTIONS = (0.0, 1.0)


class DegreePruned(ValueError):
    """Every step of a parallel degree is slower in compute alone than a plan found at another degree
    ([Note: coarse to fine]): nothing there can win."""


def coarse_effort(grid_points: int, prefetch_depths: tuple[int, ...]) -> dict[str, Any]:
    """The coarse pass's grid: at most 3 resident counts, the deepest prefetch, :data:`COARSE_FILL_FRACTIONS`."""
    return {"grid_points": min(grid_points, 3), "prefetch_depths": (max(prefetch_depths),),
            "fill_fractions": COARSE_FILL_FRACTIONS}


def step_lower_bound_s(step: Any, hardware: Any) -> float:
    """Seconds no configuration of ``step`` (a ``ChunkedStep``) can beat: its events' compute plus one hook each
    (what ``predict`` adds to the compute stream at every event, whatever waits in between)."""
    return sum(step.event_compute_s) + len(step.event_compute_s) * hardware.hook_event_s


def fine_steps_to_search(planned: list[tuple], step_best: dict[tuple, float],
                         incumbent_s: float | None) -> list[tuple]:
    """The steps of ``planned`` (``(mode, size, policy)``) that get the fine grid: those whose coarse best
    (``step_best``, keyed ``(mode, size, policy key)``) is within :data:`FINE_SLACK` of the best of them and of
    ``incumbent_s`` (another degree's best), the :data:`FINE_STEPS` best of those."""
    if not step_best:
        return []
    bar = min([*step_best.values()] + ([incumbent_s] if incumbent_s else [])) * (1.0 + FINE_SLACK)
    ranked = sorted((step_best[key], i) for i, (mode, size, policy) in enumerate(planned)
                    if (key := (mode, size, _policy_key(policy))) in step_best and step_best[key] <= bar)
    return [planned[i] for _, i in ranked[:FINE_STEPS]]


# [Note: search progress] the search reports what it searches, how far it got and the best so far through a
# reporter the caller installs (the CLI prints periodic lines to stderr); without one, nothing is printed (the
# library logs, and ``prepare`` searches small steps in well under a second)
_REPORTER: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar("hf_elixir_search_progress",
                                                                                     default=None)
_SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("hf_elixir_search_scope", default="")


def report_progress(**fields: Any) -> None:
    """Hand ``fields`` (``what``, ``done``, ``total``, ``priced``, ``best_s``) and the current scope (the degree
    being searched, :func:`progress_scope`) to the installed reporter, if any."""
    reporter = _REPORTER.get()
    if reporter is not None:
        reporter(scope=_SCOPE.get(), **fields)


@contextlib.contextmanager
def progress_scope(scope: str) -> Iterator[None]:
    """Name what the searches inside report on (``"expert parallel 8 (2 of 2)"``)."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def progress_reporter(reporter: Callable[..., None]) -> Iterator[None]:
    """Install ``reporter`` (called with ``scope``, ``what``, ``done``, ``total``, ``priced``, ``best_s``) for the
    searches inside the ``with`` block."""
    token = _REPORTER.set(reporter)
    try:
        yield
    finally:
        _REPORTER.reset(token)


class PeriodicLines:
    """A reporter printing one line at most every ``every_s`` seconds through ``write`` (``sys.stderr.write`` in the
    CLI): elapsed time, what is searched, how far, configurations priced, best step so far."""

    def __init__(self, write: Callable[[str], Any], every_s: float = 5.0) -> None:
        self.write, self.every_s = write, every_s
        self.started = self.last = time.perf_counter()

    def __call__(self, *, scope: str, what: str, done: int, total: int, priced: int,
                 best_s: float | None) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s:
            return
        self.last = now
        best = f"{best_s:.4g} s a step" if best_s is not None else "none yet"
        where = f"{scope}: " if scope else ""
        self.write(f"[{now - self.started:5.0f} s] searching {where}{what} {done}/{total}, {priced} configurations "
                   f"priced, best so far {best}\n")
