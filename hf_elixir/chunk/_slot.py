"""Where one parameter lives inside its chunk: :class:`ParamSlot` (its range, its state in the declared table of
``chunk/states.py``). The chunk (``chunk.py``) and its gradient verbs (``_chunk_grads.py``) both take slots, so the
slot is a file of its own below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_elixir.chunk.states import TRANSITIONS, TensorState, check_transition

__all__ = ["ParamSlot"]


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives inside its chunk.

    Attributes:
        name: canonical FQN (first name in ``named_parameters(remove_duplicate=False)`` order).
        param: the ``nn.Parameter`` (identity kept).
        offset / numel: element range ``[offset, offset + numel)`` inside the chunk.
        shape: the parameter's shape.
        trainable: ``param.requires_grad`` at ``prepare`` time.
        flag_index: position in the manager's has-gradient flag vector (trainable slots only, else -1).
    """

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    trainable: bool
    flag_index: int = -1
    index_in_chunk: int = -1
    state: TensorState = TensorState.FREE
    aliases: list[str] = field(default_factory=list)
    # ``param._version`` when its writes were last taken ([Note: parameter writes] in _chunk_params.py)
    seen_version: int = 0

    def set_state(self, new: TensorState) -> None:
        if new not in TRANSITIONS[self.state]:  # the message is formatted only for an illegal move (hot path)
            check_transition(self.state, new, f"for parameter {self.name!r}")
        self.state = new
