"""What the ranks must agree on at the end of each backward, merged by one all-reduce (MAX) per flag group: which
parameters have a gradient, whether every rank reduced its chunks in the same order, and whether every rank steps
with the same optimizer hyperparameters (and, riding along, the votes of [Note: agreed gathers ahead] in
``_agreed_gathers.py``). Nothing is read on the host here: the optimizer step's one host read reads the results.

[Note: has-gradient flags] One element per trainable parameter: 1.0 if it has a gradient since the last
zero_grad. On the compute device (they are all-reduced over the flag groups, and NCCL takes device memory only);
this backward's arrivals are kept on the host (``GradFlags.arrived``, read by the hooks without a device sync) and
uploaded once at its end (:meth:`GradFlags.merge`).

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
different ones (``ReduceLROnPlateau`` stepped with each rank's own loss, an lr set from rank-local data) used to
train on silently: replicated copies drifted apart (5.8e-2 from PyTorch after a few steps, sharded chunks 3.3e-2), each
shard with its own rank's lr. DDP drifts the same way; hf_elixir raises at the step instead, before anything
is updated, as for the reduce order (``hyper_mismatch``). A value changed between the end of backward and
``step()`` is not seen; schedulers step after ``step()``, so the next backward carries their value.
"""

from __future__ import annotations

import struct
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from hf_elixir.chunk._reduce_window import FLAGS_IN_FLIGHT, ReduceWindow
from hf_elixir.chunk.chunk import Chunk

__all__ = ["GradFlags", "RankChecks"]


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


class GradFlags:
    """The has-gradient flags ([Note: has-gradient flags]) and the :class:`RankChecks` that ride their all-reduce
    (``checks``): an object the manager owns (``ChunkManager.flags``). The all-reduce is one of the manager's
    in-flight collectives (:meth:`merge` issues it into the :class:`~hf_elixir.chunk._reduce_window.ReduceWindow`).

    Args:
        compute_device: where the flags live (NCCL reduces device memory only).

    Attributes:
        has_grad_flags: ``[num_flags]`` on the compute device, merged over ranks: 1.0 where a parameter has a
            gradient since the last ``zero_grad``.
        arrived: this backward's arrivals on this rank (flag indices, host; read by the hooks without a sync).
        local: host mirror of this rank's arrivals since the last ``zero_grad``.
    """

    def __init__(self, compute_device: torch.device) -> None:
        self.compute_device = compute_device
        self.num_flags = 0
        self.has_grad_flags = torch.zeros(0, device=compute_device)
        self.flag_groups: list[tuple[object, torch.Tensor]] = []  # (group of size > 1, flag indices)
        self.arrived: set[int] = set()
        self.local: set[int] = set()
        self.checks = RankChecks(compute_device)

    def init(self, num_flags: int, flag_groups: list[tuple[object, torch.Tensor]], chunks: list[Chunk]) -> None:
        """Allocate the flags on the compute device.

        Args:
            num_flags: number of trainable parameters.
            flag_groups: ``(group, int64 indices)``: the flags of the parameters whose gradients are
                reduced over ``group`` (size > 1) are max-reduced over it at the end of backward.
            chunks: every chunk of the manager (the checks record each group's).
        """
        self.num_flags = num_flags
        self.has_grad_flags = torch.zeros(num_flags, device=self.compute_device)
        self.flag_groups = [(group, indices.to(self.compute_device)) for group, indices in flag_groups]
        self.checks.set_groups(chunks, flag_groups)

    def spec(self, chunk: Chunk) -> frozenset[int]:
        """Flag indices of ``chunk``'s trainable slots that have a gradient on this rank so far (this
        backward's arrivals and earlier ones since ``zero_grad``): the has-gradient flags as this rank
        knows them before they are merged over ranks at the end of backward."""
        return frozenset(s.flag_index for s in chunk.slots if s.trainable and s.flag_index >= 0 and
                         (s.flag_index in self.arrived or s.flag_index in self.local))

    def zero(self, keep_has_grad: bool) -> None:
        """``zero_grad``: without ``keep_has_grad`` no parameter has a gradient; the checks' mismatches go with the
        gradients a mismatched order reduced."""
        if not keep_has_grad:
            self.has_grad_flags.zero_()
            self.local = set()
        self.checks.reset()

    def clear(self, flag_index: int) -> None:
        """One parameter has no gradient any more (``clear_param_grad``)."""
        self.has_grad_flags[flag_index] = 0.0
        self.local.discard(flag_index)

    def merge(self, extras: list[list[float]], reduces: ReduceWindow,
              take_votes: Callable[[object, torch.Tensor], None]) -> None:
        """This backward's arrivals -> ``has_grad_flags``: one upload of the arrived indices, then a MAX
        all-reduce per flag group, all on the compute device (no host read); issued into ``reduces`` when
        collectives are asynchronous, else finished here.

        Args:
            extras: per flag group, what rides its all-reduce after the flags: the votes of [Note: agreed gathers
                ahead], then the checks' four values (:meth:`RankChecks.values`).
            reduces: the manager's in-flight collectives.
            take_votes: ``(group, merged votes)``, called as the all-reduce finishes, for groups with votes.
        """
        flags = torch.zeros(self.num_flags, device=self.compute_device)
        if self.arrived:
            arrived = torch.tensor(sorted(self.arrived), dtype=torch.int64)
            flags[arrived.to(self.compute_device, non_blocking=True)] = 1.0
        # uploaded like the arrivals: no stream sync on CUDA
        extras_dev = (torch.tensor([v for e in extras for v in e]).to(self.compute_device, non_blocking=True)
                      if extras else None)
        parts, begin = [], 0
        for (group, indices), extra in zip(self.flag_groups, extras):
            parts.append((indices, torch.cat([flags[indices], extras_dev[begin:begin + len(extra)]]), group))
            begin += len(extra)
        async_op = reduces.async_op
        works = [dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group, async_op=async_op)
                 for _, part, group in parts]
        self.local |= self.arrived
        self.arrived = set()

        def finish() -> None:
            for work, (indices, part, group) in zip(works, parts):
                if async_op:
                    work.wait()
                flags[indices] = part[:len(indices)]
                votes = part[len(indices):-4]
                if votes.numel():
                    take_votes(group, votes)
                self.checks.merge(part)
            self.has_grad_flags = torch.maximum(self.has_grad_flags, flags)
        if async_op and works:  # waited by the step's read, timed like a reduce's wait
            reduces.issue(FLAGS_IN_FLIGHT, finish, timed=True)
        else:
            finish()
