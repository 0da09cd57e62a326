"""A chunk's refresh: the optimizer's new values of this rank's shard, uploaded from a host buffer into the device
shard without making the compute wait ([Note: overlapped refresh] in ``hf_elixir/optim/_refresh.py``), cast on
the device when the compute dtype is narrower ([Note: refresh cast] there), and waited for before anything reads
the shard. :data:`~hf_elixir.chunk.chunk.REFRESH_STAGING_NUMEL` sizes the cast's staging buffer.

The upload's source must not be written between the issue and the wait ([Note: strict refresh source] at
:meth:`ChunkRefreshMixin._check_refresh_source`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hf_elixir.chunk import strict

__all__ = ["ChunkRefreshMixin"]


@dataclass(eq=False)
class _PendingRefresh:
    """An upload of the optimizer's new values into the device shard issued by
    :meth:`Chunk.issue_refresh` and not yet waited ([Note: overlapped refresh]).

    Attributes:
        source: the host buffer it reads (pinned staging in the compute dtype, or the fp32 master),
            ``[shard_numel]``; not written again before the wait (checked there, ``stamp``).
        staging: with a cast on the device, the fp32 device buffer the master goes through block by block
            (``[<= REFRESH_STAGING_NUMEL]``); ``None``: ``source`` is in the compute dtype.
        event: CUDA event recorded after the copy on the side stream; ``None`` on the simulated device,
            where the copy itself is done by the wait.
        stamp: ``source``'s :func:`_write_stamp` at the issue; the wait raises if it changed ([Note: strict
            refresh source]).
    """

    source: torch.Tensor
    event: object
    staging: torch.Tensor | None = None
    stamp: tuple[int, int] = (0, -1)
    # issued during backward from a speculative host step that ``step()`` has not validated yet ([Note: early
    # refresh] in ``hf_elixir/optim/optimizer.py``): a wait before the validation goes through the manager's
    # ``early_refresh_fence`` first
    speculative: bool = False


def _write_stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """``(data_ptr, version counter)`` of ``tensor``: both stay equal while nothing writes it in place (the
    counter is shared with its views and bumped by every in-place op autograd sees) or rebinds its storage
    ([Note: strict refresh source]). An inference tensor has no counter: ``-1`` (its writes are not seen)."""
    return tensor.data_ptr(), (-1 if tensor.is_inference() else tensor._version)


class ChunkRefreshMixin:
    """:class:`~hf_elixir.chunk.chunk.Chunk`'s refresh verbs (a mixin: the refresh writes the chunk's shard, or
    ``full`` when it is the shard, and shows or hides its parameters)."""

    def issue_refresh(self, source: torch.Tensor, side_stream=None, staging: torch.Tensor | None = None,
                      speculative: bool = False) -> None:
        """Upload ``source`` (this rank's new shard values, a host buffer of ``shard_numel`` elements) into the
        device shard without making the compute wait ([Note: overlapped refresh] in
        ``hf_elixir/optim/optimizer.py``): on CUDA a non-blocking copy on ``side_stream`` and an event; on the
        simulated device the copy is left to :meth:`wait_refresh`, so a read that skips the wait sees the old
        values, and the parameters are stale placeholders until then (a read raises, [Note: stale placeholder]).
        With ``staging`` (an fp32 device buffer; ``source`` the fp32 master, the compute dtype narrower) the
        upload goes through it block by block and is cast on the device ([Note: refresh cast]).
        ``speculative``: issued during backward from an unvalidated host step ([Note: early refresh]).
        Counted in ``h2d_bytes`` (the source's bytes) and ``num_refreshes_ahead``."""
        assert strict.is_host(source) or source.device.type == "cpu", f"chunk {self.chunk_id}: refresh from device"
        assert source.numel() == self.shard_numel, f"chunk {self.chunk_id}"
        assert source.dtype == (torch.float32 if staging is not None else self.dtype), f"chunk {self.chunk_id}"
        assert staging is None or (staging.dtype == torch.float32 and not strict.is_host(staging)), \
            f"chunk {self.chunk_id}: the refresh cast's staging is an fp32 device buffer"
        self.wait_refresh()  # an earlier refresh never waited for (two steps without a forward)
        event = None
        if side_stream is not None:
            side_stream.wait_stream(torch.cuda.current_stream())  # after the compute's last read of the shard
            with self._disk_source(source), torch.cuda.stream(side_stream), torch.no_grad(), strict.host_copies():
                self._copy_refresh(source, staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side_stream)
        self.pending_refresh = _PendingRefresh(source, event, staging, _write_stamp(source), speculative)
        counters = self.manager.counters
        counters.h2d_bytes += source.numel() * source.element_size()
        counters.num_refreshes_ahead += 1
        self.hide_stale_params()

    def _copy_refresh(self, source: torch.Tensor, staging: torch.Tensor | None, non_blocking: bool) -> None:
        """The refresh's copies (inside ``strict.host_copies``): one copy into the device shard, or, with
        ``staging``, per block of ``staging.numel()`` elements an fp32 upload into it and a cast out of it on the
        device. On CUDA all on one stream, so a block's upload waits for the cast that read the buffer before."""
        target = self._refresh_target()
        if staging is None:
            target.copy_(source, non_blocking=non_blocking)
            return
        block = staging.numel()
        for lo in range(0, source.numel(), block):
            hi = min(lo + block, source.numel())
            staging[:hi - lo].copy_(source[lo:hi], non_blocking=non_blocking)
            target[lo:hi].copy_(staging[:hi - lo])  # fp32 -> compute dtype on the device (round to nearest even)

    def _disk_source(self, source: torch.Tensor):
        """A refresh reading an fp32 master in the disk tier's file: its region waited in for the copy and evicted
        after ([Note: disk parameters] in ``_disk_pages.py``; on CUDA a copy from pageable memory has read it when
        it returns)."""
        pages = self.manager.disk_pages
        return pages.reading(self.chunk_id, source) if pages is not None else contextlib.nullcontext()

    def _refresh_target(self) -> torch.Tensor:
        return self.full if self.full_alias else self.shard

    def wait_refresh(self, stream=None) -> None:
        """Make the refresh :meth:`issue_refresh` issued visible: on CUDA ``stream`` (default: the current one)
        waits for its event (no host sync); on the simulated device the copy is done here. The parameters of a
        current chunk point at ``full`` again. A refresh issued from a speculative host step that ``step()`` has
        not validated yet ([Note: early refresh] in ``hf_elixir/optim/_refresh.py``) is a misprediction when
        anything waits for it first: the manager's ``early_refresh_fence`` undoes that step and uploads the
        values from before it, which this then waits for.

        Raises:
            RuntimeError: the refresh's source was written in place (or its storage rebound) since
                :meth:`issue_refresh`: a race with the upload on CUDA ([Note: strict refresh source]); the
                refresh is dropped (the shard keeps its old values).
        """
        early = self.pending_refresh
        if early is not None and early.speculative:
            early.speculative = False
            self.manager.listener.early_refresh_fence(self)  # may issue a new refresh in its place
        pending, self.pending_refresh = self.pending_refresh, None
        if pending is None:
            return
        self._check_refresh_source(pending)
        if pending.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(pending.event)
        else:
            with self._disk_source(pending.source), torch.no_grad(), strict.host_copies():
                self._copy_refresh(pending.source, pending.staging, non_blocking=False)
        if not self.needs_fill():
            self.show_params()

    def _check_refresh_source(self, pending: _PendingRefresh) -> None:
        """[Note: strict refresh source] On CUDA :meth:`issue_refresh` queues a non-blocking host->device copy on
        the copy stream: the DMA reads ``source`` some time between the issue and the event, so a host write to
        ``source`` before the host knows the copy finished (its event synchronised) uploads the old values, or a
        torn mix of old and new. The simulated device copies at the wait, so it would upload the new values and
        hide that race. Both paths therefore stamp the source at the issue (``data_ptr`` and the version counter,
        :func:`_write_stamp`) and compare at the wait: a changed stamp raises. Every writer of a master or a
        staging buffer bumps the counter: ``copy_`` and the ``_foreach_*`` ops of the inverse rollback do it
        themselves; ``torch._fused_adam(w)_`` does not (PyTorch 2.13, direct or via ``torch.optim.AdamW(
        fused=True)``), so the same-pass step (``hf_elixir/optim/_same_pass.py``) and the inner optimizer's step
        (``ElixirOptimizer._run_inner``) bump it with ``torch.autograd.graph.increment_version`` after the
        kernel. A write through ``.data`` is not seen (new counter): the masters are not written that way. The
        sanctioned order is the one of ``ElixirOptimizer._release_staging`` (synchronise the event, wait, then
        write) or the start of backward's drain (the host lane writes only after it). Cost: two integer reads per
        issue and per wait."""
        stamp = _write_stamp(pending.source)
        if stamp == pending.stamp:
            return
        what = ("rebound to other storage" if stamp[0] != pending.stamp[0] else
                f"written in place (version counter {pending.stamp[1]} -> {stamp[1]})")
        raise RuntimeError(
            f"chunk {self.chunk_id}: the host buffer its refresh uploads (the {tuple(pending.source.shape)} "
            f"{'fp32 master' if pending.source.dtype == torch.float32 else 'staging buffer'}) "
            f"was {what} between issue_refresh and wait_refresh. On CUDA the upload is a non-blocking copy queued at "
            "issue_refresh, so it would have read the values of the issue time (or a torn mix), not the new ones. "
            "Wait for the refresh before writing its source (ElixirOptimizer._release_staging: synchronise its "
            "event, then Chunk.wait_refresh)")
