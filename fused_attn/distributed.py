"""Ring attention: exact attention over a sequence sharded across the ranks of a torch.distributed group.

Each rank holds a slice of the sequence, (B, H, L_local, D), for query, key and value alike. The key and
value blocks travel around the ring (rank r sends to r + 1 and receives from r - 1) while every rank
attends its queries to the block it holds: W steps for W ranks, each one fused call with its log-sum-exp,
the next block's transfer running during the call. The partial outputs are merged through their
log-sum-exps in float32 (float64 for float64 inputs):

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

The backward goes round the ring the same way: each step's kernel gets the final output and
log-sum-exp, so its gradients are exactly that block's share; dQ stays home, while dK and dV
accumulate in float32 as they travel with their block and come home after the last step. Every block's
gradient is summed in the same order whatever the timing, so the backward is deterministic for a world
size.

Layouts. Under `is_causal`, a contiguous split leaves the last rank with W times the work of the first.
`layout="zigzag"` cuts the sequence into 2W chunks and gives rank r chunks r and 2W - 1 - r, so every rank
sees the same number of visible scores. `shard` and `gather` move a full sequence into a layout and
back. Which keys of a block a rank's queries see is worked out from the chunks' global positions, so
the two layouts, sliding windows (ring steps outside the window are skipped) and queries and keys of
different lengths all use the same plan.

Dropout and ALiBi depend on an element's global (i, j). With either, each step runs one call per pair of
chunks, told where its block sits in the whole sequence: the diagonal's offset as an integer alignment
(fused_attn.scores), which places the band and ALiBi's distances, and the block's first query and key
positions in the dropout stream (fused_attn.dropout), whose seed rank 0 draws and broadcasts. So the ring
drops exactly the elements the single-device call drops for the same seed. Arbitrary `attn_mask`s are not
taken (use key_padding_mask, sharded with the keys).

Every rank must call `ring_attention` (and its backward) with shards of equal shapes, in the same order.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import ops
from .backends import registry
from .checks import _check_generator, _check_inputs, _check_key_padding_mask, _check_options
from .dropout import next_rng, shifted_rng
from .problem import Problem, lse_dtype
from .scores import UNBOUNDED, ScoreVariant, sink_gradient, variant_of, with_sinks

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------------------------------
# Layouts: which chunks of the global sequence a rank holds
# ---------------------------------------------------------------------------------------------------

def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def _chunk_indices(layout: str, rank: int, world: int) -> list[int]:
    """The global chunk numbers rank `rank` holds, in their local order (ascending)."""
    if layout == "zigzag":
        return [rank, 2 * world - 1 - rank]
    return [rank]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A run of positions held by one rank: local rows [local, local + length) are global positions
    [start, start + length)."""

    local: int
    start: int
    length: int


def rank_chunks(layout: str, rank: int, world: int, local_length: int) -> list[Chunk]:
    """The chunks of the shard of `local_length` positions that rank `rank` holds."""
    per_rank = chunks_per_rank(layout)
    size = local_length // per_rank
    return [Chunk(i * size, index * size, size) for i, index in enumerate(_chunk_indices(layout, rank, world))]


