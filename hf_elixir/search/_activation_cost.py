"""Cost of the block-wise activation policy: which blocks there are, the activation bytes each policy leaves on
the device, and the events where recomputation and offload copies happen. :mod:`._cost` replays them.

[Note: activation policy] Each profiled block (``profile_blocks``) keeps, recomputes or offloads its saved
activations (``ChunkedStep.activation_policy``; the runtime is ``hf_elixir/runtime/activations.py``):

* memory (:func:`activation_bytes`): the profiled peak less the activations of every non-keep block, plus the
  inputs a recomputed block keeps, plus the largest non-keep block (recomputed, or copied back, in backward);
* recompute: the block's forward events run again right before its backward (:func:`checkpointed_events`),
  chunks unsharded again for them as the runtime's pre-forward hooks do inside backward;
* offload: the block's bytes go device->host once per step and come back once, each at the host<->device
  rate. The runtime copies each tensor as autograd saves it; the model prices the block's copy as one
  transfer issued when its last forward event starts. Where copies overlap compute (CUDA,
  ``hardware.can_overlap``) that transfer runs on the activation stream while compute goes on. The copy back
  of the last offloaded block blocks its first backward event (the runtime onloads a block call's tensors at
  their first unpack, then the compute stream waits); every earlier offloaded block's copy back is issued
  when the backward of the offloaded block after it starts ([Note: activation onload ahead] in
  ``hf_elixir/runtime/activations.py``) and its first backward event waits only for what is left of it. The
  end of backward joins that stream. Off CUDA both copies are serial with compute. Memory: while a block
  is recomputed or copied back, the offloaded block before it may be on the device too
  (:func:`_backward_block_peak`). The bytes live on the host from forward to backward (``host_bytes``).
"""

from __future__ import annotations

from hf_elixir.profiler import StepProfile
from hf_elixir.runtime.activations import outermost

