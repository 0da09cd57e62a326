"""Triton kernels for hf_elixir's chunk hot paths, each with a PyTorch reference and a dispatcher.

Every op runs its Triton kernel on CUDA tensors and its PyTorch reference elsewhere (see
[Note: dispatch rule] in ``_dispatch.py``); ``force_triton=True`` runs the kernel on CPU tensors
under ``TRITON_INTERPRET=1`` (tests).

Ops:
    fused_adamw_     Adam / AdamW step on a chunk shard in one pass (``fused_adam.py``)
    unscale_norm_    unscale + overflow flag + squared L2 norm of a gradient chunk (``unscale_norm.py``)
    moe_permute      gather tokens into expert order with HF Switch capacity dropping (``moe_permutation.py``)
    moe_unpermute    gate-weighted scatter back to token order (``moe_permutation.py``)
    cast_            dtype cast/copy of a chunk (``cast.py``)
"""

from ._dispatch import HAS_TRITON
from .cast import cast_
from .fused_adam import fused_adamw_, fused_adamw_reference
from .moe_permutation import moe_permute, moe_routing_map, moe_unpermute
from .unscale_norm import unscale_norm_, unscale_norm_reference

__all__ = [
    "HAS_TRITON",
    "cast_",
    "fused_adamw_",
    "fused_adamw_reference",
    "moe_permute",
    "moe_routing_map",
    "moe_unpermute",
    "unscale_norm_",
    "unscale_norm_reference",
]