def _group_rank_and_size(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fused_attn.distributed: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (gloo on CPU, nccl on GPU)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, layout: str = "contiguous", dim: int = 2, group=None) -> torch.Tensor:
    """This rank's part of the full sequence `x` (the same on every rank) along `dim`, in `layout`.

    contiguous: the rank-th of W equal slices (a view). zigzag: chunks r and 2W - 1 - r of 2W equal
    chunks, concatenated. The length along `dim` must be a multiple of W (contiguous) or 2W (zigzag).
    Differentiable. For a key_padding_mask (B, L), pass dim=1.
    """
    _check_layout(layout)
    rank, world = _group_rank_and_size(group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    length = x.shape[dim]
    pieces = world * chunks_per_rank(layout)
    if length % pieces:
        raise ValueError(f"x: the sequence length along dim {dim} must be a multiple of {pieces} for "
                         f"layout={layout!r} over {world} ranks, got {length}; pad the sequence "
                         f"(and hide the padding with key_padding_mask)")
    size = length // pieces
    parts = [x.narrow(dim, index * size, size) for index in _chunk_indices(layout, rank, world)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def gather(x_local: torch.Tensor, layout: str = "contiguous", dim: int = 2, group=None) -> torch.Tensor:
    """The full sequence from every rank's shard along `dim` (the inverse of `shard`), on every rank.

    Not differentiable: for results, checks and logging (compute losses on the shards)."""
    _check_layout(layout)
    _, world = _group_rank_and_size(group)
    sent = x_local.detach().contiguous()
    is_bool = sent.dtype == torch.bool
    if is_bool:  # gloo moves bytes, not bools
        sent = sent.view(torch.uint8)
    received = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(received, sent, group=group)
    if is_bool:
        received = [part.view(torch.bool) for part in received]
    if layout == "contiguous":
        return torch.cat(received, dim)
    halves = [part.chunk(2, dim) for part in received]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim)


# ---------------------------------------------------------------------------------------------------
# Plans: which part of a key block a rank's queries see at one ring step
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Part:
    """One kernel call of a step: local query rows q0:q1 against block keys k0:k1; within them query
    i sees key j iff -left <= j - i <= right (None: unbounded), as the kernels' top-left window. A part
    of one chunk pair also knows the global positions of its first query and key (None for a part that
    spans several chunks)."""

    q0: int
    q1: int
    k0: int
    k1: int
    left: int | None = None
    right: int | None = None
    q_start: int | None = None
    k_start: int | None = None

    def shifted(self, rows: int, keys: int) -> "Part":
        return dataclasses.replace(self, q0=self.q0 + rows, q1=self.q1 + rows, k0=self.k0 + keys,
                                   k1=self.k1 + keys)

    def placed(self, q_chunk: "Chunk", k_chunk: "Chunk") -> "Part":
        """This part of a chunk pair (indices within the chunks) in local indices, with its global positions."""
        return dataclasses.replace(self.shifted(q_chunk.local, k_chunk.local), q_start=q_chunk.start + self.q0,
                                   k_start=k_chunk.start + self.k0)

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None


def visible_part(low: int | None, high: int | None, delta: int, len_q: int, len_k: int) -> Part | None:
    """The smallest part of a (len_q × len_k) block holding every visible score, or None if none is.

    Query i sees key j iff low <= j - i - delta <= high (None: unbounded), delta being the first
    query's position minus the first key's. A band wholly below the diagonal drops the first queries
    (which see nothing), one wholly above it the first keys, so that the rest is a window the kernels
    take (both bounds >= 0); queries and keys past the band's end are dropped too.
    """
    low = None if low is None else low + delta
    high = None if high is None else high + delta
    if (high is not None and high < -(len_q - 1)) or (low is not None and low > len_k - 1):
        return None
    first_q = max(0, -high) if high is not None else 0
    first_k = max(0, low) if low is not None else 0
    end_q = min(len_q, len_k - low) if low is not None else len_q
    end_k = min(len_k, len_q + high) if high is not None else len_k
    shift = first_q - first_k
    left = None if low is None else -(low + shift)
    right = None if high is None else high + shift
    # Bounds that the sliced block cannot reach are no bounds: one description per visibility.
    if left is not None and left >= end_q - first_q - 1:
        left = None
    if right is not None and right >= end_k - first_k - 1:
        right = None
    return Part(first_q, end_q, first_k, end_k, left, right)


def plan_step(low: int | None, high: int | None, q_chunks: list[Chunk], k_chunks: list[Chunk],
              merge: bool = True) -> list[Part]:
    """The kernel calls for a rank's query chunks against a key block's chunks, global distance J - I
    bounded by [low, high]: one call where one describes the visible scores (with `merge`), else one per
    chunk pair."""
    pairs = {}
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            part = visible_part(low, high, qc.start - kc.start, qc.length, kc.length)
            if part is not None:
                pairs[qi, ki] = part
    if not pairs:
        return []
    if merge:
        whole = _as_one_rectangle(pairs, q_chunks, k_chunks) or _as_one_band(low, high, q_chunks, k_chunks)
        if whole is not None:
            return [whole]
    return [part.placed(q_chunks[qi], k_chunks[ki]) for (qi, ki), part in pairs.items()]


def _as_one_rectangle(pairs, q_chunks, k_chunks) -> Part | None:
    """A single unmasked call when every visible pair is wholly visible and they form a rectangle of
    neighbouring chunks (zigzag's steps off the diagonal)."""
    if not all(part.is_full and part.q1 - part.q0 == q_chunks[qi].length and part.k1 - part.k0 == k_chunks[ki].length
               for (qi, ki), part in pairs.items()):
        return None
    rows = sorted({qi for qi, _ in pairs})
    keys = sorted({ki for _, ki in pairs})
    if len(pairs) != len(rows) * len(keys) or rows != list(range(rows[0], rows[-1] + 1)) \
            or keys != list(range(keys[0], keys[-1] + 1)):
        return None
    return Part(q_chunks[rows[0]].local, q_chunks[rows[-1]].local + q_chunks[rows[-1]].length,
                k_chunks[keys[0]].local, k_chunks[keys[-1]].local + k_chunks[keys[-1]].length)


def _as_one_band(low, high, q_chunks, k_chunks) -> Part | None:
    """A single call over the whole local block whose band, in local positions, shows each chunk pair
    exactly what it sees globally (zigzag's own block under is_causal: one causal call)."""
    shifts = {(qc.start - qc.local) - (kc.start - kc.local) for qc in q_chunks for kc in k_chunks}
    for shift in sorted(shifts):
        local_low = None if low is None else low + shift
        local_high = None if high is None else high + shift
        if all(visible_part(low, high, qc.start - kc.start, qc.length, kc.length)
               == visible_part(local_low, local_high, qc.local - kc.local, qc.length, kc.length)
               for qc in q_chunks for kc in k_chunks):
            return visible_part(local_low, local_high, 0, sum(c.length for c in q_chunks),
                                sum(c.length for c in k_chunks))
    return None


# ---------------------------------------------------------------------------------------------------
# Communication around the ring
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Traffic:
    """Bytes this process has sent by ring attention (forward and backward), for benchmarks."""

    sent_bytes: int = 0

    def reset(self) -> None:
        self.sent_bytes = 0


traffic = Traffic()


def _global_rank(group, rank: int) -> int:
    """The global rank of `group`'s rank `rank` (point-to-point operations and broadcasts take global ranks)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def _shared_rng(device: torch.device, generator, group) -> torch.Tensor:
    """The call's dropout stream: drawn on every rank, so that each rank's generator advances as a
    single-device call's would, and rank 0's sent to all, so that every rank drops from the same stream."""
    rng = next_rng(device, generator)
    dist.broadcast(rng, src=_global_rank(group, 0), group=group)
    return rng


class _Transfer:
    """Tensors in flight to the next rank while the same number arrive from the previous one."""

    def __init__(self, tensors: list[torch.Tensor], group, rank: int, world: int, first_tag: int = 0):
        self.tensors = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        self.received = [torch.empty_like(t) for t in self.tensors]
        next_rank, prev_rank = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)
        # Distinct tags keep gloo from pairing one tensor's receive with another's send, as when the
        # key/value and the gradient transfers are in flight together (NCCL ignores tags and keeps order).
        operations = [dist.P2POp(dist.isend, t, next_rank, group, tag)
                      for tag, t in enumerate(self.tensors, first_tag)]
        operations += [dist.P2POp(dist.irecv, t, prev_rank, group, tag)
                       for tag, t in enumerate(self.received, first_tag)]
        self.works = dist.batch_isend_irecv(operations)
        traffic.sent_bytes += sum(t.numel() * t.element_size() for t in self.tensors)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


_GRADIENT_TAGS = 8  # the gradients' tags start past those of key, value and padding


@dataclasses.dataclass
class _KeyBlock:
    """The keys, values and key padding of one rank, as they travel round the ring (the padding as
    bytes: gloo moves no bools)."""

    key: torch.Tensor
    value: torch.Tensor
    padding: torch.Tensor | None

    @classmethod
    def of(cls, key, value, key_padding_mask) -> "_KeyBlock":
        padding = None if key_padding_mask is None else key_padding_mask.contiguous().view(torch.uint8)
        return cls(key, value, padding)

    @property
    def length(self) -> int:
        return self.key.shape[2]

    def send_on(self, ring: "_Ring") -> _Transfer:
        tensors = [self.key, self.value] + ([] if self.padding is None else [self.padding])
        return _Transfer(tensors, ring.group, ring.rank, ring.world)

    @classmethod
    def received(cls, transfer: _Transfer) -> "_KeyBlock":
        key, value, *padding = transfer.wait()
        return cls(key, value, padding[0] if padding else None)

    def keys_of(self, part: Part):
        """(key, value, key_padding_mask) of the part's keys."""
        keys = slice(part.k0, part.k1)
        padding = None if self.padding is None else self.padding[:, keys].view(torch.bool)
        return self.key[:, :, keys], self.value[:, :, keys], padding


# ---------------------------------------------------------------------------------------------------
# The ring, forward and backward
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Ring:
    """What every step of one call needs to know besides the tensors."""

    group: object
    rank: int
    world: int
    layout: str
    low: int | None   # global J - I bounds of the visible band
    high: int | None
    offset: int       # the global diagonal: query I's is key I + offset
    scale: float
    softcap: float
    alibi_slopes: torch.Tensor | None  # (B, H_q) float32
    dropout_p: float
    rng: torch.Tensor | None  # the call's dropout stream, the same on every rank
    backend: str

    @property
    def positional(self) -> bool:
        """Whether scores depend on global positions beyond the band (ALiBi, dropout): then every kernel
        call covers one chunk pair, a block of the whole sequence at known positions."""
        return self.alibi_slopes is not None or self.rng is not None

    def plan(self, step: int, len_q: int, len_k: int) -> list[Part]:
        source = (self.rank - step) % self.world
        return plan_step(self.low, self.high, rank_chunks(self.layout, self.rank, self.world, len_q),
                         rank_chunks(self.layout, source, self.world, len_k), merge=not self.positional)

    def call(self, part: Part) -> tuple[bool, ScoreVariant, torch.Tensor | None]:
        """(is_causal, score variant, dropout rng) of a part's kernel call."""
        if not self.positional:  # the part's own band, top-left in its local indices
            is_causal = part.right == 0
            left = UNBOUNDED if part.left is None else part.left
            right = UNBOUNDED if part.right is None or is_causal else part.right
            return is_causal, ScoreVariant(window_left=left, window_right=right, softcap=self.softcap), None
        # The global band around the block's own diagonal, which the integer alignment places.
        left = UNBOUNDED if self.low is None else self.offset - self.low
        right = UNBOUNDED if self.high is None else self.high - self.offset
        is_causal = right == 0
        variant = ScoreVariant(window_left=left, window_right=UNBOUNDED if is_causal else right, softcap=self.softcap,
                               alibi_slopes=self.alibi_slopes,
                               diagonal_shift=part.q_start - part.k_start + self.offset)
        rng = None if self.rng is None else shifted_rng(self.rng, query_start=part.q_start, key_start=part.k_start)
        return is_causal, variant, rng


def _merge(out_acc, lse_acc, out_part, lse_part) -> None:
    """Folds a partial result into the accumulators, in place, through the stable logaddexp."""
    merged = torch.logaddexp(lse_acc, lse_part)
    # Rows that have seen no key yet stay at 0 with -inf, instead of exp(-inf - -inf) = NaN.
    base = merged.masked_fill(merged == float("-inf"), 0.0)
    out_acc.mul_(torch.exp(lse_acc - base).unsqueeze(-1))
    out_acc.add_(torch.exp(lse_part - base).unsqueeze(-1) * out_part)
    lse_acc.copy_(merged)


def _ring_forward(ring: _Ring, query, key, value, key_padding_mask, sinks):
    batch, heads, len_q, _ = query.shape
    acc_dtype = lse_dtype(query.dtype)
    out_acc = query.new_zeros((batch, heads, len_q, value.shape[-1]), dtype=acc_dtype)
    lse_acc = query.new_full((batch, heads, len_q), float("-inf"), dtype=acc_dtype)
    block = _KeyBlock.of(key, value, key_padding_mask)
    for step in range(ring.world):
        # The next block is on its way while this one is attended.
        transfer = block.send_on(ring) if step + 1 < ring.world else None
        for part in ring.plan(step, len_q, block.length):
            part_key, part_value, part_padding = block.keys_of(part)
            is_causal, variant, rng = ring.call(part)
            out, lse = ops.attention(query[:, :, part.q0:part.q1], part_key, part_value, None, part_padding, is_causal,
                                     ring.scale, ring.dropout_p, rng, False, ring.backend, variant)
            _merge(out_acc[:, :, part.q0:part.q1], lse_acc[:, :, part.q0:part.q1], out, lse)
        if transfer is not None:
            block = _KeyBlock.received(transfer)
    # The sinks join each row's softmax once, after its keys of every rank.
    out_acc, lse_acc = with_sinks(lse_acc, out_acc, sinks)
    return out_acc.to(query.dtype), lse_acc


def _ring_backward(ring: _Ring, grad_out, grad_lse, query, key, value, key_padding_mask, out, lse):
    acc_dtype = lse_dtype(query.dtype)
    grad_query = torch.zeros(query.shape, dtype=acc_dtype, device=query.device)
    len_q = query.shape[2]
    block = _KeyBlock.of(key, value, key_padding_mask)
    grads_transfer = None
    for step in range(ring.world):
        transfer = block.send_on(ring) if step + 1 < ring.world else None
        grad_key = torch.zeros(block.key.shape, dtype=acc_dtype, device=query.device)
        grad_value = torch.zeros(block.value.shape, dtype=acc_dtype, device=query.device)
        for part in ring.plan(step, len_q, block.length):
            rows = slice(part.q0, part.q1)
            is_causal, variant, rng = ring.call(part)
            part_key, part_value, part_padding = block.keys_of(part)
            # The final output and log-sum-exp make each block's gradients exactly its share.
            part_grads = ops.attention_bwd(
                grad_out[:, :, rows], None if grad_lse is None else grad_lse[:, :, rows], query[:, :, rows],
                part_key, part_value, out[:, :, rows], lse[:, :, rows], None, part_padding, is_causal, ring.scale,
                ring.dropout_p, rng, ring.backend, False, *variant.op_args())
            grad_query[:, :, rows] += part_grads[0]
            grad_key[:, :, part.k0:part.k1] += part_grads[1]
            grad_value[:, :, part.k0:part.k1] += part_grads[2]
        # The block's gradients so far arrive from the previous rank; add ours and pass them on. After
        # the last step, what arrives is this rank's own block, summed over every rank.
        if grads_transfer is not None:
            travelled_key, travelled_value = grads_transfer.wait()
            grad_key += travelled_key
            grad_value += travelled_value
        if ring.world > 1:
            grads_transfer = _Transfer([grad_key, grad_value], ring.group, ring.rank, ring.world,
                                       first_tag=_GRADIENT_TAGS)
        if transfer is not None:
            block = _KeyBlock.received(transfer)
    if grads_transfer is not None:
        grad_key, grad_value = grads_transfer.wait()
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, key_padding_mask, sinks, ring: _Ring):
        out, lse = _ring_forward(ring, query, key, value, key_padding_mask, sinks)
        ctx.save_for_backward(query, key, value, key_padding_mask, sinks, out, lse)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, key_padding_mask, sinks, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grads = _ring_backward(ctx.ring, grad_out, grad_lse, query, key, value, key_padding_mask, out, lse)
        # This rank's rows' share, as for any parameter replicated over the ranks.
        grad_sinks = sink_gradient(sinks, lse, out, grad_out, grad_lse) if ctx.needs_input_grad[4] else None
        return (*grads, None, grad_sinks, None)


