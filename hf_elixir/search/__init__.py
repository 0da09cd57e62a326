"""Search: chunk size (padding + Belady onloads) and the configuration (resident chunks, cache blocks,
device shards, device optimizer states, prefetch, checkpointing) priced by a measured cost model,
producing an :class:`~hf_elixir.plan.ElixirPlan`."""

from hf_elixir.search._belady import belady_moves, belady_schedule, brute_force_moves
from hf_elixir.search._chunk_size import (ChunkSizeCandidate, ChunkSizeResult, chunk_groups, default_chunk_size,
                                         search_chunk_size)
from hf_elixir.search._cost import ChunkedStep, Knobs, Prediction, build_chunked_step, predict
from hf_elixir.search._degree_search import search_expert_parallel, search_parallel, search_tensor_parallel
from hf_elixir.search._expert_parallel import alltoall_bytes_per_layer, expert_parallel_degrees
from hf_elixir.search._plan_search import Candidate, SearchResult, auto_plan, brute_force_grid, search, search_plan
from hf_elixir.search._tensor_parallel import collective_bytes, tensor_parallel_degrees

__all__ = [
    "Candidate", "ChunkSizeCandidate", "ChunkSizeResult", "ChunkedStep", "Knobs", "Prediction", "SearchResult",
    "alltoall_bytes_per_layer", "auto_plan", "belady_moves", "belady_schedule", "brute_force_grid", "brute_force_moves",
    "build_chunked_step", "chunk_groups", "collective_bytes", "default_chunk_size", "expert_parallel_degrees",
    "predict", "search", "search_chunk_size", "search_expert_parallel", "search_parallel", "search_plan",
    "search_tensor_parallel", "tensor_parallel_degrees",
]
