"""Split-KV ("flash-decoding") Triton kernels for calls with few query rows: generation steps.

With L_q of 1 to 16, the long-query forward wastes most of a query tile (one useful row of 64 or
128) and runs one program per (batch, head): far fewer than a GPU has SMs. Here:

    decode    one program per (batch, key/value head, split of the keys): the rows of the whole GQA
              group (G · L_q, padded to a tile of at least 16) against its share of the keys, so each
              key/value block is read once for the group; writes the split's normalised output and
              its base-2 log-sum-exp into an fp32 workspace.
    combine   one program per (batch, query head, query row): merges the splits through their
              log-sum-exps (max-shifted, so no exp overflows), with the head's attention sink, if any,
              as one more split whose output is 0 (folded in once per row, never per split); writes
              the output and the natural log-sum-exp.

The split count comes from the problem and the device: enough programs for two per SM, each split at
least `MIN_KEYS_PER_SPLIT` keys. Masks, key padding (its span narrows each split), the band (causal,
windows, either alignment), softcap and ALiBi are read as the long-query kernels read them (the same
`_in_band`, `_variant_scores`), attention sinks by the combine; dropout and mask programs are not (calls
with either take the long-query kernels). A paged cache's blocks are read through its block table, an 8-bit
one dequantized where its tiles are loaded, as the long-query forward does (KV8, TOKEN_SCALES).

A dense cache's K and V may be read, and each split's output written, through tensor descriptors (DESCRIPTORS, TMA
on sm_90 and later, as `triton_kernels`' variants), the key loop warp-specialized too (WARP_SPECIALIZE, as the
forward's, for the calls it is offered for): on such devices these variants are candidates of a small autotuner
beside pointers, elsewhere and in the interpreter the pointer one runs unless FUSED_ATTN_TRITON_DESCRIPTORS=1 (or
`forced_variant`); a paged cache and layouts TMA cannot read keep pointers (`triton_kernels.descriptor_refusals`).
The query rows of a group stay on pointers: they come from several heads. So do the splits' log-sum-exps and the
combine's output (see where they are written).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from ..scores import PLAIN
from . import triton_compat, triton_tuning
from . import triton_kernels as tk

MIN_KEYS_PER_SPLIT = 256
MAX_QUERIES = 16      # L_q up to this takes the decode kernels ...
MAX_ROWS = 64         # ... when its group's rows, G · L_q, fit one tile
DECODE_WARPS, DECODE_STAGES = 4, 2
COMBINE_WARPS = 4


@triton.jit
def _attn_decode(
    Q, K, V, MASK, KPM, SPANS, ALIBI, PAGES, KS, VS, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_pn, stride_ab, stride_ah, stride_tb, PAGE_SIZE,
    stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
    H_KV, GROUP, L_Q, L_K, SPLITS, KEYS_PER_SPLIT, qk_scale, DIAG, LEFT, RIGHT, softcap2,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, BANDED: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, PAGED: tl.constexpr, KV8: tl.constexpr, TOKEN_SCALES: tl.constexpr,
    PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One split of the keys for one key/value head's query group. The workspace is PART_O
    (B, H_kv, SPLITS, BLOCK_M, BLOCK_DV) and PART_LSE (B, H_kv, SPLITS, BLOCK_M), contiguous, fp32. An 8-bit
    cache (KV8) is read as the long-query forward reads it (`tk._attn_fwd_keys`). WARP_SPECIALIZE asks Triton to
    split the key loop into warps that load and warps that compute (it does on sm_100, not on sm_90:
    bench/NOTES.md 56)."""
    pid = tl.program_id(0)
    split = pid % SPLITS
    pid_bh = pid // SPLITS
    off_b = (pid_bh // H_KV).to(tl.int64)
    off_hkv = (pid_bh % H_KV).to(tl.int64)

    # Row r of the tile is query i = r % L_Q of head h = off_hkv * GROUP + r // L_Q.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * L_Q
    offs_i = rows % L_Q
    offs_h = off_hkv * GROUP + rows // L_Q
    offs_i64 = offs_i.to(tl.int64)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + off_b * stride_qb + offs_h[:, None] * stride_qh + offs_i64[:, None] * stride_qm
                + offs_dqk[None, :] * stride_qd, mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
    k_base = K + off_hkv * stride_kh
    v_base = V + off_hkv * stride_vh
    k_desc = k_base  # the descriptors of a dense cache, with DESCRIPTORS (unused otherwise)
    v_desc = v_base
    if DESCRIPTORS:
        k_desc = tk._rows_descriptor(k_base + off_b * stride_kb, L_K, stride_kn, D_QK, BLOCK_N, BLOCK_DQK)
        v_desc = tk._rows_descriptor(v_base + off_b * stride_vb, L_K, stride_vn, D_V, BLOCK_N, BLOCK_DV)
    ks_base = KS + off_hkv * stride_ksh
    vs_base = VS + off_hkv * stride_vsh
    if KV8:
        if not TOKEN_SCALES:  # the sequence's scales: of every score, and of the split's output at the end
            qk_scale = qk_scale * tl.load(ks_base + off_b * stride_ksb) * tk._bits_factor(K)
            v_scale = tl.load(vs_base + off_b * stride_vsb) * tk._bits_factor(V)
    mask_base = MASK + off_b * stride_mb + offs_h[:, None] * stride_mh + offs_i64[:, None] * stride_mm
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_ab + offs_h * stride_ah, mask=row_ok, other=0.0) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(L_K, lo + KEYS_PER_SPLIT)
    if BANDED:  # the keys any of the L_q queries sees (rows 0 .. L_q - 1 of the band)
        lo = tl.maximum(lo, tl.maximum(0, DIAG - LEFT) // BLOCK_N * BLOCK_N)
        hi = tl.minimum(hi, tl.maximum(0, L_Q - 1 + DIAG + RIGHT + 1))
    if HAS_KPM:
        span_first, span_end = tk._span(SPANS, off_b)
        lo, hi = tk._within_span(span_first, span_end, lo, hi, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi  # keys of other splits are not this one's to see; hi <= the span's end
        if HAS_KPM:  # nor is the padding before the span read (tk._in_span)
            col_ok = col_ok & (offs_n >= span_first)
        k_rows = tk._key_offsets(PAGES, off_b, offs_n, col_ok, stride_kb, stride_kn, stride_tb, PAGE_SIZE, PAGED)
        v_rows = tk._key_offsets(PAGES, off_b, offs_n, col_ok, stride_vb, stride_vn, stride_tb, PAGE_SIZE, PAGED)
        if DESCRIPTORS:  # a block reads the next split's keys too: zeroed, as the pointer loads' masks leave them
            k_t = tl.trans(tk._descriptor_rows(k_desc, start_n, col_ok, True))
        else:
            k_t = tl.load(k_base + k_rows[None, :] + offs_dqk[:, None] * stride_kd,
                          mask=col_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)
        key_scale = qk_scale
        if KV8:
            k_t = tk._cache_values(k_t, q.dtype)
            if TOKEN_SCALES:
                key_scale = qk_scale * tk._token_scales(ks_base, PAGES, off_b, offs_n, col_ok, stride_ksb, stride_ksn,
                                                        stride_tb, PAGE_SIZE, tk._bits_factor(K), PAGED)[None, :]
        # No mask program (`takes` declines calls with one): a full tile, nothing read.
        s, _ = tk._visible_scores(q, k_t, offs_i[:, None], offs_n, row_ok, col_ok, mask_base, stride_mn,
                                  KPM + off_b * stride_pb, stride_pn, slope2[:, None], softcap2, key_scale, DIAG,
                                  LEFT, RIGHT, PART_LSE, tk.PROGRAM_FULL, start_n, MASK_KIND, HAS_KPM, BANDED,
                                  SOFTCAP, HAS_ALIBI, False, PRECISION)
        p, alpha, m_new, l_i = tk._online_softmax(s, m_i, l_i)
        if DESCRIPTORS:
            v = tk._descriptor_rows(v_desc, start_n, col_ok, True)
        else:
            v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd,
                        mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        if KV8:
            v = tk._dequantized_values(v, q.dtype, vs_base, PAGES, off_b, offs_n, col_ok, stride_vsb, stride_vsn,
                                       stride_tb, PAGE_SIZE, tk._bits_factor(V), PAGED, TOKEN_SCALES)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if KV8:
        if not TOKEN_SCALES:
            acc = tk._value_scaled(acc, l_i, v_scale)
    seen = l_i != 0.0  # NaN too (a NaN score): the split's output and lse are NaN
    l_safe = tl.where(seen, l_i, 1.0)
    part = (pid_bh.to(tl.int64) * SPLITS + split) * BLOCK_M
    # The workspace is ours, contiguous and aligned as TMA needs: with DESCRIPTORS the tile goes through a descriptor.
    tk._store_rows(PART_O + part * BLOCK_DV, acc / l_safe[:, None], 0, BLOCK_M, BLOCK_DV, 1, BLOCK_DV, BLOCK_M,
                   BLOCK_DV, DESCRIPTORS)
    # The log-sum-exps stay on pointers, as the forward's: through a descriptor of their own, their 64 to 256 bytes
    # cost the program one more descriptor made on the device (128 bytes of scratch, about 40 SASS instructions).
    tl.store(PART_LSE + part + rows, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")))


@triton.jit
def _attn_decode_combine(
    PART_O, PART_LSE, O, LSE, SINKS,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H_Q, H_KV, GROUP, L_Q, SPLITS,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One query row: the splits' outputs weighted by 2^(lse_s - max) / sum; lse in natural units. With
    HAS_SINKS the head's sink (natural units, SINKS (H_q,) float32) is a term of the max and the sum
    that weighs no output."""
    pid = tl.program_id(0)
    off_i = pid % L_Q
    off_bh = pid // L_Q
    off_b = (off_bh // H_Q).to(tl.int64)
    off_h = (off_bh % H_Q).to(tl.int64)
    row = (off_h % GROUP) * L_Q + off_i
    group = off_b * H_KV + off_h // GROUP
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    split_ok = offs_s < SPLITS
    parts = (group * SPLITS + offs_s) * BLOCK_M + row
    lse = tl.load(PART_LSE + parts, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        no_key = m == float("-inf")
        sink = tl.load(SINKS + off_h)
        sink2 = sink * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_safe)  # 0 for splits that saw no key
    total = tl.sum(weight, 0)
    if HAS_SINKS:  # 0 for a sink of -inf: a row that sees no key then keeps output 0 and lse -inf
        total += tl.exp2(sink2 - m_safe)
    outs = tl.load(PART_O + parts[:, None] * BLOCK_DV + offs_dv[None, :], mask=split_ok[:, None], other=0.0)
    seen = total != 0.0  # NaN too: a split's NaN lse (or a NaN output weighed by it) makes the row NaN
    out = tl.sum(outs * weight[:, None], 0) / tl.where(seen, total, 1.0)
    # Pointers, not a descriptor: a program writes one row of D_v elements, which through TMA would take a descriptor
    # made by each program (128 bytes of scratch) and a trip through shared memory (compiled for sm_90 and sm_100:
    # 304 SASS instructions against 208), and this launch has no autotuner to leave that out where it is slower.
    tl.store(O + off_b * stride_ob + off_h * stride_oh + off_i * stride_om + offs_dv * stride_od,
             out.to(O.dtype.element_ty), mask=offs_dv < D_V)
    row_lse = tl.where(seen, (m_safe + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453, float("-inf"))
    if HAS_SINKS:  # the sink alone: its logit exactly, not through base 2
        row_lse = tl.where(no_key, sink, row_lse)
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + off_i * stride_lm, row_lse)


KERNELS = {"decode": _attn_decode, "decode_combine": _attn_decode_combine}


def enabled() -> bool:
    return os.environ.get("FUSED_ATTN_TRITON_DECODE", "1") != "0"


MAX_HEAD_DIM = 128  # the fixed config's tiles, checked by the static report up to here


def takes(query, key, value, dropout, len_k=None, variant=PLAIN) -> bool:
    """Whether a forward call runs the decode kernels: few query rows per key/value head, head dims up
    to MAX_HEAD_DIM, no dropout, no mask program (the rows of a tile here are of several query heads,
    whose programs may differ; the long-query kernels take it) (`len_k`: the keys, where `key` is a
    paged cache's blocks)."""
    len_q, group = query.shape[2], query.shape[1] // key.shape[1]
    len_k = key.shape[2] if len_k is None else len_k
    return enabled() and dropout is None and variant.block_tiles is None and 0 < len_q <= MAX_QUERIES \
        and group * len_q <= MAX_ROWS and len_k > 0 and max(query.shape[3], value.shape[3]) <= MAX_HEAD_DIM


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The interpreter has no SMs; this count makes small test problems split.
INTERPRETER_SMS = 4


def split_count(batch: int, heads_kv: int, len_k: int, device: torch.device) -> int:
    """Splits of the keys: doubled while programs are fewer than twice the SMs and each split keeps
    at least MIN_KEYS_PER_SPLIT keys (FUSED_ATTN_TRITON_DECODE_SPLITS overrides, up to one split per
    key)."""
    forced = os.environ.get("FUSED_ATTN_TRITON_DECODE_SPLITS")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"FUSED_ATTN_TRITON_DECODE_SPLITS: expected a positive integer, got {forced!r}")
        return min(int(forced), max(1, len_k))
    if device.type != "cuda":
        sms = INTERPRETER_SMS
    else:
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    splits = 1
    while batch * heads_kv * splits < 2 * sms and len_k // (2 * splits) >= MIN_KEYS_PER_SPLIT:
        splits *= 2
    return splits


def tile_rows(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))


def block_n(dtype: torch.dtype, head_dim: int, quantized: bool = False) -> int:
    """Keys per block: 64, or 32 for fp32 at head dims over 64 (registers), and for an 8-bit cache, whose
    conversions hold registers beside the tiles (blocks of 64 spilled on sm_80 at D = 128 with 4 warps, and with
    8 on sm_90 at D = 64 under Triton 3.7.1; blocks of 32 compile without, bench/triton_report.py)."""
    return 32 if quantized or (dtype == torch.float32 and head_dim > 64) else 64


def decode_args(query, key, value, attn_mask, key_padding_mask, is_causal, scale, variant, splits, part_o, part_lse,
                pages=None):
    """(positional args, constexprs) of `_attn_decode`, shared by the launch and the static report. With
    `pages` (triton_kernels.Pages), key and value are the cache's `cache_blocks` views."""
    batch, heads_q, len_q, dim_qk = query.shape
    heads_kv, dim_v = key.shape[1], value.shape[3]
    len_k = tk._lengths(query, key, None, pages)[1]
    page_pointers, page_values, page_constexprs = tk.page_args(pages, part_lse)
    mask, kind, mask_strides, padding, padding_strides, spans = tk._mask_args(attn_mask, key_padding_mask, query)
    alibi, alibi_strides, variant_values, variant_constexprs = tk._variant_args(variant, is_causal, len_q, len_k,
                                                                                part_lse)
    bn = block_n(query.dtype, max(dim_qk, dim_v), page_constexprs["KV8"])
    keys_per_split = triton.cdiv(triton.cdiv(len_k, splits), bn) * bn
    args = (query, key, value, mask, padding, spans, alibi, *page_pointers, part_o, part_lse,
            *query.stride(), *key.stride(), *value.stride(), *mask_strides, *padding_strides, *alibi_strides,
            *page_values, heads_kv, heads_q // heads_kv, len_q, len_k, splits, keys_per_split, float(scale) * tk.LOG2E,
            *variant_values)
    constexprs = dict(D_QK=dim_qk, D_V=dim_v, BLOCK_DQK=tk.padded_head_dim(dim_qk),
                      BLOCK_DV=tk.padded_head_dim(dim_v), MASK_KIND=kind, HAS_KPM=key_padding_mask is not None,
                      **{name: variant_constexprs[name] for name in ("BANDED", "SOFTCAP", "HAS_ALIBI")},
                      **page_constexprs, PRECISION=tk._precision(query.dtype), BLOCK_M=tile_rows((heads_q // heads_kv) * len_q),
                      BLOCK_N=bn)
    return args, constexprs


def combine_args(part_o, part_lse, out, lse, heads_kv, splits, variant=PLAIN):
    """(positional args, constexprs) of `_attn_decode_combine`; the variant's sinks fold in here."""
    batch, heads_q, len_q, dim_v = out.shape
    sinks, sink_constexprs = tk.sink_args(variant, heads_q, lse)
    args = (part_o, part_lse, out, lse, sinks, *out.stride(), *lse.stride(), heads_q, heads_kv, heads_q // heads_kv,
            len_q, splits)
    constexprs = dict(D_V=dim_v, BLOCK_DV=part_o.shape[-1], BLOCK_M=part_o.shape[-2],
                      BLOCK_S=max(2, triton.next_power_of_2(splits)), **sink_constexprs)
    return args, constexprs


def workspace(query, key, value, splits):
    """The splits' fp32 outputs (B, H_kv, splits, BLOCK_M, BLOCK_DV) and log-sum-exps."""
    batch, heads_q = query.shape[:2]
    heads_kv = key.shape[1]
    rows = tile_rows((heads_q // heads_kv) * query.shape[2])
    options = dict(dtype=torch.float32, device=query.device)
    return (torch.empty(batch, heads_kv, splits, rows, tk.padded_head_dim(value.shape[3]), **options),
            torch.empty(batch, heads_kv, splits, rows, **options))


# The decode kernel's variants, by name: their constexprs.
VARIANTS = {"pointers": dict(DESCRIPTORS=False, WARP_SPECIALIZE=False),
            "descriptors": dict(DESCRIPTORS=True, WARP_SPECIALIZE=False),
            "warp_specialized": dict(DESCRIPTORS=True, WARP_SPECIALIZE=True)}


def shared_memory_config(constexprs: dict) -> tk.KernelConfig:
    """The fixed config of a launch with these constexprs (a variant's among them) as the long-query kernels'
    KernelConfig: the forward's `shared_memory_estimate` bounds the decode kernel's too (one loop alike, the query
    rows resident, K and V streamed)."""
    return tk.KernelConfig(constexprs["BLOCK_M"], constexprs["BLOCK_N"], DECODE_WARPS, DECODE_STAGES,
                           constexprs["DESCRIPTORS"], constexprs["WARP_SPECIALIZE"])


@functools.lru_cache(maxsize=None)
def _autotuned_decode(descriptors_only: bool):
    """The decode kernel at its fixed config, tuned between its variants (the descriptor ones alone with
    FUSED_ATTN_TRITON_DESCRIPTORS=1), keyed on the problem as the long-query kernels are. The warp-specialized one is
    offered as the forward's is: where Triton offers it, for the calls of `triton_kernels.warp_specializable`, and
    where its shared memory fits the device."""
    names = ("descriptors", "warp_specialized") if descriptors_only else tuple(VARIANTS)

    def prune(configs, named_args, **constexprs):
        specialized = triton_compat.warp_specialization() and tk.warp_specializable(constexprs) and tk._fitting(
            "fwd", [shared_memory_config({**constexprs, **VARIANTS["warp_specialized"]})], named_args["Q"], constexprs)
        return [config for config in configs if specialized or not config.kwargs["WARP_SPECIALIZE"]]

    configs = [triton.Config(VARIANTS[name], num_warps=DECODE_WARPS, num_stages=DECODE_STAGES) for name in names]
    key = ["L_Q", "L_K", "GROUP", "D_QK", "D_V", "MASK_KIND", "HAS_KPM", "BANDED", "SOFTCAP", "HAS_ALIBI", "PRECISION"]
    tuner = triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune})(_attn_decode)
    return triton_tuning.registered("decode+descriptors" + " only" * descriptors_only, tuner)


# The variant `forced_variant` launches, bypassing the autotuner.
_forced: list[str] = []


@contextlib.contextmanager
def forced_variant(name: str):
    """Within the block, the decode kernel launches as the variant `name` of VARIANTS wherever a call can take
    descriptors (pointers elsewhere), as `triton_kernels.forced_configs` launches the long-query kernels: tests use
    it to run each variant."""
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _launch_decode(grid, args, constexprs, device, descriptors: bool):
    """The decode kernel: on a GPU whose call the descriptor variants serve (`descriptors`), tuned between them and
    pointers; else pointers, or descriptors where FUSED_ATTN_TRITON_DESCRIPTORS=1 forces them (the interpreter), or
    the variant `forced_variant` names."""
    mode = tk.descriptor_mode()
    descriptors = descriptors and mode != "off"
    on_gpu = device.type == "cuda"
    if descriptors and on_gpu and tk._autotune_enabled() and not tk.interpreting() and not _forced and \
            tk.tuned_with_descriptors(lambda: _autotuned_decode(mode == "on")[grid](*args, **constexprs), device):
        return
    name = _forced[-1] if _forced else "descriptors" if mode == "on" else "pointers"
    if not descriptors or tk._descriptor_failure:
        name = "pointers"
    with triton_compat.scratch_allocator(device) if name != "pointers" and on_gpu else contextlib.nullcontext():
        _attn_decode[grid](*args, **constexprs, **VARIANTS[name], num_warps=DECODE_WARPS, num_stages=DECODE_STAGES)


def forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, variant, pages=None) -> torch.Tensor:
    """Writes attention into `out`; returns the fp32 log-sum-exp (B, H_q, L_q). With `pages`
    (triton_kernels.Pages), key and value are the cache's `cache_blocks` views."""
    batch, heads_q, len_q, _ = query.shape
    heads_kv = key.shape[1]
    splits = split_count(batch, heads_kv, tk._lengths(query, key, None, pages)[1], query.device)
    part_o, part_lse = workspace(query, key, value, splits)
    lse = torch.empty((batch, heads_q, len_q), dtype=torch.float32, device=query.device)
    args, constexprs = decode_args(query, key, value, attn_mask, key_padding_mask, is_causal, scale, variant, splits,
                                   part_o, part_lse, pages)
    grid = (batch * heads_kv * splits,)
    with tk._on_device(query):
        _launch_decode(grid, args, constexprs, query.device,
                       not tk.descriptor_refusals(dict(key=key, value=value), pages))
        args, constexprs = combine_args(part_o, part_lse, out, lse, heads_kv, splits, variant)
        _attn_decode_combine[(batch * heads_q * len_q,)](*args, **constexprs, num_warps=COMBINE_WARPS, num_stages=1)
    return lse

