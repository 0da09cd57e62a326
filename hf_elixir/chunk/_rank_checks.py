"""What the ranks must agree on at the end of each backward, merged by one all-reduce (MAX) per flag group: which
parameters have a gradient, whether every rank reduced its chunks in the same order, and whether every rank steps
with the same optimizer hyperparameters (and, riding along, the votes of [Note: agreed gathers ahead] in
``_agreed_gathers.py``). Nothing is read on the host here: the optimizer step's one host read reads the results.

[Note: has-gradient flags] One element per trainable parameter: 1.0 if it has a gradient since the last
zero_grad. On the compute device (they are all-reduced over the flag groups, and NCCL takes device memory only);
this backward's arrivals are kept on the host (``arrived_flags``, read by the hooks without a device sync) and
uploaded once at its end (:meth:`FlagsMixin._merge_flags`).

[Note: reduce order check] Nothing but the model's code makes the forward the same on every rank: a module called
on some ranks only (data-dependent control flow), or modules called in another order, gives the ranks different
reduce orders, and chunks of equal size then pair with the wrong chunk in their collectives: silently wrong
gradients (measured: parameters 0.2 relative off PyTorch after one step, no error). So the has-gradient flags'
all-reduce (one per backward already, MAX) carries two more numbers per flag group: ``code`` and ``-code``, a 24-bit
CRC of the order of the group's chunks in this backward (exact in float32). After the MAX, ``max(code) +
max(-code)`` is ``max - min`` over the group's ranks: zero iff every rank reduced in the same order. The result is
kept on the device (``reduce_order_mismatch``, no host read) and read by the step's one host read, which raises
before anything is updated: parameters and optimizer state stay as they were; ``zero_grad`` discards the
gradients and the mismatch with them. A mismatch of unequal sizes fails in the collective itself (gloo, NCCL).

[Note: hyperparameter check] The same all-reduce carries ``hyper`` and ``-hyper``: a 24-bit CRC of the optimizer's
hyperparameters (every param group's numbers, flags and strings: lr, weight_decay, betas, eps, ...) as this rank
holds them when its backward ends (``ChunkStepListener.hyper_code``, the optimizer's). Ranks that step with
different ones (``ReduceLROnPlateau`` stepped with each rank's own loss, an lr set from rank-local data) used to train on
silently: replicated copies drifted apart (5.8e-2 from PyTorch after a few steps, sharded chunks 3.3e-2), each
shard with its own rank's lr. DDP drifts the same way; hf_elixir raises at the step instead, before anything
is updated, as for the reduce order (``hyper_mismatch``). A value changed between the end of backward and
``step()`` is not seen; schedulers step after ``step()``, so the next backward carries their value.
"""

from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from hf_elixir.chunk._reduce_window import FLAGS_IN_FLIGHT
from hf_elixir.chunk.chunk import Chunk

__all__ = ["FlagsMixin", "RankChecks"]


class RankChecks:
    """The reduce order and hyperparameter checks ([Note: reduce order check], [Note: hyperparameter check]):
    this rank's codes, sent with the has-gradient flags' all-reduce (:meth:`values`), and the mismatches merged
    from its result (:meth:`merge`), on the compute device until the optimizer step reads them.

    Args:
        compute_device: where the merged mismatches live (the flags' device).
    """

    def __init__(self, compute_device: torch.device) -> None:
        # > 0 where the ranks of a flag group reduced its chunks in different orders in a backward since the last
        # step / zero_grad (one element, read by the step)
        self.reduce_order_mismatch = torch.zeros(1, device=compute_device)
        # > 0 where the ranks of a flag group stepped with different optimizer hyperparameters in a backward since
        # the last step / zero_grad
        self.hyper_mismatch = torch.zeros(1, device=compute_device)
        self.group_chunks: list[list[int]] = []  # per flag group, its chunk ids (set_groups)

    def set_groups(self, chunks: list[Chunk], flag_groups: list[tuple[object, torch.Tensor]]) -> None:
        """Record each flag group's chunks: those holding a trainable parameter whose flag index is in the group
        (read here, from the host indices ``flag_groups``: no device read later)."""
        self.group_chunks = []
        for _, indices in flag_groups:
            wanted = set(indices.tolist())
            self.group_chunks.append(sorted({c.chunk_id for c in chunks for slot in c.slots
                                             if slot.trainable and slot.flag_index in wanted}))

    def values(self, reduce_order: list[Chunk], hyper_code: int) -> list[list[float]]:
        """Per flag group, the four numbers this rank adds to its flags' all-reduce: ``[code, -code, hyper,
        -hyper]``, the codes of the group's reduce order and of the optimizer's hyperparameters (``hyper_code``,
        the listener's; 24-bit, exact in float32)."""
        hyper = float(hyper_code)  # [Note: hyperparameter check]
        return [[code, -code, hyper, -hyper] for code in self._order_codes(reduce_order)]

    def _order_codes(self, reduce_order: list[Chunk]) -> list[float]:
        """Per flag group, a 24-bit code of the order in which ``reduce_order`` (this backward's) reduced the
        group's chunks ([Note: reduce order check]); exact in the float32 flags."""
        position = {c.chunk_id: i for i, c in enumerate(reduce_order)}
        codes = []
        for members in self.group_chunks:
            order = sorted(members, key=lambda cid: position.get(cid, len(position)))
            codes.append(float(zlib.crc32(struct.pack(f"<{len(order)}q", *order)) & 0xFFFFFF))
        return codes

    def merge(self, part: torch.Tensor) -> None:
        """Fold one flag group's all-reduced values (``part``, its last four elements the MAX of :meth:`values`)
        into the mismatches."""
        # [Note: reduce order check] max(code) + max(-code) = max - min over the group's ranks
        self.reduce_order_mismatch = torch.maximum(self.reduce_order_mismatch,
                                                   part[-4:-2].sum().abs().reshape(1))
        self.hyper_mismatch = torch.maximum(self.hyper_mismatch, part[-2:].sum().abs().reshape(1))

    def reset(self) -> None:
        """Forget the mismatches (``zero_grad``: the gradients a mismatched order reduced are gone)."""
        self.reduce_order_mismatch.zero_()
        self.hyper_mismatch.zero_()


