"""The refresh of the compute copies from the fp32 masters after a step (``ElixirOptimizer``'s part).

After the update, every trained chunk's compute copy (its shard, or the full chunk where it aliases it) must
hold its master's new values: cast on one side where master and copy share it, copied across the bus where they
do not. The copies from host masters into device shards (uploads) are overlapped with what follows.

[Note: overlapped refresh] A chunk whose master is on the host and whose shard is on the device
(host optimizer state, resident or device-shard chunk) is *uploaded*: its master is cast on the host
into a pinned staging buffer of the compute dtype (Adam/AdamW: in the same pass as its update, [Note:
same-pass host step] in ``_same_pass.py``; else by the host lane right after its speculative step,
[Note: host lane], or here), then :meth:`Chunk.issue_refresh` copies it into the device shard on the
manager's copy stream with one event per chunk, in the order the next forward first uses the chunks
(:meth:`ChunkManager.next_use_order`). Nothing waits here: the chunk's first access (or anything else
that reads the shard: an unshard, ``write_back``, ``state_dict``, ``full_parameters``) makes the compute
stream wait for its event, so the next forward starts once its first chunk is up, not after every
upload. The start of backward drains what forward did not use, so the host lane may write the masters
and staging buffers again; a staging buffer is written only after the step's host read or the lane's
wait for a gradient copy, both ordered after that drain, so no upload still reads it. Casting on the
host halves the bytes on the bus: ``copy_`` from an fp32 host tensor into a bf16 device one with
``non_blocking=True`` moves fp32 and casts on the device, in an uncharged fp32 device temporary.
On the simulated device the copy is done at the wait and the parameters are stale placeholders until
then, so a read that skips the wait raises (as the hardware would return the old values); a write to the
upload's source (staging buffer or master) between the issue and the wait raises too, where the hardware
would upload the values of the issue time ([Note: strict refresh source] in ``hf_elixir/chunk/_chunk_refresh.py``).
Source: ZeRO-Offload (arXiv 2101.06840) section 4.2, the fp16 parameter copy overlapped with the next
step; FSDP2's per-parameter-group events on a side stream.

[Note: refresh cast] Where the cast of such an upload happens is the plan's ``refresh_cast``. ``"host"``
(above): the host lane pays the cast (about a fifth of the AdamW update, [Note: same-pass host step]),
PCIe carries ``b`` bytes per element. ``"device"``: no host staging buffer; the fp32 master itself is
uploaded, 4 bytes per element, on the same copy stream and event, through one fp32 device staging buffer
of at most ``REFRESH_STAGING_NUMEL`` elements (``hf_elixir/chunk/chunk.py``) that every such chunk
reuses block by block (upload a block, cast it into the shard on the device, next block: one stream, so
the buffer is never overwritten before its cast ran), charged to the device pool for the whole run. The
master is then what an upload reads, so it is written only after the upload finished: after backward's
drain (as the staging buffers above), or, for a step with no backward since the last, after
:meth:`step` waits for the pending upload. The search picks the side by cost
(``hf_elixir/search/_cost.py``): the host lane's cast against the doubled PCIe bytes and the device
staging bytes. Only for a compute dtype narrower than fp32: fp32 has nothing to cast.

[Note: early refresh] With the host lane speculating ([Note: host lane] in ``_overlap.py``), a chunk's
upload does not wait for the step: the main thread issues it during backward, at the first gradient
hook after the lane has stepped (and cast) the chunk and backward uses the chunk no more in the previous
step's order (``ChunkManager.used_no_more``: no later access, no parameter in COMPUTE, no gradient
waiting for another reduce of the chunk), so nothing reads
the compute copy the upload overwrites before the next forward. The host-to-device direction of the bus
is idle in backward (gradients go the other way), so most uploads are done when backward ends and the
next forward waits only for the last chunks the lane steps; with the cast on the device ([Note: refresh
cast]) the lane is left with the AdamW update alone. The upload carries speculative values until
``step()`` validates them: a kept speculation keeps its upload (``step`` skips it); one rolled back
waits for the upload first (``release_upload``: the undo writes what it reads) and the step uploads the
redone values; a wait for it before the step (the next micro-batch's forward when the lane mispredicted
the step, a state dict) goes through ``early_refresh_fence``, which undoes the speculative step and
uploads the values from before it. A gradient for the chunk after its early upload (the module order
changed within a backward) raises. Not under fp16 loss scaling: an overflow skips the step, and the
compute copies must then stay bit for bit as they were, which re-uploading a master the inverse update
restored to about one ulp ([Note: inverse rollback] in ``_inverse_adam.py``) would not guarantee.
Source: SuperOffload (arXiv 2509.21271) section 4, the parameter copy-back overlapped with the remaining
backward; priced in ``hf_elixir/search/_cost.py``.
"""

