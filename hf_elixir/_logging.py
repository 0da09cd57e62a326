"""Log lines that describe the whole job once, from its main process.

Under ``torchrun`` / ``accelerate launch`` every rank runs ``prepare`` and takes the same decisions
(placement, chunk layout, activation policy: agreed across the ranks, [Note: ranks agree] in
``hf_elixir/placement/_agree.py``), so a summary of them logged by every rank only repeats one line N
times. Accelerate does the same with ``get_logger(__name__).info(..., main_process_only=True)``; this is
its counterpart below the integrations layer, where accelerate is not imported.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

__all__ = ["info_on_main_rank", "is_main_rank"]


def is_main_rank() -> bool:
    """True in a single process, and on global rank 0 of an initialised ``torch.distributed`` job."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def info_on_main_rank(logger: logging.Logger, msg: str, *args) -> None:
    """``logger.info(msg, *args)`` on the main rank; ``logger.debug`` on the others (still there with
    ``DEBUG`` logging, for a rank whose line would differ)."""
    logger.log(logging.INFO if is_main_rank() else logging.DEBUG, msg, *args)
