"""Expert parallel for fused 3-D MoE experts (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss).

Today's Hugging Face MoE layers keep one layer's experts in one module whose parameters are stacked on
dim 0 (``gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``; gpt-oss transposed, with ``(E, 2I)`` /
``(E, H)`` biases) and call it as ``experts(hidden_TH, top_k_index_TK, top_k_weights_TK)`` after the
router. The router and everything around the experts (softmax or sigmoid scores, top-k, normalisation of
the top-k weights, DeepSeek's group-limited choice and shared experts, the load-balancing loss) stay the
model's own code, untouched. :func:`shard_fused_experts` keeps the module (class, name, ``act_fn``,
``config._experts_implementation``), replaces each fused parameter by this ep rank's slice of
``L = E / ep`` experts (``[rank * L, (rank + 1) * L)``, biases included), sets ``num_experts = L`` and
installs :class:`FusedExpertDispatch` as its ``forward``. Per forward (T local tokens, k choices):

1. ``moe_permute`` gathers the ``T * k`` (token, choice) rows in expert order, so the rows for ep rank r
   are contiguous (``counts_E`` rows per expert).
2. all-to-all of the per-expert counts (ep x L ints, the layer's one host read), then of the rows.
3. the received rows (grouped by source rank, then local expert) run through the module's own forward
   (transformers' eager / ``grouped_mm`` / ``batched_mm`` experts implementation, whichever the config
   names) as top-1 choices of their local expert id with weight 1.
4. the outputs go back by the reverse all-to-all and ``moe_unpermute`` sums each token's k outputs
   weighted by its routing weights (differentiable in the weights, so the router trains as in HF).

The permutations are the package's Triton kernels on CUDA and their PyTorch references elsewhere
(``triton_kernels/_dispatch.py``); ``FusedExpertDispatch.force_triton`` runs the kernels on CPU tensors
under ``TRITON_INTERPRET=1``.

[Note: idle fused experts] In plain PyTorch a fused tensor always gets a gradient (some expert of the
layer always has a token) and an expert slice without tokens gets zeros there, which AdamW still decays
(unlike Switch's per-expert modules, see [Note: idle experts] in ``_expert_parallel.py``). So an ep rank
whose local experts received no row still runs its forward, on one all-zero row derived from the empty
input and routed to local expert 0, and drops the output: its slices get an exact zero gradient, as in
plain PyTorch, and the backward of both all-to-alls stays in the graph on every rank.

[Note: tokens split over tp] Under tp x ep ([Note: tp x ep mesh] in ``_mesh.py``) the tp ranks of a row hold
the same tokens, routing and weights. Each takes its own slice of the tokens (``tp_slice`` along the tokens:
ceil-sized, the last shorter) before the dispatch and all-gathers the combined outputs over tp after it, so every
(token, choice) row is computed once (transformers' ``AllToAllEP`` does the same). The slicing is
``split_last_dim`` / ``gather_last_dim`` on the transposed tensors: the backward of the slice all-gathers the
gradient (the router's and the residual stream's gradients are whole on every tp rank, as without tp) and the
backward of the gather keeps this rank's slice (the gradient after the experts is the same on every tp rank).

[Note: expert gradient scale in the graph] The expert gradients are divided by the ``ep / tp`` distinct batches
of the ep group (``ep`` without tp) as in [Note: expert gradient scale] (``_expert_parallel.py``), but inside
the graph rather than by a hook on the parameters (a
hook does not survive ``torch.utils.swap_tensors``, which streamed init uses on meta parameters): the
gradient reaching the experts' output is divided by ``ep`` (so the parameters' gradients are) and the one
leaving their input multiplied back by it (so the tokens' gradients are unchanged). For a power of two both are
exact in floating point.

Source: transformers ``distributed/expert_parallel.py`` (``MoEParamShard`` slices dim 0 and sets
``num_experts``; ``AllToAllEP`` runs the local experts through the module's own forward on local ids);
GShard (arXiv 2006.16668, section 2) for the all-to-all dispatch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_elixir.chunk._stream_load import EXPERT_ROWS_ATTR
from hf_elixir.chunk._tp_slices import tp_slice
from hf_elixir.parallel._collectives import all_to_all, gather_last_dim, split_last_dim
from hf_elixir.placement._experts import SPLIT_ATTR

__all__ = ["FusedExpertDispatch", "shard_fused_experts"]


class FusedExpertDispatch:
    """The ``forward`` of an expert-parallel fused experts module (see the module docstring).

    Args:
        experts: the fused experts module, already holding its ``num_local_experts`` slices.
        num_experts: E, the layer's expert count before sharding.
        group / rank / size: the expert-parallel process group, this rank's index in it and its size.
        tp_group / tp_size: under tp x ep, the tensor-parallel group whose ranks split the tokens ([Note: tokens
            split over tp]); ``None`` / 1 otherwise.

    Call args (as the module's own forward): ``hidden_states`` ``(T, H)``; ``top_k_index`` ``(T, k)``
    int64 global expert ids; ``top_k_weights`` ``(T, k)`` routing weights. Returns ``(T, H)`` in
    ``hidden_states.dtype``: for every token the sum over its k choices of weight times expert output.
    """

    #: run the MoE permutation Triton kernels on CPU tensors too (tests, under ``TRITON_INTERPRET=1``)
    force_triton = False

    def __init__(self, experts: nn.Module, num_experts: int, group: Any, rank: int, size: int, *,
                 tp_group: Any = None, tp_size: int = 1) -> None:
        self.experts_forward = type(experts).forward.__get__(experts)  # the class's forward, no hooks
        self.num_experts, self.num_local_experts = num_experts, num_experts // size
        self.group, self.ep_rank, self.ep_size = group, rank, size
        self.tp_group, self.tp_size = tp_group, tp_size
        assert size % tp_size == 0, f"ep size {size} is not a multiple of tp size {tp_size}"
        # distinct batches in the ep group: [Note: expert gradient scale in the graph]
        self.num_batches = size // tp_size

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        if self.tp_size == 1:
            return self._dispatch(hidden_states, top_k_index, top_k_weights)
        # [Note: tokens split over tp]: this tp rank's slice of the tokens, the outputs gathered back
        num_tokens = hidden_states.shape[0]
        start, length = tp_slice(num_tokens, dist.get_rank(self.tp_group), self.tp_size)
        hidden_TH, weights_TK = (split_last_dim(t.transpose(0, 1), self.tp_group).transpose(0, 1).contiguous()
                                 for t in (hidden_states, top_k_weights))
        out = self._dispatch(hidden_TH, top_k_index[start:start + length], weights_TK)
        return gather_last_dim(out.transpose(0, 1), self.tp_group, num_tokens).transpose(0, 1).contiguous()

    def _dispatch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed sum of expert outputs for these tokens, over the ep group (the module docstring's steps)."""
        from triton_kernels import moe_permute, moe_unpermute  # noqa: PLC0415 (imports triton: lazy)

        num_tokens = hidden_states.shape[0]
        x_send, row_map_TK, counts_E = moe_permute(hidden_states, top_k_index, self.num_experts, None,
                                                   force_triton=self.force_triton)
        send_counts = counts_E.view(self.ep_size, self.num_local_experts)
        recv_counts = torch.empty_like(send_counts)  # [source ep rank, local expert]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # one host read
        x_recv = all_to_all(x_send, recv_splits, send_splits, self.group)
        y_recv = self._run_local(x_recv, recv_counts)
        y_back = all_to_all(y_recv, send_splits, recv_splits, self.group)
        # the routing weights keep their dtype (fp32 from most routers): the combine accumulates in fp32
        out = moe_unpermute(y_back, row_map_TK, top_k_weights, num_tokens, force_triton=self.force_triton)
        return out.to(hidden_states.dtype)

    def _run_local(self, x_recv: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs for the received rows ``(N, H)``; see [Note: idle fused experts]."""
        num_rows = x_recv.shape[0]
        if num_rows == 0:
            probe = x_recv.sum(dim=0, keepdim=True)  # one zero row, connected to the (empty) input
            ids = torch.zeros((1, 1), dtype=torch.long, device=x_recv.device)
            return self.experts_forward(probe, ids, probe.new_ones((1, 1)))[:0]
        local_ids = torch.arange(self.num_local_experts, device=x_recv.device).repeat(self.ep_size)
        local_ids = local_ids.repeat_interleave(recv_counts.flatten().to(x_recv.device), output_size=num_rows)
        if self.num_batches == 1:  # the ep group is one tp group: one batch, nothing to scale
            return self.experts_forward(x_recv, local_ids.unsqueeze(-1), x_recv.new_ones((num_rows, 1)))
        x_in = _ScaleGrad.apply(x_recv, float(self.num_batches))  # see [Note: expert gradient scale in the graph]
        y = self.experts_forward(x_in, local_ids.unsqueeze(-1), x_recv.new_ones((num_rows, 1)))
        return _ScaleGrad.apply(y, 1.0 / self.num_batches)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad * ctx.scale, None


def shard_fused_experts(experts: nn.Module, group: Any, rank: int, size: int, *, tp_group: Any = None,
                        tp_size: int = 1) -> int:
    """Keep this ep rank's experts of a fused experts module and make it dispatch tokens by all-to-all.

    In place: every fused parameter ``(E, ...)`` becomes a new ``nn.Parameter`` holding rows
    ``[rank * E / size, (rank + 1) * E / size)`` (a copy, so the full tensor can be freed; its gradient is
    divided by ``size`` in the graph); ``experts.num_experts`` becomes ``E / size``; ``experts.forward``
    becomes a :class:`FusedExpertDispatch`.

    Args:
        experts: a fused experts module (``hf_elixir.placement._experts.is_fused_experts``).
        group / rank / size: the expert-parallel process group, this rank's index in it and its size.
        tp_group / tp_size: under tp x ep, the tensor-parallel group splitting the tokens (see
            :class:`FusedExpertDispatch`).

    Returns:
        E, the expert count before sharding.

    Raises:
        ValueError: ``experts`` was already split per expert (``split_fused_experts``).
    """
    if getattr(experts, SPLIT_ATTR, None) is not None:
        raise ValueError(f"{type(experts).__name__} was already split per expert (split_fused_experts): call "
                         "hf_elixir.parallel.parallelize on the unmodified model; prepare splits each rank's experts "
                         "afterwards (ElixirConfig.split_fused_experts)")
    num_experts = experts.num_experts
    assert num_experts % size == 0, f"{num_experts} experts over ep size {size}"
    num_local = num_experts // size
    first = rank * num_local
    for name, param in list(experts.named_parameters(recurse=False)):
        local = nn.Parameter(param.detach()[first:first + num_local].clone(), requires_grad=param.requires_grad)
        setattr(local, EXPERT_ROWS_ATTR, (first, num_experts))  # streamed init reads these rows of the full tensor
        setattr(experts, name, local)
    experts.num_experts = num_local
    experts.forward = FusedExpertDispatch(experts, num_experts, group, rank, size, tp_group=tp_group, tp_size=tp_size)
    return num_experts