from __future__ import annotations

import torch

from hf_elixir.chunk import strict
from hf_elixir.chunk.chunk import Chunk, refresh_staging_numel

__all__ = ["RefreshMixin", "uploads", "uploads_cast"]


def uploads(chunk: Chunk) -> bool:
    """The chunk's refresh is an upload: fp32 master on the host, compute copy (shard) on the device."""
    return chunk.trainable and chunk.shard_on_device and not chunk.optim_on_device


def uploads_cast(chunk: Chunk) -> bool:
    """An upload whose compute dtype is not the master's: it reads a host staging buffer cast from the master."""
    return uploads(chunk) and chunk.dtype != torch.float32


class RefreshMixin:
    """``ElixirOptimizer``'s refresh of the compute copies: the staging buffers (``_refresh_staging``,
    ``_device_staging``, ``_staged``), the uploads and the waits that order writes of their sources."""

    def _init_refresh_buffers(self, host: list[Chunk]) -> None:
        """The staging buffers of the host optimizer chunks ``host``, and which of them refresh early."""
        manager = self.manager
        # [Note: overlapped refresh] the compute-dtype host copy each upload reads
        self._refresh_staging: dict[int, torch.Tensor] = {
            c.chunk_id: manager.host_empty(c.shard_numel, c.dtype) for c in host
            if uploads_cast(c) and self.refresh_cast == "host"}
        # [Note: refresh cast] or one fp32 device buffer the uploads go through, cast on the device
        self._device_cast: list[Chunk] = [c for c in host if uploads_cast(c) and self.refresh_cast == "device"]
        self._device_cast_ids = frozenset(c.chunk_id for c in self._device_cast)
        self._device_staging: torch.Tensor | None = None
        staging_numel = refresh_staging_numel([c.shard_numel for c in self._device_cast])
        if staging_numel:
            manager.pool.charge(staging_numel * 4, "the refresh cast's fp32 device staging buffer")
            self._device_staging = strict.register_device(
                torch.empty(staging_numel, dtype=torch.float32, device=manager.compute_device))
        self._staged: set[int] = set()  # chunks whose staging holds the master's current values
        # [Note: early refresh] chunks whose refresh is an upload the host lane may issue during backward (not
        # under fp16 loss scaling: a skipped step must leave the compute copies as they were, bit for bit)
        self.early_refresh_chunks = frozenset(c.chunk_id for c in host if uploads(c) and not self.scaler.enabled)

    def stage_refresh(self, cid: int) -> None:
        """Cast chunk ``cid``'s fp32 master into its host staging buffer (compute dtype), which its upload reads
        ([Note: overlapped refresh]); the host lane calls it right after the chunk's speculative step, so the
        cast overlaps backward. No-op for a chunk without staging."""
        staging = self._refresh_staging.get(cid)
        if staging is not None:
            with torch.no_grad():
                staging.copy_(self.masters[cid])
            self._staged.add(cid)

    def _release_staging(self, chunk: Chunk) -> None:
        """Before the chunk's staging buffer is written outside the host lane: an upload issued by the last step
        may still read it (a step with no backward since then: the backward's drain did not run)."""
        pending = chunk.pending_refresh
        if pending is not None and pending.event is not None:
            pending.event.synchronize()
        chunk.wait_refresh()

    def _release_master_reads(self) -> None:
        """Before masters are written on the host outside backward: wait (host sync on its event) for every
        pending upload that reads a master itself (fp32 compute copies, or the cast on the device, [Note: refresh
        cast]); backward's drain orders the host lane after them, a stream wait does not order the host."""
        for chunk in self.manager.chunks:
            pending = chunk.pending_refresh
            if pending is not None and pending.source is self.masters.get(chunk.chunk_id) and not pending.speculative:
                self._release_staging(chunk)  # (an early one is released by its rollback: [Note: early refresh])

    def _upload_source(self, chunk: Chunk) -> torch.Tensor:
        self._release_staging(chunk)
        cid = chunk.chunk_id
        if cid not in self._staged:
            self.stage_refresh(cid)
        self._staged.discard(cid)
        return self._refresh_staging.get(cid, self.masters[cid])

    def _refresh_compute_copies(self) -> None:
        """Make every trained chunk's compute copy hold its master's new values: cast or copied at once where
        master and copy share a side, else uploaded without a wait ([Note: overlapped refresh]), except the chunks
        the host lane uploaded during backward already ([Note: early refresh])."""
        import triton_kernels  # noqa: PLC0415

        counters = self.manager.counters
        to_upload = []
        for chunk in self.manager.chunks:
            if not chunk.trainable:
                continue
            master = self.masters[chunk.chunk_id]
            target = chunk.full if chunk.full_alias else chunk.shard
            if master is not target and uploads(chunk):
                to_upload.append(chunk)
            elif master is not target:
                same_side = master.device == target.device and strict.is_host(master) == strict.is_host(target)
                if self._disk is not None:  # a master or host shard in the disk tier ([Note: disk parameters])
                    self._disk.pages_in(chunk.chunk_id)
                if same_side and master.dtype != target.dtype:
                    # fp32 master -> bf16/fp16 compute copy on one device: the cast kernel (Triton on CUDA)
                    triton_kernels.cast_(master, target, force_triton=self._force_fused)
                else:
                    with strict.host_copies():  # onload / offload of the refreshed shard, counted below
                        target.copy_(master, non_blocking=True)
                if self._disk is not None:
                    self._disk.pages_out(chunk.chunk_id)
                if chunk.optim_on_device != chunk.shard_on_device:
                    nbytes = chunk.shard_bytes
                    if chunk.shard_on_device:
                        counters.h2d_bytes += nbytes
                    else:
                        counters.d2h_bytes += nbytes
            chunk.version += 1
            if chunk.full_alias:
                chunk.full_version = chunk.version
        early = self._lane.early if self._lane is not None else ()
        for chunk in self.manager.next_use_order(to_upload):
            if chunk.chunk_id not in early:  # uploaded during backward already ([Note: early refresh])
                self.issue_upload(chunk)

    def issue_upload(self, chunk: Chunk, speculative: bool = False) -> None:
        """Issue the upload refreshing ``chunk``'s device shard from its master ([Note: overlapped refresh]):
        the fp32 master cast on the device ([Note: refresh cast]), or its host staging buffer (cast now unless
        the step or the lane cast it already). ``speculative``: from a host-lane step ``step()`` has not
        validated yet ([Note: early refresh])."""
        if chunk.chunk_id in self._device_cast_ids:  # [Note: refresh cast] the fp32 master, cast on the device
            chunk.issue_refresh(self.masters[chunk.chunk_id], side_stream=self.manager.copy_stream,
                                staging=self._device_staging, speculative=speculative)
        else:
            chunk.issue_refresh(self._upload_source(chunk), side_stream=self.manager.copy_stream,
                                speculative=speculative)

    def release_upload(self, chunk: Chunk) -> None:
        """Wait (host sync on its event) until ``chunk``'s pending upload has read its source, and make it
        visible: before the source is written outside the step's order ([Note: early refresh])."""
        pending = chunk.pending_refresh
        if pending is not None:
            pending.speculative = False
        self._release_staging(chunk)
