"""`attention_with_kvcache`: a generation step against a key/value cache, dense or paged.

Each sequence b of the batch holds `cache_seqlens[b]` keys before the call; the call appends its
new keys and values after them, in place, and its queries (the last `L_q` positions of the sequence)
attend over the sequence's keys. Everything runs on the device, with no host synchronisation.

A paged cache is read in place by the kernels that take a block table (`Backend.forward_paged`: cpu,
triton); the others run on its sequences' blocks gathered into a dense copy.

flash-attn's cache options: with `cache_batch_idx` a dense cache runs as a paged one whose blocks are
its rows (one block of L_max keys each, the sequence's row its only table entry), so the same kernels
read the named rows in place; `cache_leftpad` hides the keys before each sequence's start as key
padding (the kernels visit the span [start, end) alone); the rotary embedding turns q and the new keys
in torch before the kernels (fused_attn.rotary).

How the sequences' own lengths reach the kernels: the keys past a sequence's end are key padding,
which the fused kernels never visit (fused_attn.backends: key padding as a range of keys). Query i
of sequence b sits at position `length_b - L_q + i`; with one query and no window that position sees
every key of the sequence and nothing more is needed. With several queries under `is_causal`, or a
window, the visible keys are given as a bool mask (B, 1, L_q, L_max) built from the lengths. ALiBi
runs in the kernels aligned to the end of the cache buffer: for keys at or before the query, as
under `is_causal`, a window of right bound 0 or with one query, that shifts every score of a row by the
same amount, which the softmax ignores and the returned log-sum-exp gets back (other calls with ALiBi
are refused). The shift, slope · (L_max - length), is
rounded with the scores: in a buffer of thousands of keys, ALiBi's results are less precise than a call
on the sequence alone (an fp32 output error of ~1e-4 at L_max = 1536 with slope 1).
"""

from __future__ import annotations

import torch

from .backends import registry
from .checks import _check_options, assert_on_device
from .functional import attention
from .problem import Problem, output_like
from . import quantization, rotary
from .scores import variant_of, with_sinks


def _check_cache(name: str, cache: torch.Tensor, paged: bool, query: torch.Tensor) -> None:
    layout = "(num_blocks, block_size, H_kv, D)" if paged else "(B, H_kv, L_max, D)"
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D tensor {layout}, got "
                         f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__}")
    if cache.dtype not in (query.dtype, *quantization.CACHE_DTYPES) or cache.device != query.device:
        raise TypeError(f"{name}: expected query's dtype {query.dtype} or an 8-bit cache "
                        f"({', '.join(map(str, quantization.CACHE_DTYPES))}), on query's device {query.device}, got "
                        f"{cache.dtype} on {cache.device}")


def _check_scales(k_cache, v_cache, k_scale, v_scale, paged: bool, batch: int) -> str | None:
    """An 8-bit cache's scales: 'sequence' for (B, H_kv) ones (a dense cache: one per cache row), 'token' for one
    per stored key and head, in the cache's layout without D; None for a cache of the query's dtype."""
    if not quantization.is_quantized(k_cache) and not quantization.is_quantized(v_cache):
        for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scales is not None:
                raise ValueError(f"{name}: scales are for an 8-bit cache, got a {k_cache.dtype} cache")
        return None
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"v_cache: expected k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    heads_kv = k_cache.shape[2] if paged else k_cache.shape[1]
    rows = batch if paged else k_cache.shape[0]
    per_sequence = (rows, heads_kv)
    per_token = tuple(k_cache.shape[:3])
    token_layout = "(num_blocks, block_size, H_kv)" if paged else "(B, H_kv, L_max)"
    sequence_layout = "(B, H_kv)" if paged else "(cache rows, H_kv)"
    layout = None
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
                tuple(scales.shape) not in (per_sequence, per_token):
            raise ValueError(f"{name}: an {k_cache.dtype} cache needs float32 scales of shape {sequence_layout} = "
                             f"{per_sequence} (per sequence and kv head) or {token_layout} = {per_token} (per token "
                             f"and kv head), got {getattr(scales, 'dtype', type(scales).__name__)} of shape "
                             f"{tuple(getattr(scales, 'shape', ()))}")
        if scales.device != k_cache.device:
            raise ValueError(f"{name}: expected the cache's device {k_cache.device}, got {scales.device}")
        kind = "token" if tuple(scales.shape) == per_token else "sequence"
        if layout is not None and kind != layout:
            raise ValueError(f"v_scale: expected k_scale's layout (per {layout}), got per {kind}")
        layout = kind
    return layout