def _band(is_causal: bool, variant, len_q: int, len_k: int):
    """The visible band as global bounds on J - I: [low, high], None for unbounded."""
    left, right = variant.bounds(is_causal)
    offset = variant.offset(len_q, len_k)
    low = None if left == UNBOUNDED else offset - left
    high = None if right == UNBOUNDED else offset + right
    return low, high


def ring_attention(query, key, value, *, group=None, is_causal=False, layout="contiguous", scale=None,
                   enable_gqa=False, key_padding_mask=None, window_size=None, causal_alignment="top_left",
                   softcap=None, dropout_p=0.0, alibi_slopes=None, sinks=None, generator=None, return_lse=False,
                   backend=None):
    """Attention over a sequence sharded across the ranks of `group` (default: the world), exact.

    Each rank passes its own shard, as `shard(x, layout)` makes it, and gets the output rows of its own
    queries; the result equals `fused_attn.attention` on the full sequences, sharded the same way.

    Args:
        query: (B, H_q, L_q_local, D_qk), this rank's queries; any strides.
        key: (B, H_kv, L_k_local, D_qk), this rank's keys (L_k_local may differ from L_q_local).
        value: (B, H_kv, L_k_local, D_v).
        group: the torch.distributed process group of the ring (gloo on CPU, NCCL on GPU).
        is_causal: global query I sees global keys J <= I (+ L_k - L_q with bottom-right alignment).
        layout: "contiguous" (rank r holds the r-th of W slices) or "zigzag" (chunks r and 2W - 1 - r
            of 2W, which balances causal work); L_local must then be even.
        key_padding_mask: bool (B, L_k_local), True = ignore that key: this rank's share, sharded with
            the keys (`shard(mask, layout, dim=1)`).
        window_size, causal_alignment, softcap, alibi_slopes, scale, enable_gqa, backend: as
            `fused_attn.attention`, in global positions. Ring steps whose keys lie outside every query's
            window are skipped.
        sinks: (H_q,), as `fused_attn.attention`: each row's sink joins its softmax once, after the keys of
            every rank. Its gradient on each rank is the share of that rank's rows (sum it over the group
            with the other replicated parameters' gradients).
        dropout_p, generator: as `fused_attn.attention`: rank 0's seed (every rank draws one from its
            generator, advancing it) is used by all, so the ring drops what the single-device call with
            that seed drops.
        return_lse: also return the log-sum-exp of this rank's rows, (B, H_q, L_q_local), float32
            (float64 for float64 inputs); a gradient flowing into it is taken.

    Returns:
        (B, H_q, L_q_local, D_v) in query's dtype, contiguous; with the log-sum-exp when `return_lse`.

    Every rank of the group must make the same call with shards of the same shapes, and run its
    backward if any rank does.
    """
    _check_inputs(query, key, value, enable_gqa)
    _check_options(dropout_p, scale, is_causal)
    _check_generator(generator, query)
    _check_key_padding_mask(key_padding_mask, query, key)
    _check_layout(layout)
    variant = variant_of(query, causal_alignment, window_size, softcap, alibi_slopes, sinks)  # checks the keywords
    rank, world = _group_rank_and_size(group)
    per_rank = chunks_per_rank(layout)
    for name, tensor in (("query", query), ("key", key)):
        if tensor.shape[2] % per_rank:
            raise ValueError(f"{name}: layout='zigzag' needs an even local length (two chunks per rank: the "
                             f"full sequence a multiple of {2 * world}), got {tensor.shape[2]}")
    len_q, len_k = query.shape[2] * world, key.shape[2] * world
    low, high = _band(is_causal, variant, len_q, len_k)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    # The steps run without the sinks (they join at the end, above the kernels).
    problem = Problem.of(query, key, value, None, key_padding_mask, is_causal, float(dropout_p),
                         dataclasses.replace(variant, sinks=None))
    chosen = registry.choose(problem, backend).name
    rng = _shared_rng(query.device, generator, group) if dropout_p > 0.0 else None
    ring = _Ring(group, rank, world, layout, low, high, variant.offset(len_q, len_k), scale, variant.softcap,
                 variant.alibi_slopes, float(dropout_p), rng, chosen)
    out, lse = _RingAttention.apply(query, key, value, key_padding_mask, variant.sinks, ring)
    return (out, lse) if return_lse else out


__all__ = ["LAYOUTS", "Traffic", "gather", "ring_attention", "shard", "traffic"]