class FlagsMixin:
    """:class:`~hf_elixir.chunk.manager.ChunkManager`'s has-gradient flags and their all-reduce (a mixin: the
    all-reduce is one of the manager's in-flight collectives, ``_reduce.py``), and the :class:`RankChecks` it
    carries (``rank_checks``)."""

    def _init_flag_state(self) -> None:
        self.num_flags = 0
        # [Note: has-gradient flags]
        self.has_grad_flags = torch.zeros(0, device=self.compute_device)
        self.flag_groups: list[tuple[object, torch.Tensor]] = []  # (group of size > 1, flag indices)
        self.arrived_flags: set[int] = set()
        # host mirror of this rank's has-gradient arrivals since the last zero_grad (flag indices)
        self.local_flags: set[int] = set()
        self.rank_checks = RankChecks(self.compute_device)

    @property
    def reduce_order_mismatch(self) -> torch.Tensor:
        """``[1]`` on the compute device: > 0 where ranks reduced in different orders ([Note: reduce order check])."""
        return self.rank_checks.reduce_order_mismatch

    @property
    def hyper_mismatch(self) -> torch.Tensor:
        """``[1]`` on the compute device: > 0 where ranks hold different hyperparameters ([Note: hyperparameter
        check])."""
        return self.rank_checks.hyper_mismatch

    def init_flags(self, num_flags: int, flag_groups: list[tuple[object, torch.Tensor]]) -> None:
        """Allocate the has-gradient flags ([Note: has-gradient flags]) on the compute device.

        Args:
            num_flags: number of trainable parameters.
            flag_groups: ``(group, int64 indices)``: the flags of the parameters whose gradients are
                reduced over ``group`` (size > 1) are max-reduced over it at the end of backward.
        """
        self.num_flags = num_flags
        self.has_grad_flags = torch.zeros(num_flags, device=self.compute_device)
        self.flag_groups = [(group, indices.to(self.compute_device)) for group, indices in flag_groups]
        self.rank_checks.set_groups(self.chunks, flag_groups)

    def spec_flags(self, chunk: Chunk) -> frozenset[int]:
        """Flag indices of ``chunk``'s trainable slots that have a gradient on this rank so far (this
        backward's arrivals and earlier ones since ``zero_grad``): the has-gradient flags as this rank
        knows them before they are merged over ranks at the end of backward."""
        return frozenset(s.flag_index for s in chunk.slots if s.trainable and s.flag_index >= 0 and
                         (s.flag_index in self.arrived_flags or s.flag_index in self.local_flags))

    def _merge_flags(self) -> None:
        """This backward's arrivals -> ``has_grad_flags``: one upload of the arrived indices, then a MAX
        all-reduce per flag group, all on the compute device (no host read)."""
        flags = torch.zeros(self.num_flags, device=self.compute_device)
        if self.arrived_flags:
            arrived = torch.tensor(sorted(self.arrived_flags), dtype=torch.int64)
            flags[arrived.to(self.compute_device, non_blocking=True)] = 1.0
        # per group its "no room" votes ([Note: agreed gathers ahead] in _agreed_gathers.py) and its checks' (code,
        # -code, hyper, -hyper) (RankChecks.values), uploaded like the arrivals: no stream sync on CUDA
        checks = self.rank_checks.values(self._reduce_order, self.listener.hyper_code())
        extras = [self._ahead_votes(group) + mine for (group, _), mine in zip(self.flag_groups, checks)]
        extras_dev = (torch.tensor([v for e in extras for v in e]).to(self.compute_device, non_blocking=True)
                      if extras else None)
        parts, begin = [], 0
        for (group, indices), extra in zip(self.flag_groups, extras):
            parts.append((indices, torch.cat([flags[indices], extras_dev[begin:begin + len(extra)]]), group))
            begin += len(extra)
        works = [dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group, async_op=self.reduces.async_op)
                 for _, part, group in parts]
        self.local_flags |= self.arrived_flags
        self.arrived_flags = set()
        if any(len(e) > 4 for e in extras) and self.ahead_veto.numel() != len(self.chunks):
            self.ahead_veto = torch.ones(len(self.chunks), device=self.compute_device)

        def finish() -> None:
            for work, (indices, part, group) in zip(works, parts):
                if self.reduces.async_op:
                    work.wait()
                flags[indices] = part[:len(indices)]
                votes = part[len(indices):-4]
                if votes.numel():
                    self.ahead_veto[self._voter_index(group)] = votes
                self.rank_checks.merge(part)
            self.has_grad_flags = torch.maximum(self.has_grad_flags, flags)
        if self.reduces.async_op and works:  # waited by the step's read, timed like a reduce's wait
            self.reduces.issue(FLAGS_IN_FLIGHT, finish, timed=True)
        else:
            finish()
