"""Expert parallel for Switch-Transformers style MoE layers.

The router stays replicated and unchanged, so the Hugging Face routing decisions (top-1 choice,
per-sequence ``expert_capacity`` with token dropping, jitter) and the router logits recorded for the
z-loss and the load-balancing loss are exactly Hugging Face's. Only the expert container is replaced:
each ep rank keeps ``num_experts / ep_size`` experts (names unchanged: ``expert_{global index}``),
and the routed tokens travel to the rank owning their expert and back with two all-to-alls.

Per step and MoE layer, on every ep rank (T local tokens, H hidden, E experts, L = E / ep local):

1. ``expert_T`` = chosen expert of each routed token (dropped tokens: all-zero one-hot row, skipped);
   routed tokens sorted by expert (stable), so the rows for ep rank r are contiguous.
2. all-to-all of the per-expert counts (ep x L ints), then of the token rows.
3. each local expert runs on all rows it received (possibly none: it still runs on an empty tensor,
   so its gradient is a zero tensor and every rank issues the same collectives).
4. all-to-all back, scale by the router probability, scatter-add into zeros (as HF does).

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

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        hidden_TH = hidden_states
        mask_TE = selected_experts.reshape(hidden_TH.shape[0], self.num_experts)
        routed_T = mask_TE.sum(dim=-1) > 0
        token_idx = routed_T.nonzero().squeeze(1)
        expert_of_token = mask_TE[token_idx].argmax(dim=-1)
        order = torch.argsort(expert_of_token, stable=True)
        token_idx, expert_of_token = token_idx[order], expert_of_token[order]

        send_counts = torch.bincount(expert_of_token, minlength=self.num_experts).view(self.ep_size, -1)
        recv_counts = torch.empty_like(send_counts)  # [src ep rank, local expert]
        torch.distributed.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.sum(dim=1).tolist()
        recv_splits = recv_counts.sum(dim=1).tolist()

        x_recv = all_to_all(hidden_TH[token_idx], recv_splits, send_splits, self.group)
        # rows arrive grouped by source rank, then by local expert: regroup by local expert
        local_of_row = torch.repeat_interleave(
            torch.arange(self.num_local_experts, device=x_recv.device).repeat(self.ep_size), recv_counts.flatten()
        )
        by_expert = torch.argsort(local_of_row, stable=True)
        per_expert = x_recv[by_expert].split(recv_counts.sum(dim=0).tolist())
        outs = [self[f"expert_{self.first_expert + j}"](rows) for j, rows in enumerate(per_expert)]
        y_by_expert = torch.cat(outs).to(hidden_TH.dtype)
        y_recv = y_by_expert[torch.argsort(by_expert)]
        y_back = all_to_all(y_recv, send_splits, recv_splits, self.group)

        weights = routing_weights.reshape(-1)[token_idx].unsqueeze(-1)
        return torch.zeros_like(hidden_TH).index_add(0, token_idx, (y_back * weights).to(hidden_TH.dtype))
