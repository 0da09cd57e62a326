"""Expert parallel for Switch-Transformers style MoE layers.

The router stays replicated and unchanged, so the Hugging Face routing decisions (top-1 choice,
per-sequence ``expert_capacity`` with token dropping, jitter) and the router logits recorded for the
z-loss and the load-balancing loss are exactly Hugging Face's. Only the expert container is replaced:
each ep rank keeps ``num_experts / ep_size`` experts (names unchanged: ``expert_{global index}``),
and the routed tokens travel to the rank owning their expert and back with two all-to-alls.

Per step and MoE layer, on every ep rank (T local tokens, H hidden, E experts, L = E / ep local):

1. dispatch: ``expert_T`` = chosen expert of each token (-1 for a token the router dropped: an all-zero
   one-hot row); ``triton_kernels.moe_permute`` gathers the routed rows in expert order (stable), so
   the rows for ep rank r are contiguous.
2. all-to-all of the per-expert counts (ep x L ints), then of the token rows.
3. the received rows (grouped by source rank, then local expert) are regrouped by local expert
   (``moe_permute`` again); each local expert runs on its rows; see [Note: idle experts] for one
   that received none.
4. the outputs go back the same way (``moe_unpermute`` to undo the regrouping, the all-to-all back)
   and ``moe_unpermute`` combines them: out[t] = router probability * expert output, zero for a
   dropped token, as HF's ``index_add_`` into zeros does.

The permutations are the package's Triton kernels on CUDA and their PyTorch references elsewhere
([Note: dispatch rule] in ``triton_kernels/_dispatch.py``); ``ExpertParallelExperts.force_triton``
runs the kernels on CPU tensors under ``TRITON_INTERPRET=1`` (tests).

[Note: idle experts] Hugging Face runs only the experts some token was routed to (``expert_hit``), so
an expert without tokens gets no gradient (``.grad`` stays ``None``) and PyTorch's optimizers skip
it: no moment update, no weight decay. Running it on an empty batch would give it a zero gradient,
which counts as a gradient (Adam's momentum would move it). So a local expert that received no rows
is not called; its empty input stands in for its (empty) output, which keeps the backward of both
all-to-alls in the autograd graph on every rank (every rank joins the same collectives in backward).
Whether an expert *replica* had a gradient somewhere in its expert-data-parallel group is merged by
the has-gradient flags (``reduce_gradients`` here, the chunk manager's flags under ``prepare``).

[Note: expert gradient scale] An expert's gradient arrives summed over the tokens of all ``ep``
peers, which are ``ep`` distinct batches. A hook divides it by ``ep_size`` so that every parameter
follows one rule: *average the gradient over your own data-parallel group* (non-expert parameters
over all ranks, experts over the ranks holding the same experts), which is what a ZeRO
reduce-scatter with averaging (or DDP) does. The result is the gradient of the mean of all
per-batch losses.

Source: Switch Transformers (arXiv 2101.03961, section 2.2); Hugging Face
``SwitchTransformersExperts.forward`` (transformers 5.x) for the exact math.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_elixir.parallel._collectives import all_to_all

__all__ = ["ExpertParallelExperts"]


class ExpertParallelExperts(nn.ModuleDict):
    """Drop-in replacement for ``SwitchTransformersExperts`` holding only this rank's experts.

    Args:
        experts: the full container (``expert_{i}`` children, ``num_experts`` attribute).
        group: the expert-parallel process group; ``rank`` / ``size``: this rank's index and its size.

    Forward args (as Hugging Face's):
        hidden_states: ``(T, H)``; selected_experts: ``(T, 1, E)`` one-hot (all-zero = dropped);
        routing_weights: ``(T, 1)`` router probability of the chosen expert.
    Returns ``(T, H)``: each routed token's expert output times its probability; zeros for dropped.
    """

    def __init__(self, experts: nn.ModuleDict, group: Any, rank: int, size: int) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        assert self.num_experts % size == 0, f"{self.num_experts} experts over ep size {size}"
        self.num_local_experts = self.num_experts // size
        self.first_expert = rank * self.num_local_experts
        self.group, self.ep_rank, self.ep_size = group, rank, size
        for i in range(self.first_expert, self.first_expert + self.num_local_experts):
            self[f"expert_{i}"] = experts[f"expert_{i}"]
        self._grad_hooks = [  # see [Note: expert gradient scale]
            p.register_hook(lambda g, inv=1.0 / size: g * inv) for p in self.parameters() if p.requires_grad
        ] if size > 1 else []

    #: run the MoE permutation Triton kernels on CPU tensors too (tests, under ``TRITON_INTERPRET=1``)
    force_triton = False

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        from triton_kernels import moe_permute, moe_unpermute  # noqa: PLC0415 (imports triton: lazy, as the optimizer)

        hidden_TH = hidden_states
        num_tokens = hidden_TH.shape[0]
        mask_TE = selected_experts.reshape(num_tokens, self.num_experts)
        expert_T = torch.where(mask_TE.sum(dim=-1) > 0, mask_TE.argmax(dim=-1), -1)  # -1: dropped by the router
        x_send, row_map_T, send_counts_E = moe_permute(hidden_TH, expert_T, self.num_experts, None,
                                                       force_triton=self.force_triton)
        send_counts = send_counts_E.view(self.ep_size, -1)
        recv_counts = torch.empty_like(send_counts)  # [src ep rank, local expert]
        torch.distributed.all_to_all_single(recv_counts, send_counts, group=self.group)
        sent, received = torch.stack([send_counts, recv_counts]).tolist()  # one host read: the splits
        send_splits, recv_splits = [sum(row) for row in sent], [sum(row) for row in received]
        expert_rows = [sum(column) for column in zip(*received)]  # rows per local expert

        x_recv = all_to_all(x_send, recv_splits, send_splits, self.group)
        x_by_expert, regroup_map = self._group_by_local_expert(x_recv, recv_counts)
        outs = [self._run_expert(j, rows, hidden_TH.dtype) for j, rows in enumerate(x_by_expert.split(expert_rows))]
        y_by_expert = torch.cat(outs)
        if regroup_map is not None:  # back to (source rank, local expert) order
            y_recv = moe_unpermute(y_by_expert, regroup_map, y_by_expert.new_ones(x_recv.shape[0]), x_recv.shape[0],
                                   force_triton=self.force_triton)
        else:
            y_recv = y_by_expert
        y_back = all_to_all(y_recv, send_splits, recv_splits, self.group)
        return moe_unpermute(y_back, row_map_T, routing_weights.reshape(-1), num_tokens,
                             force_triton=self.force_triton).to(hidden_TH.dtype)

    def _group_by_local_expert(self, x_recv: torch.Tensor, recv_counts: torch.Tensor):
        """Rows arrive grouped by source rank, then by local expert: regroup them by local expert.

        Returns ``(rows grouped by local expert, row map to undo it)``; ``(x_recv, None)`` when there
        is one local expert (nothing to regroup)."""
        from triton_kernels import moe_permute  # noqa: PLC0415

        if self.num_local_experts == 1:
            return x_recv, None
        local_of_row = torch.arange(self.num_local_experts, device=x_recv.device).repeat(self.ep_size)
        local_of_row = local_of_row.repeat_interleave(recv_counts.flatten().to(x_recv.device),
                                                      output_size=x_recv.shape[0])
        grouped, regroup_map, _ = moe_permute(x_recv, local_of_row, self.num_local_experts, None,
                                              force_triton=self.force_triton)
        return grouped, regroup_map

    def _run_expert(self, local_index: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The local expert's output for ``rows`` (``N x H``), in ``dtype``; see [Note: idle experts]."""
        if rows.shape[0] == 0:
            return rows.to(dtype)  # not called: no gradient, as in HF; the empty input keeps the graph
        return self[f"expert_{self.first_expert + local_index}"](rows).to(dtype)