def _check_per_sequence(name: str, tensor, batch: int, device) -> None:
    """cache_seqlens, cache_batch_idx, cache_leftpad: one int32 per sequence, on query's device."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tuple(tensor.shape) != (batch,):
        raise ValueError(f"{name}: expected an int32 tensor of shape (B,) = ({batch},), got "
                         f"{getattr(tensor, 'dtype', type(tensor).__name__)} of shape "
                         f"{tuple(getattr(tensor, 'shape', ()))}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device} (as query), got {tensor.device}")


def _common_end(cache_seqlens: torch.Tensor, len_new: int, banded: bool) -> int | None:
    """The sequences' one length after the append, where the band can run as one diagonal without a mask: a banded
    call (a window, or causal over several queries) on CPU tensors (whose lengths cost no device synchronisation to
    read) whose sequences all have the same length. None otherwise."""
    if not banded or cache_seqlens.device.type != "cpu" or cache_seqlens.numel() == 0:
        return None
    first = int(cache_seqlens[0])
    return first + len_new if bool((cache_seqlens == first).all()) else None


def _check_rotary(rotary_cos, rotary_sin, query, key) -> None:
    """The tables (seqlen_ro, rotary_dim / 2), alike, of query's dtype or float32, on its device."""
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        missing = "rotary_cos" if rotary_cos is None else "rotary_sin"
        raise ValueError(f"{missing}: expected with {'rotary_sin' if rotary_cos is None else 'rotary_cos'} "
                         "(both tables or neither)")
    dtypes = (query.dtype, torch.float32)
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor (seqlen_ro, rotary_dim / 2), got "
                             f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}")
        if table.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {query.dtype} (as query) or torch.float32, got {table.dtype}")
        if table.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} (as query), got {table.device}")
    if rotary_sin.shape != rotary_cos.shape or rotary_sin.dtype != rotary_cos.dtype:
        raise ValueError(f"rotary_sin: expected rotary_cos's shape {tuple(rotary_cos.shape)} and dtype "
                         f"{rotary_cos.dtype}, got {tuple(rotary_sin.shape)} and {rotary_sin.dtype}")
    if 2 * rotary_cos.shape[1] > query.shape[3]:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {rotary_cos.shape[1]} exceeds the head dim {query.shape[3]}")
    if key is None:
        raise ValueError("rotary_cos: the rotary embedding turns the new keys and the queries at the new keys' "
                         "positions; expected key and value to append (as flash-attn)")


def _positions_of(block_table: torch.Tensor | None, block_size: int, positions: torch.Tensor):
    """(rows, offsets) indexing a paged cache's first two dims at each (b, position); for a dense
    cache, (batch index, position)."""
    if block_table is None:
        return torch.arange(positions.shape[0], device=positions.device)[:, None], positions
    blocks = block_table.long().gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks, positions % block_size


def _append(cache: torch.Tensor, new: torch.Tensor, positions, block_table, block_size) -> None:
    """Writes new (B, H_kv, L_new, ...) at each sequence's positions (B, L_new), in place: into a cache
    (B, H_kv, L_max, ...), or with `block_table`, into blocks (num_blocks, block_size, H_kv, ...)."""
    rows, offsets = _positions_of(block_table, block_size, positions)
    tokens = new.movedim(2, 1)  # (B, L_new, H_kv, ...)
    if block_table is None:
        cache.movedim(2, 1)[rows, offsets] = tokens  # the (B, L_max, H_kv, ...) view of the buffer
    else:
        cache[rows, offsets] = tokens


def _append_quantized(cache, scales, layout, new, positions, block_table, block_size) -> None:
    """Quantizes new (B, H_kv, L_new, D) into an 8-bit cache (fused_attn.quantization): with per-token scales,
    writes each key's scale at its position too; per-sequence scales (B, H_kv) are the caller's."""
    if layout == "token":
        new_scales = quantization.token_scales(new, cache.dtype)  # (B, H_kv, L_new)
        _append(scales, new_scales, positions, block_table, block_size)
    else:
        new_scales = scales[:, :, None].expand(new.shape[:3])
    _append(cache, quantization.quantize(new, new_scales, cache.dtype), positions, block_table, block_size)