__all__ = ["DTYPE_BYTES", "activation_bytes", "checkpointed_events", "offload_events", "profile_blocks",
           "moved_kind", "policy_grid", "resolve_policy"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def profile_blocks(profile: StepProfile) -> list[str]:
    """The profile's outermost repeated blocks (``block_activation_bytes``; the runtime's
    ``hf_elixir.runtime.activations.transformer_blocks``), in the order the forward first enters them."""
    blocks = outermost(sorted(profile.block_activation_bytes))
    block_of = _BlockOf(blocks)
    first: dict[str, int] = {}
    for k, e in enumerate(profile.events):
        if e.phase == "fwd":
            b = block_of(e.module)
            if b is not None:
                first.setdefault(b, k)
    never = len(profile.events)
    return sorted(blocks, key=lambda b: (first.get(b, never), [int(p) if p.isdigit() else 0 for p in b.split(".")], b))


class _BlockOf:
    """``module`` -> the first of ``blocks`` that is it or holds it (``None``: none), looked up by the module's
    dotted prefixes (a few set lookups, not one string test per block: the 61 to 126 blocks of today's largest
    models over their thousands of events), each module once."""

    def __init__(self, blocks) -> None:
        self.rank = {b: i for i, b in reversed(list(enumerate(blocks)))}  # a name listed twice: its first place
        self.memo: dict[str, str | None] = {}

    def __call__(self, module: str) -> str | None:
        found = self.memo.get(module, self)
        if found is self:
            held = [p for p in _prefixes(module) if p in self.rank]
            found = self.memo[module] = min(held, key=self.rank.__getitem__) if held else None
        return found


def _prefixes(module: str) -> list[str]:
    """``module`` and the names it is nested in (``"a.b.c"``: ``"a"``, ``"a.b"``, ``"a.b.c"``): the ``b`` with
    ``module == b or module.startswith(b + ".")``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def resolve_policy(profile: StepProfile, policy: dict[str, str] | bool | None) -> dict[str, str]:
    """Every profiled block's policy: ``policy`` as a mapping (blocks it does not name: ``"keep"``), or the
    uniform switch of older callers (``True``: every block ``"recompute"``)."""
    blocks = profile_blocks(profile)
    if isinstance(policy, dict):
        return {b: policy.get(b, "keep") for b in blocks}
    return {b: "recompute" if policy else "keep" for b in blocks}


def checkpointed_events(profile: StepProfile, recompute: set[str] | None = None) -> list:
    """Insert each recomputed block's forward accesses again before its backward (what non-reentrant
    activation checkpointing re-runs); ``recompute`` = every outermost block when ``None``."""
    outer = profile_blocks(profile) if recompute is None else [b for b in profile_blocks(profile) if b in recompute]
    block_of = _BlockOf(outer)
    fwd_by_block: dict[str, list] = {}
    for e in profile.events:
        if e.phase == "fwd":
            b = block_of(e.module)
            if b is not None:
                fwd_by_block.setdefault(b, []).append(e)
    out = []
    recomputed: set[str] = set()
    for e in profile.events:
        b = block_of(e.module) if e.phase == "bwd" else None
        if b is not None and b not in recomputed:
            recomputed.add(b)
            out += [type(x)(phase="bwd", module=x.module, params=x.params, compute_s=x.compute_s, flops=x.flops)
                    for x in fwd_by_block.get(b, [])]
        out.append(e)
    return out


def activation_bytes(profile: StepProfile, precision: str, checkpointing: bool | dict[str, str]) -> int:
    """Activation peak (bytes) at ``precision`` under a block policy (``checkpointing``: a block -> policy
    mapping, or ``True`` for every block recomputed). A recomputed block keeps only its inputs; an offloaded
    block keeps nothing on the device; while one of them is recomputed or copied back in backward its whole
    activations are there again (the largest such block is added)."""
    scale = DTYPE_BYTES[precision] / max(1, profile.activation_dtype_bytes)
    peak = profile.activation_peak_bytes
    policy = resolve_policy(profile, checkpointing)
    moved = [b for b, kind in policy.items() if kind != "keep"]
    if moved:
        inside = sum(profile.block_activation_bytes[b] for b in moved)
        kept = sum(profile.block_input_bytes.get(b, 0) for b in moved if policy[b] == "recompute")
        peak = peak - inside + kept + _backward_block_peak(profile, policy)
    return int(peak * scale)


def _backward_block_peak(profile: StepProfile, policy: dict[str, str]) -> int:
    """The most bytes of non-keep blocks on the device at once in backward: a block recomputed or copied back,
    plus, while it is, the nearest offloaded block before it in forward order when that one is copied back ahead
    (an offloaded block at or after it started the copy: [Note: activation onload ahead] in
    ``hf_elixir/runtime/activations.py``)."""
    size = profile.block_activation_bytes
    blocks = list(policy)  # forward order (resolve_policy)
    best = 0
    for i, b in enumerate(blocks):
        if policy[b] == "keep":
            continue
        ahead = 0
        if any(policy[c] == "offload" for c in blocks[i:]):
            ahead = next((size[c] for c in reversed(blocks[:i]) if policy[c] == "offload"), 0)
        best = max(best, size[b] + ahead)
    return best


def offload_events(profile: StepProfile, events: list, policy: dict[str, str],
                    precision: str) -> tuple[dict[int, int], dict[int, int]]:
    """``(after, before)``: event index -> activation bytes an offloaded block copies to the host after its
    last forward event, and back before its first backward event ([Note: activation offload] in
    ``hf_elixir/runtime/activations.py``)."""
    scale = DTYPE_BYTES[precision] / max(1, profile.activation_dtype_bytes)
    offloaded = [b for b, kind in policy.items() if kind == "offload"]
    after: dict[int, int] = {}
    before: dict[int, int] = {}
    if not offloaded:
        return after, before
    # each module's offloaded blocks: those among its dotted prefixes (every one, were one nested in another)
    wanted = set(offloaded)
    names = {m: [p for p in _prefixes(m) if p in wanted] for m in {e.module for e in events}}
    uses: dict[str, dict[str, list[int]]] = {b: {"fwd": [], "bwd": []} for b in offloaded}
    for k, e in enumerate(events):
        for b in names[e.module]:
            uses[b].get(e.phase, []).append(k)
    for b in offloaded:
        nbytes = int(profile.block_activation_bytes[b] * scale)
        fwd, bwd = uses[b]["fwd"], uses[b]["bwd"]
        if fwd and bwd:
            after[fwd[-1]] = after.get(fwd[-1], 0) + nbytes
            before[bwd[0]] = before.get(bwd[0], 0) + nbytes
    return after, before


def policy_grid(profile: StepProfile, activations_on_device: bool, activation_checkpointing: bool | None,
                activation_policy: dict[str, str] | str | None) -> list[dict[str, str] | None]:
    """The activation policies to price ([Note: activation policy]), least memory-saving
    first: the caller's (a block mapping, one policy for every block, or the uniform
    ``activation_checkpointing``); else, when activations count in the budget, every block kept, then the
    first ``k`` blocks (in forward order) recomputed or offloaded and the rest kept, for a few ``k`` up to
    every block. ``None`` stands for ``activation_checkpointing`` alone (no blocks profiled)."""
    blocks = profile_blocks(profile)
    if isinstance(activation_policy, str):
        return [{b: activation_policy for b in blocks}]
    if isinstance(activation_policy, dict):
        return [{b: activation_policy.get(b, "keep") for b in blocks}]
    if activation_checkpointing is not None or not activations_on_device or not blocks:
        return [None]
    grid: list[dict[str, str] | None] = [{b: "keep" for b in blocks}]
    for k in sorted({1, round(len(blocks) ** 0.5), len(blocks)}):  # a few k, denser near 1
        for kind in ("offload", "recompute"):
            grid.append({b: kind if i < k else "keep" for i, b in enumerate(blocks)})
    return grid


def moved_kind(policy: dict[str, str] | None) -> str:
    """``"keep"`` for a policy that moves no block, else its (first) non-keep kind."""
    return next((v for v in (policy or {}).values() if v != "keep"), "keep")
