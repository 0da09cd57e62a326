"""Chunks: contiguous 1-D buffers holding several parameters, sharded, moved and gathered as units."""

from hf_elixir.chunk.packing import ChunkLayout, pack_chunks, round_up

__all__ = ["ChunkLayout", "pack_chunks", "round_up"]