def _chosen_backend(query, heads_kv, dim_k, dim_v, len_k, banded, scale, variant, backend, cache_dtype, paged):
    """The backend that runs the call's attention, chosen (and what it relies on checked) before anything
    is appended, so that a refused call leaves the cache as it was."""
    batch, heads_q, len_q, dim = query.shape
    if dim_k != dim:
        raise ValueError(f"k_cache: expected head dim {dim} (as query), got {dim_k}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"k_cache: expected a number of heads dividing the query's {heads_q}, got {heads_kv}")
    _check_options(0.0, scale, False)
    problem = Problem(device=query.device, dtype=query.dtype, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                      len_q=len_q, len_k=len_k, head_dim_qk=dim, head_dim_v=dim_v, is_causal=False,
                      dropout_p=0.0, mask_dtype=torch.bool if banded else None, mask_requires_grad=False,
                      has_key_padding_mask=True, score_features=variant.features(False),
                      cache_dtype=cache_dtype if cache_dtype in quantization.CACHE_DTYPES else None, paged=paged)
    return registry.choose(problem, backend)


def _paged_attention(query, k_blocks, v_blocks, block_table, mask, padding, scale, variant, chosen, k_scale=None,
                     v_scale=None):
    """`attention` over the paged cache's sequences, by the chosen backend's `forward_paged`: the kernels
    read the blocks in place where they take a block table (fused_attn.backends.base)."""
    batch, heads_q, len_q, dim = query.shape
    len_k = block_table.shape[1] * k_blocks.shape[1]
    if mask is not None:
        mask = mask.expand(batch, heads_q, len_q, len_k)
    out = output_like(query, v_blocks.shape[3], seq_first=False)
    scale = dim ** -0.5 if scale is None else float(scale)
    lse = chosen.forward_paged(query, k_blocks, v_blocks, block_table.contiguous(), mask, padding, False, scale, out,
                               variant, k_scale=k_scale, v_scale=v_scale)
    return out, lse


def attention_with_kvcache(query, k_cache, v_cache, key=None, value=None, *, cache_seqlens, cache_batch_idx=None,
                           cache_leftpad=None, block_table=None, k_scale=None, v_scale=None, rotary_cos=None,
                           rotary_sin=None, rotary_interleaved=True, scale=None, is_causal=True, window_size=None, softcap=None,
                           alibi_slopes=None, sinks=None, return_lse=False, backend=None):
    """Appends `key`/`value` to each sequence's cache, in place, and attends over the sequence.

    Args:
        query: (B, H_q, L_q, D), the last L_q positions of each sequence.
        k_cache, v_cache: (B, H_kv, L_max, D) and (B, H_kv, L_max, D_v), any strides (a
            (B, L_max, H_kv, D) buffer passed as `.transpose(1, 2)` works, with no copy); with
            `cache_batch_idx`, (B_cache, H_kv, L_max, D) rows of any number; or, with `block_table`,
            paged: (num_blocks, block_size, H_kv, D) blocks of any block size. Of query's dtype, or 8-bit
            (torch.float8_e4m3fn or torch.int8, both alike) with `k_scale` and `v_scale`.
        key, value: (B, H_kv, L_new, D) and (B, H_kv, L_new, D_v), or None (nothing to append).
        cache_seqlens: int32 (B,): where each sequence's keys end in its cache row (or blocks) before
            the append; the new keys go there.
        cache_batch_idx: int32 (B,) or None: the cache row of each sequence (dense caches only);
            rows no sequence names are neither read nor written. None: row b for sequence b.
        cache_leftpad: int32 (B,) or None: where each sequence's keys start in its row (dense caches
            only), at most cache_seqlens; the keys before it are never seen. Positions stay those of
            the row (windows, ALiBi, rotary).
        block_table: int32 (B, max_blocks): the cache blocks of each sequence, in order.
        k_scale, v_scale: an 8-bit cache's float32 scales (fused_attn.quantization), both in one layout:
            per sequence and kv head, (cache rows, H_kv) for a dense cache ((B, H_kv) for a paged one),
            the caller's, which the appended keys are quantized with; or per token and kv head, the cache's
            layout without D ((B, H_kv, L_max) or (num_blocks, block_size, H_kv), any strides), each written
            with its key when it is appended. Key j of a row stands for its 8-bit values times its scale.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) of query's dtype or float32, or None:
            the rotary embedding (fused_attn.rotary) of the first rotary_dim dimensions of the new
            keys, at positions cache_seqlens + i, before they are stored, and of the queries: at
            cache_seqlens + i with `is_causal` or a window, all at cache_seqlens otherwise (as
            flash-attn's `flash_attn_with_kvcache`). Needs key and value.
        rotary_interleaved: pairs dimensions (2i, 2i + 1) (GPT-J, flash-attn's default), else
            (i, i + rotary_dim / 2) (GPT-NeoX).
        is_causal: query i sees the keys up to its own position (bottom-right aligned to each
            sequence's end), as in generation; with one query it sees the whole sequence anyway.
        scale, window_size, softcap, alibi_slopes, sinks, return_lse, backend: as in `fused_attn.attention`,
            positions counted within each sequence. With several queries, ALiBi needs a call in which no
            key after a query is visible: `is_causal`, or a window of right bound 0.

    Returns:
        (B, H_q, L_q, D_v), or (output, lse) when `return_lse`. No gradient flows (inference).
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        raise ValueError("query: expected a 4-D tensor (B, H_q, L_q, D)")
    batch, _, len_q, _ = query.shape
    paged = block_table is not None
    # flash-attn refuses both with a paged cache: a sequence's blocks are its row, and its first block
    # can start where its keys do.
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not taken with block_table (the block table already says where each "
                         "sequence's keys lie)")
    if paged and cache_leftpad is not None:
        raise ValueError("cache_leftpad: not taken with block_table (a sequence's block table can start at the "
                         "block of its first key)")
    _check_cache("k_cache", k_cache, paged, query)
    _check_cache("v_cache", v_cache, paged, query)
    scale_layout = _check_scales(k_cache, v_cache, k_scale, v_scale, paged, batch)
    _check_per_sequence("cache_seqlens", cache_seqlens, batch, query.device)
    for name, tensor in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if tensor is not None:
            _check_per_sequence(name, tensor, batch, query.device)
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
                or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table: expected an int32 tensor of shape (B, max_blocks) with B = {batch}, "
                             f"got {getattr(block_table, 'dtype', None)} of shape "
                             f"{tuple(getattr(block_table, 'shape', ()))}")
        block_size = k_cache.shape[1]
        if v_cache.shape[:3] != k_cache.shape[:3]:
            raise ValueError(f"v_cache: expected blocks (num_blocks, block_size, H_kv) = {tuple(k_cache.shape[:3])} "
                             f"as k_cache, got {tuple(v_cache.shape[:3])}")
        capacity = block_table.shape[1] * block_size
    else:
        block_size = 0
        rows = "any number of rows" if cache_batch_idx is not None else f"B = {batch}"
        if (cache_batch_idx is None and k_cache.shape[0] != batch) or v_cache.shape[:3] != k_cache.shape[:3]:
            raise ValueError(f"k_cache, v_cache: expected (B, H_kv, L_max) alike with {rows}, got "
                             f"{tuple(k_cache.shape[:3])} and {tuple(v_cache.shape[:3])}")
        capacity = k_cache.shape[2]
    if (key is None) != (value is None):
        raise ValueError("key, value: expected both or neither")
    len_new = 0 if key is None else key.shape[2]
    _check_rotary(rotary_cos, rotary_sin, query, key)
    # The keywords are checked before anything is appended: a refused call leaves the cache as it was.
    variant = variant_of(query, "bottom_right", window_size, softcap, alibi_slopes, sinks)
    left, right = variant.bounds(False)  # the window alone: -1 where unbounded
    # flash-attn's rule for the queries' rotary positions: one per query under a causal or windowed
    # mask, else every query at the first new position.
    queries_in_order = is_causal or left >= 0 or right >= 0
    if is_causal and len_q > 1:  # (one query sees no key after it: the sequence ends there)
        right = 0
    # What matters is the visible band, not the flag: a window of right bound 0 is causal too.
    if alibi_slopes is not None and len_q > 1 and right != 0:
        raise ValueError(f"alibi_slopes: with is_causal=False, window_size={window_size!r} and more than one "
                         "query, some keys lie after a query, where ALiBi aligned to the cache's end is not a "
                         "shift of the scores; pass is_causal=True, a window of right bound 0, or one query "
                         "at a time")
    banded = left >= 0 or right >= 0
    # Sequences of one length after the append (always so for one sequence) put every query's band on one
    # diagonal, query i at key end - L_q + i: the kernels take it as an integer alignment with the window, and
    # ALiBi and the sinks as they are. Otherwise each sequence's band comes as a (B, 1, L_q, L_max) bool mask, read
    # per score, and the kernels' ALiBi is off by a shift per row (below), which the sinks do not share: they join
    # after the shift is undone.
    common_end = _common_end(cache_seqlens, len_new, banded)
    if common_end is not None:
        kernel_sinks = sinks
        kernel_variant = variant_of(query, common_end - len_q, (left, right), softcap, alibi_slopes, sinks)
    else:
        kernel_sinks = None if alibi_slopes is not None else sinks
        kernel_variant = variant_of(query, "bottom_right", None, softcap, alibi_slopes, kernel_sinks)
    # Rows named by cache_batch_idx and the rows of a dense 8-bit cache are read as a paged cache's blocks (below).
    rows_as_blocks = not paged and (cache_batch_idx is not None or scale_layout is not None)
    read_as_blocks = paged or (rows_as_blocks and capacity > 0)
    chosen = _chosen_backend(query, k_cache.shape[2] if paged else k_cache.shape[1], k_cache.shape[3],
                             v_cache.shape[3], capacity, banded and common_end is None, scale, kernel_variant, backend,
                             k_cache.dtype, read_as_blocks)

    with torch.no_grad():
        if key is not None:
            heads_kv = k_cache.shape[2] if paged else k_cache.shape[1]
            for name, new, cache in (("key", key, k_cache), ("value", value, v_cache)):
                expected = (batch, heads_kv, len_new, cache.shape[3])
                if not isinstance(new, torch.Tensor) or tuple(new.shape) != expected or new.dtype != query.dtype:
                    raise ValueError(f"{name}: expected shape {expected} and dtype {query.dtype}, got "
                                     f"{tuple(getattr(new, 'shape', ()))} and {getattr(new, 'dtype', None)}")
        starts = cache_seqlens.long()
        lengths = starts + len_new
        assert_on_device(((cache_seqlens >= 0) & (lengths <= capacity)).all(),
                          f"cache_seqlens: every length after the append must lie in [0, {capacity}] (the "
                          f"cache's capacity)")
        if cache_batch_idx is not None:
            rows_in_cache = k_cache.shape[0]
            assert_on_device(((cache_batch_idx >= 0) & (cache_batch_idx < rows_in_cache)).all(),
                             f"cache_batch_idx: every index must lie in [0, {rows_in_cache}) (the cache's rows)")
            if len_new > 0 and batch > 1:  # two sequences appending to one row would overwrite each other
                ordered = cache_batch_idx.sort().values
                assert_on_device((ordered[1:] != ordered[:-1]).all(),
                                 "cache_batch_idx: sequences that append keys must name distinct cache rows")
        if cache_leftpad is not None:
            assert_on_device(((cache_leftpad >= 0) & (cache_leftpad <= cache_seqlens)).all(),
                             "cache_leftpad: every start must lie in [0, cache_seqlens] (its sequence's end "
                             "before the append)")
        # The rotary positions read past cache_seqlens: the new keys', and the queries' (in order, or all
        # at the first).
        reach = max(len_new, len_q if queries_in_order else min(len_q, 1))
        if rotary_cos is not None and reach > 0:
            assert_on_device((lengths - len_new + reach <= rotary_cos.shape[0]).all(),
                             f"rotary_cos, rotary_sin: a table of {rotary_cos.shape[0]} positions must cover "
                             f"cache_seqlens + {reach} - 1, the last position it is read at")
        if paged:  # the blocks holding each sequence's keys must be blocks of the cache; others are never read
            used = torch.arange(block_table.shape[1], device=query.device)[None, :] * block_size < lengths[:, None]
            assert_on_device(((block_table >= 0) & (block_table < k_cache.shape[0]) | ~used).all(),
                             f"block_table: every block holding a sequence's keys must lie in [0, {k_cache.shape[0]})")
        if scale_layout == "sequence" and cache_batch_idx is not None:  # the scales of the sequences' rows
            k_scale, v_scale = k_scale[cache_batch_idx.long()], v_scale[cache_batch_idx.long()]
        if scale_layout == "sequence" and len_new > 0:  # the appended keys are divided by them
            for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
                assert_on_device(((scales > 0) & scales.isfinite()).all(),
                                 f"{name}: the sequences' scales must be positive and finite to quantize the "
                                 f"appended keys and values with")
        if rows_as_blocks:
            rows_used = cache_batch_idx if cache_batch_idx is not None else \
                torch.arange(batch, dtype=torch.int32, device=query.device)
            if capacity > 0:
                # Each row as a paged cache's one block of L_max keys: every kernel that takes a block
                # table reads the named rows in place, and the append writes through the same view (an
                # 8-bit cache is read by forward_paged alone).
                k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
                if scale_layout == "token":
                    k_scale, v_scale = k_scale.transpose(1, 2), v_scale.transpose(1, 2)
                block_table, block_size, paged = rows_used[:, None], capacity, True
            else:  # rows without keys: nothing to read or write
                k_cache, v_cache = k_cache[rows_used.long()], v_cache[rows_used.long()]
                if scale_layout is not None:
                    k_cache = k_cache.new_empty(k_cache.shape, dtype=query.dtype)
                    v_cache = v_cache.new_empty(v_cache.shape, dtype=query.dtype)
                    scale_layout = None
        if key is not None:
            positions = starts[:, None] + torch.arange(len_new, device=query.device)
        # The new keys are stored turned: later steps read them as they are.
        if rotary_cos is not None and len_q == len_new and (queries_in_order or len_q == 1):
            # The queries sit at the new keys' positions (a decode step): one pass turns both.
            turned = rotary.rotate(torch.cat((query, key), dim=1), rotary_cos, rotary_sin, positions,
                                   rotary_interleaved)
            query, key = turned[:, :query.shape[1]], turned[:, query.shape[1]:]
        elif rotary_cos is not None:
            steps = torch.arange(len_q, device=query.device) if queries_in_order else \
                torch.zeros(len_q, dtype=torch.long, device=query.device)
            query = rotary.rotate(query, rotary_cos, rotary_sin, starts[:, None] + steps, rotary_interleaved)
            key = rotary.rotate(key, rotary_cos, rotary_sin, positions, rotary_interleaved)
        if key is not None:
            if scale_layout is None:
                _append(k_cache, key, positions, block_table, block_size)
                _append(v_cache, value, positions, block_table, block_size)
            else:
                _append_quantized(k_cache, k_scale, scale_layout, key, positions, block_table, block_size)
                _append_quantized(v_cache, v_scale, scale_layout, value, positions, block_table, block_size)

        len_k = capacity
        key_index = torch.arange(len_k, device=query.device)
        padding = key_index[None, :] >= lengths[:, None]
        if cache_leftpad is not None:  # a span [start, end) per row, which the kernels visit alone
            padding |= key_index[None, :] < cache_leftpad.long()[:, None]
        mask = None
        if banded and common_end is None:
            # Query i of sequence b sits at lengths[b] - L_q + i: its window and causal bound there.
            position = lengths[:, None] - len_q + torch.arange(len_q, device=query.device)  # (B, L_q)
            distance = key_index[None, None, :] - position[:, :, None]  # (B, L_q, L_k)
            visible = torch.ones_like(distance, dtype=torch.bool)
            if left >= 0:
                visible &= distance >= -left
            if right >= 0:
                visible &= distance <= right
            mask = visible[:, None]
        if paged:
            out, lse = _paged_attention(query, k_cache, v_cache, block_table, mask, padding, scale, kernel_variant,
                                        chosen, *((k_scale, v_scale) if scale_layout is not None else ()))
        else:
            band = dict(causal_alignment="bottom_right") if common_end is None else \
                dict(causal_alignment=common_end - len_q, window_size=(left, right))
            out, lse = attention(query, k_cache, v_cache, mask, scale=scale,
                                 enable_gqa=query.shape[1] != k_cache.shape[1], key_padding_mask=padding,
                                 return_lse=True, backend=backend, softcap=softcap, alibi_slopes=alibi_slopes,
                                 sinks=kernel_sinks, **band)
        if alibi_slopes is not None and common_end is None:
            # The kernels measured ALiBi's distances from the buffer's end, len_k - 1, where the
            # sequence ends at lengths[b] - 1: every visible score of the row was lower by
            # slope · (len_k - lengths[b]).
            slopes = variant.alibi_slopes  # (B, H_q)
            lse = lse + (slopes * (len_k - lengths)[:, None]).to(lse.dtype)[:, :, None]
            out, lse = with_sinks(lse, out, variant.sinks)
    return (out, lse) if return_lse else out
