"""What every benchmark runner shares: the prepared-run handle and the AdamW settings all peers train with."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["ADAM_KW", "Runner"]

ADAM_KW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


class Runner:
    """One prepared training setup. ``step`` returns the loss as a float."""

    def __init__(self, step: Callable[[torch.Tensor], float], stats: Callable[[], dict] | None = None,
                 close: Callable[[], None] | None = None):
        self._step, self._stats, self._close = step, stats, close

    def step(self, input_ids: torch.Tensor) -> float:
        return self._step(input_ids)

    def stats(self) -> dict[str, Any]:
        return self._stats() if self._stats else {}

    def close(self) -> None:
        if self._close:
            self._close()
