"""The oracle, the error criterion and random problems, shared by the tests and the benchmarks.

Criterion (as FlashAttention tests): compute the reference in float64 and in the input dtype; a
backend's error against float64 must be at most twice the same-dtype reference's error, plus a small
floor for the dtype, for the output, the log-sum-exp and every gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from . import masks
from .backends import reference
from .dropout import Dropout, keep_mask, next_rng, peek_rng, shifted_rng
from .scores import PLAIN, ScoreVariant, lse_dtype, sink_gradient, variant_of

# Floors, relative to the largest magnitude of the float64 result (at least 1).
ERROR_FLOOR = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 1e-5,
    torch.float64: 1e-10,
}

# Each builds a (B, H, L, D) tensor whose storage is laid out differently; unused storage is NaN,
# so a kernel that reads through the wrong strides produces NaN instead of a plausible number.
LAYOUTS = ("contiguous", "heads_inner", "seq_first", "packed", "reversed")


def strided(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to `values` (B, H, L, D) whose memory is laid out as `layout` says."""
    b, h, length, d = values.shape
    if layout == "contiguous":
        storage, order = values.new_empty(b, h, length, d), (0, 1, 2, 3)
    elif layout == "heads_inner":  # (B, L, H, D): a head split of a (B, L, E) tensor
        storage, order = values.new_empty(b, length, h, d), (0, 2, 1, 3)
    elif layout == "seq_first":  # (L, B, H, D): a head split of an (L, B, E) tensor
        storage, order = values.new_empty(length, b, h, d), (1, 2, 0, 3)
    elif layout == "packed":  # the middle slice of a packed (B, L, 3, H, D + 1) projection
        packed = values.new_empty((b, length, 3, h, d + 1))
        # NaN around the slice (for an 8-bit cache, bytes no quantized value has: fp8's NaN, int8's -128).
        unseen = {torch.float8_e4m3fn: 0x7F, torch.int8: 0x80}.get(values.dtype)
        if unseen is None:
            packed.fill_(float("nan"))
        else:
            packed.view(torch.uint8).fill_(unseen)
        view = packed[:, :, 1, :, :d].permute(0, 2, 1, 3)
        view.copy_(values)
        return view
    elif layout == "reversed":  # no unit stride along D
        storage, order = values.new_empty(d, length, h, b), (3, 2, 1, 0)
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    view = storage.permute(*order)
    view.copy_(values)
    return view


def nan_filled_like(tensor: torch.Tensor) -> torch.Tensor:
    """Same shape and strides as `tensor`, every element NaN: shows any element a kernel fails to write."""
    return torch.full_like(tensor, float("nan"))


def random_mask(shape, kind: str, dtype: torch.dtype, device="cpu", generator=None) -> torch.Tensor:
    """A random mask of `shape` (to broadcast against (B, H, L_q, L_k)) and `kind`: "bool" or "additive".

    About one key in four is hidden. Additive masks mix finite biases and -inf.
    """
    hidden = torch.rand(shape, generator=generator, device=device) < 0.25
    if kind == "bool":
        return ~hidden
    if kind == "additive":
        bias = torch.randn(shape, generator=generator, device=device)
        return bias.masked_fill(hidden, float("-inf")).to(dtype)
    raise ValueError(f"kind: expected 'bool' or 'additive', got {kind!r}")


@dataclasses.dataclass
class Results:
    """A forward and backward: output, log-sum-exp and the gradients of query, key and value."""

    out: torch.Tensor
    lse: torch.Tensor
    grad_query: torch.Tensor | None = None
    grad_key: torch.Tensor | None = None
    grad_value: torch.Tensor | None = None
    grad_mask: torch.Tensor | None = None  # of an additive mask that requires grad, in its own shape
    grad_sinks: torch.Tensor | None = None  # of the sinks, (H_q,)

    def named(self) -> dict[str, torch.Tensor]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) is not None}


def dropout_mask(dropout_p: float, batch: int, heads: int, len_q: int, len_k: int, *, device="cpu",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Bool (B, H_q, L_q, L_k), True = kept: the elements that the next call of `attention` (or
    `split_heads_attention`) with `dropout_p` and this `generator` (default: that of `device`) will
    keep, on any backend. The generator is left as it was, so the call that follows uses this mask:

        mask = fused_attn.testing.dropout_mask(0.1, B, H, L_q, L_k, generator=g)
        out = fused_attn.attention(q, k, v, dropout_p=0.1, generator=g)
    """
    rng = peek_rng(torch.device(device), generator)
    return keep_mask(Dropout(dropout_p, rng), batch, heads, len_q, len_k)


def reference_results(query, key, value, grad_out=None, *, dtype=None, attn_mask=None,
                      key_padding_mask=None, is_causal=False, scale=None, grad_lse=None,
                      dropout: Dropout | None = None, mask_grad: bool = False,
                      variant: ScoreVariant = PLAIN) -> Results:
    """The einsum reference, on the CPU, in `dtype` (default the inputs'), with autograd gradients
    through the output (by `grad_out`) and, given `grad_lse`, through the log-sum-exp too; with
    `dropout`, dropping exactly the elements a fused backend drops for the same (seed, offset); with
    `mask_grad`, also the gradient of the additive `attn_mask`, in its own (broadcast) shape; with
    `variant`, the score variant of fused_attn.scores.

    Masks are in `attention`'s convention (bool True = attend; additive of query's dtype, which is
    converted to `dtype`). H_q may be a multiple of H_kv.
    """
    dtype = dtype or query.dtype

    def prepared(tensor, grad):
        return tensor.detach().to("cpu", dtype).requires_grad_(grad)

    wants_grad = grad_out is not None
    q, k, v = (prepared(t, wants_grad) for t in (query, key, value))
    mask = None
    if attn_mask is not None:
        mask = attn_mask.detach().cpu()
        mask = mask if mask.dtype == torch.bool else mask.to(dtype).requires_grad_(mask_grad and wants_grad)
    padding = None if key_padding_mask is None else key_padding_mask.cpu()
    if dropout is not None:
        dropout = Dropout(dropout.p, dropout.rng.cpu())
    if variant.alibi_slopes is not None:
        variant = dataclasses.replace(variant, alibi_slopes=variant.alibi_slopes.cpu())
    if variant.block_tiles is not None:
        variant = dataclasses.replace(variant, block_tiles=variant.block_tiles.cpu(), block_bits=variant.block_bits.cpu())
    sinks = None
    if variant.sinks is not None:  # kept in their own dtype (float32) but for float64, as the kernels take them
        sinks = variant.sinks.detach().to("cpu", lse_dtype(dtype)).requires_grad_(wants_grad)
        variant = dataclasses.replace(variant, sinks=sinks)
    out, lse = reference.attention(q, k, v, mask, padding, is_causal, scale, dropout, variant=variant)
    results = Results(out.detach(), lse.detach())
    if wants_grad:
        outputs, grads_in = [out], [grad_out.detach().to("cpu", dtype)]
        if grad_lse is not None:
            outputs.append(lse)
            grads_in.append(grad_lse.detach().to("cpu", lse.dtype))
        inputs = [q, k, v] + ([mask] if mask_grad else []) + ([sinks] if sinks is not None else [])
        grads = list(torch.autograd.grad(outputs, inputs, grads_in))
        results.grad_query, results.grad_key, results.grad_value = grads[:3]
        if mask_grad:
            results.grad_mask = grads[3]
        if sinks is not None:
            results.grad_sinks = grads[-1]
    return results


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, where equal infinities (a -inf lse of a hidden row) and NaN in both (a row
    that sees a NaN score) count as 0; NaN in one of them alone makes it NaN."""
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    both_inf = torch.isinf(actual) & torch.isinf(expected) & (actual == expected)
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    difference = (actual - expected).abs().masked_fill(both_inf | both_nan, 0.0)
    return float(difference.max()) if difference.numel() else 0.0


def allowed_error(name: str, exact: torch.Tensor, same_dtype: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the error of the same-dtype reference, plus the floor of `dtype` at the result's scale.

    The same-dtype reference's NaN where float64 has a number is left out of its error: there it failed (oneDNN's
    bf16 products on AMX give NaN in row 19 of a (40 × 70) @ (70 × 64) product whose NaN is in row 20), and its
    error elsewhere still bounds the kernel's, which must be a number there (assert_close_to_reference)."""
    finite = exact[torch.isfinite(exact)]
    magnitude = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    failed = torch.isnan(same_dtype.detach().cpu()) & ~torch.isnan(exact.detach().cpu())
    return 2.0 * max_error(same_dtype[~failed], exact[~failed]) + ERROR_FLOOR[dtype] * magnitude


def assert_close_to_reference(actual: Results, exact: Results, same_dtype: Results,
                              dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Checks every result of `actual` by the criterion; returns {name: (error, allowed)}.

    Raises AssertionError naming each result that is not written (NaN) or out of bounds.
    """
    report, failures = {}, []
    for name, value in actual.named().items():
        expected, baseline = getattr(exact, name), getattr(same_dtype, name)
        if tuple(value.shape) != tuple(expected.shape):
            failures.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(expected.shape)}")
            continue
        nan_where_finite = torch.isnan(value.detach().cpu()) & ~torch.isnan(expected)
        if nan_where_finite.any():
            failures.append(f"{name}: {int(nan_where_finite.sum())} elements NaN (unwritten?)")
            continue
        error, allowed = max_error(value, expected), allowed_error(name, expected, baseline, dtype)
        report[name] = (error, allowed)
        if not error <= allowed:
            failures.append(f"{name}: error {error:.3e} > allowed {allowed:.3e}")
    if failures:
        raise AssertionError("; ".join(failures))
    return report


def check_against_reference(actual: Results, query, key, value, grad_out=None, **options):
    """`assert_close_to_reference` against the float64 and same-dtype references of these inputs."""
    exact = reference_results(query, key, value, grad_out, dtype=torch.float64, **options)
    same_dtype = reference_results(query, key, value, grad_out, **options)
    return assert_close_to_reference(actual, exact, same_dtype, query.dtype)


# ---------------------------------------------------------------------------------------------------
# Random problems: one builder for the tests of every backend and for the benchmark's check
# ---------------------------------------------------------------------------------------------------

# The mask shapes a user may pass, each broadcastable to (B, H_q, L_q, L_k).
MASK_SHAPES = {
    "full": lambda b, h, q, k: (b, h, q, k),
    "2d": lambda b, h, q, k: (q, k),
    "batch": lambda b, h, q, k: (b, 1, q, k),
    "heads_keys": lambda b, h, q, k: (1, h, 1, k),
    "keys": lambda b, h, q, k: (b, 1, 1, k),
}
MASK_LAYOUTS = ("contiguous", "transposed", "sliced")
# The tensors a rotation of LAYOUTS lays out, in order.
LAID_OUT = ("query", "key", "value", "out", "grad_out")


@dataclasses.dataclass(frozen=True)
class Case:
    """The shape and features of a random attention problem (the values are drawn by `random_inputs`)."""

    batch: int = 2
    heads_q: int = 2
    heads_kv: int = 2
    len_q: int = 40
    len_k: int = 40
    dim_qk: int = 16
    dim_v: int | None = None         # None: dim_qk
    is_causal: bool = False
    mask: str | None = None          # "bool" or "additive"
    mask_shape: str = "full"         # a key of MASK_SHAPES
    mask_layout: str = "contiguous"  # one of MASK_LAYOUTS
    key_padding: bool = False
    scale: float | None = None       # None: 1/sqrt(dim_qk)
    hidden_rows: bool = False        # some rows see no key at all
    lse_grad: bool = False           # a gradient flows into the returned log-sum-exp
    dropout_p: float = 0.0
    mask_grad: bool = False          # the (additive) mask requires grad: a learned bias
    # The score variant (fused_attn.scores).
    causal_alignment: str | int = "top_left"  # or an integer offset
    window: tuple[int, int] | None = None  # window_size=(left, right)
    softcap: float = 0.0
    alibi: str | None = None         # ALiBi slopes of shape "heads" (H_q,) or "batch" (B, H_q)
    sinks: bool = False              # a learned sink logit per query head (fused_attn.scores)
    program: str | None = None       # a mask program of one of PROGRAM_KINDS (fused_attn.masks), drawn at random

    @property
    def value_dim(self) -> int:
        return self.dim_v or self.dim_qk

    @property
    def softmax_scale(self) -> float:
        return self.dim_qk ** -0.5 if self.scale is None else self.scale


# Few query rows, the forward of generation steps: the cases of the split-KV decode kernels (triton_decode,
# csrc/cuda's flash_decode_kernel) of every backend's tests.
DECODE_CASES = {
    "one_query_gqa": Case(len_q=1, len_k=700, heads_q=8, heads_kv=2, batch=1),
    "one_query_padding_softcap": Case(len_q=1, len_k=333, key_padding=True, softcap=3.0, alibi="batch"),
    "few_queries_bottom_right_window": Case(len_q=5, len_k=600, heads_q=4, heads_kv=1, is_causal=True,
                                            causal_alignment="bottom_right", window=(300, 0), alibi="heads"),
    "queries_over_keys_masks": Case(len_q=16, len_k=9, heads_q=4, heads_kv=4, is_causal=True,
                                    causal_alignment="bottom_right", mask="additive", mask_shape="heads_keys",
                                    hidden_rows=True, lse_grad=True),
    "bool_mask_mqa_odd_dims": Case(len_q=3, len_k=280, heads_q=6, heads_kv=1, mask="bool", dim_qk=40, dim_v=24,
                                   key_padding=True),
}


# Integer alignments (blocks of a longer sequence, as ring attention's steps): the diagonal anywhere, with
# the features whose values depend on it; every backend's variant tests run them.
INTEGER_ALIGNMENT_CASES = {
    "integer_offset_alibi_dropout_window": Case(len_q=29, len_k=53, is_causal=True, causal_alignment=17,
                                               window=(12, -1), alibi="heads", dropout_p=0.2, key_padding=True,
                                               lse_grad=True),
    "negative_offset_hides_rows": Case(len_q=26, len_k=41, is_causal=True, causal_alignment=-9, softcap=2.0,
                                      alibi="batch"),
    "far_offset_window": Case(len_q=20, len_k=40, causal_alignment=1000, window=(990, -1), alibi="heads"),
}


# Attention sinks with the other features, on the long-query and decode paths: every backend's tests run them.
SINK_CASES = {
    "sinks_gqa_causal_window_lse_grad": Case(heads_q=4, heads_kv=2, len_q=45, len_k=70, is_causal=True,
                                             causal_alignment="bottom_right", window=(30, -1), lse_grad=True,
                                             sinks=True),
    "sinks_softcap_alibi_dropout_padding": Case(len_q=37, len_k=53, softcap=3.0, alibi="batch", dropout_p=0.25,
                                                key_padding=True, sinks=True),
    "sinks_learned_bias_hidden_rows": Case(len_q=30, len_k=41, mask="additive", mask_shape="batch", mask_grad=True,
                                           hidden_rows=True, lse_grad=True, sinks=True),
    "sinks_integer_alignment_bool_mask": Case(len_q=26, len_k=41, is_causal=True, causal_alignment=-9,
                                              mask="bool", mask_shape="heads_keys", dim_qk=24, dim_v=8, sinks=True),
    "sinks_decode_gqa_padding": Case(len_q=1, len_k=700, heads_q=8, heads_kv=2, batch=1, key_padding=True,
                                     sinks=True),
    "sinks_decode_few_queries_hidden_rows": Case(len_q=5, len_k=300, heads_q=4, heads_kv=1, is_causal=True,
                                                 causal_alignment="bottom_right", window=(100, 0), alibi="heads",
                                                 mask="bool", mask_shape="batch", hidden_rows=True, sinks=True),
}


# Mask programs (fused_attn.masks) drawn at random by `random_program`; "documents" pairs differ between
# queries and keys when L_q != L_k (documents of queries may then have no key: rows that see nothing).
PROGRAM_KINDS = ("documents_causal", "documents", "prefix_lm", "chunks_causal", "function", "per_head_function",
                 "documents_or_window")

# Mask programs with the other features, several tiles (masks.TILE) each way: every backend's tests run them.
PROGRAM_CASES = {
    "program_documents_causal_gqa_dropout_lse_grad": Case(heads_q=4, heads_kv=2, len_q=300, len_k=300, dim_qk=16,
                                                          program="documents_causal", dropout_p=0.2, lse_grad=True),
    "program_prefix_lm_padding_softcap": Case(len_q=260, len_k=260, program="prefix_lm", key_padding=True, softcap=3.0),
    "program_chunks_alibi_window": Case(len_q=290, len_k=290, program="chunks_causal", alibi="heads", window=(150, 0),
                                        is_causal=True, dim_qk=24, dim_v=8),
    "program_per_head_bottom_right_sinks": Case(heads_q=4, heads_kv=2, len_q=140, len_k=390,
                                                program="per_head_function", is_causal=True,
                                                causal_alignment="bottom_right", sinks=True, lse_grad=True),
    "program_documents_hidden_rows": Case(len_q=270, len_k=200, program="documents", hidden_rows=True, lse_grad=True),
    "program_function_window_integer_offset": Case(len_q=200, len_k=330, program="function", causal_alignment=60,
                                                   window=(100, 40), alibi="batch"),
    "program_documents_or_window_decode": Case(len_q=3, len_k=400, heads_q=4, heads_kv=1, program="documents_or_window"),
}


# NaN in the inputs (check_nan_inputs), on the long-query, decode and program paths of every backend.
NAN_CASES = {
    "nan_plain": Case(len_q=40, len_k=70, lse_grad=True),
    "nan_gqa_causal_softcap_alibi_dropout": Case(heads_q=4, heads_kv=2, len_q=45, len_k=45, is_causal=True,
                                                 softcap=3.0, alibi="heads", dropout_p=0.2, lse_grad=True),
    "nan_window_sinks_padding": Case(len_q=37, len_k=53, is_causal=True, causal_alignment="bottom_right",
                                     window=(20, 0), sinks=True, key_padding=True),
    # 1100 keys: the cpu kernels split them in two (decode_splits) where B · H_kv leaves a thread idle.
    "nan_decode_gqa": Case(len_q=1, len_k=1100, heads_q=8, heads_kv=2, batch=1),
    "nan_program_documents": Case(len_q=260, len_k=260, program="documents_causal", lse_grad=True),
}


def nan_poisoned(inputs: Inputs) -> Inputs:
    """`inputs` with one NaN in a query row (the last batch row's last head) and one in a key (batch row 0, key
    head 0): every score of that row, and the score of that key in each row that sees it, is NaN."""
    case = inputs.case
    with torch.no_grad():
        inputs.query[-1, -1, case.len_q // 2, 0] = float("nan")
        inputs.key[0, 0, case.len_k // 3, 1] = float("nan")
    return inputs


def check_nan_inputs(results: Results, inputs: Inputs) -> dict[str, tuple[float, float]]:
    """A row that sees a NaN score gives NaN, as SDPA does, never a hidden row's 0 or an output that skips the key:
    a backend's results on `nan_poisoned` inputs, against the references. The output and lse meet the criterion
    with NaN exactly where the references' is; each row of NaN output has NaN in its dq. Elsewhere the gradients
    are compared where they and the references are finite: which other elements a NaN reaches depends on the
    tiles a backend visits (the reference's dq = dS K multiplies a NaN key by the 0 of each row that hides it;
    kernels never read those tiles). Asserts that the poison reached some rows and left others finite."""
    exact, same_dtype = reference_for(inputs, torch.float64), reference_for(inputs, inputs.dtype)
    forward = [Results(r.out, r.lse) for r in (results, exact, same_dtype)]
    report = assert_close_to_reference(*forward, inputs.dtype)
    nan_rows = torch.isnan(results.out.detach().cpu()).any(dim=-1)
    assert nan_rows.any() and not nan_rows.all(), "the poison was meant to reach some rows and not others"
    failures = []
    for name, value in results.named().items():
        if name in ("out", "lse"):
            continue
        value, expected, baseline = (t.detach().cpu() for t in (value, getattr(exact, name), getattr(same_dtype, name)))
        finite = torch.isfinite(value) & torch.isfinite(expected) & torch.isfinite(baseline)
        error = max_error(value[finite], expected[finite])
        report[name] = error, allowed_error(name, expected[finite], baseline[finite], inputs.dtype)
        if not error <= report[name][1]:
            failures.append(f"{name}: error {error:.3e} > allowed {report[name][1]:.3e} where finite")
    if results.grad_query is not None and not torch.isnan(results.grad_query.detach().cpu()[nan_rows]).any(-1).all():
        failures.append("grad_query: a row of NaN output has no NaN in its gradient")
    if failures:
        raise AssertionError("; ".join(failures))
    return report


def _document_ids(length: int, generator) -> torch.Tensor:
    """Ids of up to six documents of random lengths (some empty) over `length` tokens."""
    count = int(torch.randint(1, 7, (), generator=generator))
    cuts = torch.sort(torch.randint(0, length + 1, (count - 1,), generator=generator)).values
    return torch.searchsorted(cuts, torch.arange(length), right=True)


def random_program(case: Case, generator, device="cpu") -> masks.MaskProgram:
    """A random mask program of `case.program` (PROGRAM_KINDS) for the case's (B, H_q, L_q, L_k); with
    `case.hidden_rows`, every third query row sees no key."""
    kind, batch, heads, len_q, len_k = case.program, case.batch, case.heads_q, case.len_q, case.len_k

    def ids_pair():
        if len_q == len_k:
            ids = torch.stack([_document_ids(len_q, generator) for _ in range(batch)])
            return ids, None
        return (torch.stack([_document_ids(len_q, generator) for _ in range(batch)]),
                torch.stack([_document_ids(len_k, generator) for _ in range(batch)]))

    per_batch, per_head = batch, None
    if kind in ("documents_causal", "documents", "documents_or_window"):
        mask = masks.documents(*ids_pair())
        if kind == "documents_causal":
            mask = mask & masks.causal(case.causal_alignment)
        elif kind == "documents_or_window":
            mask = mask | masks.sliding_window(int(torch.randint(0, 60, (), generator=generator)), 0, "bottom_right")
    elif kind == "prefix_lm":
        mask = masks.prefix_lm(torch.randint(0, len_k + 1, (batch,), generator=generator))
    elif kind == "chunks_causal":
        mask = masks.chunks(int(torch.randint(1, 200, (), generator=generator))) & masks.causal()
        per_batch = None
    elif kind in ("function", "per_head_function"):
        a, m = (int(v) for v in torch.randint(1, 9, (2,), generator=generator))
        t = int(torch.randint(0, m + 1, (), generator=generator))
        if kind == "function":
            def mask(b, h, q_idx, kv_idx):
                return ((q_idx // 37 * a + kv_idx // 29 + b) % (m + 1) < t) | (q_idx // 64 == kv_idx // 96)
        else:
            per_head = heads

            def mask(b, h, q_idx, kv_idx):
                return ((q_idx // 50 + kv_idx // (20 + 10 * h)) % (m + 1)) <= (t + h) % (m + 1)
    else:
        raise ValueError(f"case.program: expected one of {PROGRAM_KINDS}, got {kind!r}")
    if case.hidden_rows:
        mask = masks.mask_function(mask) & masks.mask_function(lambda b, h, q_idx, kv_idx: q_idx % 3 != 0)
    return masks.mask_program(mask, per_batch, per_head, len_q, len_k, device="cpu").to(device)


def rotated_layouts(rotation: int) -> dict[str, str]:
    """{tensor name: layout}: the five tensors of LAID_OUT get five different LAYOUTS; across the five
    rotations every tensor sees every layout."""
    return {name: LAYOUTS[(rotation + i) % len(LAYOUTS)] for i, name in enumerate(LAID_OUT)}


def dtype_rotations(dtypes, every_layout_dtype, rotations) -> list[tuple[torch.dtype, int]]:
    """(dtype, rotation) pairs for a test: every dtype with `rotations`, and `every_layout_dtype` also
    with the other rotations, so that across the pairs every tensor still meets every layout (a
    kernel reads strides the same way whatever the dtype)."""
    pairs = [(dtype, rotation) for dtype in dtypes for rotation in rotations]
    return pairs + [(every_layout_dtype, rotation) for rotation in range(len(LAYOUTS)) if rotation not in rotations]


def laid_out_mask(values: torch.Tensor, layout: str, generator=None) -> torch.Tensor:
    """`values` in its own storage: as is ("contiguous"), its last two dims transposed in memory
    ("transposed"), or every other element of a wider tensor of garbage ("sliced")."""
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        shape = (*values.shape[:-1], 2 * values.shape[-1] + 1)
        if values.dtype == torch.bool:
            storage = (torch.rand(shape, generator=generator) < 0.5).to(values.device)
        else:
            storage = torch.full(shape, float("nan"), dtype=values.dtype, device=values.device)
        view = storage[..., 1::2]
        view.copy_(values)
        return view
    raise ValueError(f"layout: expected one of {MASK_LAYOUTS}, got {layout!r}")


def hide_rows(mask: torch.Tensor, len_q: int, len_k: int, generator=None) -> torch.Tensor:
    """`mask` widened to a query dim, with every key hidden from query row 0 and about one row in three."""
    full = mask.expand(*mask.shape[:-2], len_q, len_k).clone()
    rows = torch.rand(len_q, generator=generator) < 0.33
    if len_q:
        rows[0] = True
    full[..., rows.to(full.device), :] = False if mask.dtype == torch.bool else float("-inf")
    return full


def poisoned_output(query: torch.Tensor, dim_v: int, layout: str) -> torch.Tensor:
    """An output tensor (B, H_q, L_q, D_v) in `layout`, every element NaN (unused storage too)."""
    values = torch.full((*query.shape[:3], dim_v), float("nan"), dtype=query.dtype, device=query.device)
    return strided(values, layout)


@dataclasses.dataclass
class Inputs:
    """A random problem: every tensor in its own layout, `out` NaN-poisoned, masks as a user gives them."""

    case: Case
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor
    grad_lse: torch.Tensor | None
    attn_mask: torch.Tensor | None        # broadcastable to (B, H_q, L_q, L_k)
    key_padding_mask: torch.Tensor | None  # (B, L_k), True = ignore
    dropout_seed: int = 0                  # seeds the generator that dropout draws from
    alibi_slopes: torch.Tensor | None = None  # (H_q,) or (B, H_q) float32
    sinks: torch.Tensor | None = None  # (H_q,) float32 (float64 for float64 inputs)
    program: masks.MaskProgram | None = None  # given as attn_mask (then attn_mask is None)

    def variant_keywords(self) -> dict:
        """The score variant as `attention`'s keywords."""
        case = self.case
        return dict(causal_alignment=case.causal_alignment, window_size=case.window,
                    softcap=case.softcap or None, alibi_slopes=self.alibi_slopes, sinks=self.sinks)

    def variant(self) -> ScoreVariant:
        """The ScoreVariant the call makes of `variant_keywords()` and the program."""
        variant = variant_of(self.query, **self.variant_keywords())
        return masks.with_program(self.program, variant, self.case.is_causal, self.query, self.key)[1]

    def call_mask(self):
        """What the call passes as attn_mask: the mask tensor or the program."""
        return self.program if self.program is not None else self.attn_mask

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    def dropout_generator(self) -> torch.Generator:
        """A fresh generator in the state the call starts from (one per call, so the reference and
        the backend drop the same elements)."""
        return torch.Generator(self.query.device).manual_seed(self.dropout_seed)

    def dropout(self) -> Dropout | None:
        """The dropout the call with `dropout_generator()` will apply, or None."""
        if self.case.dropout_p == 0.0:
            return None
        return Dropout(self.case.dropout_p, peek_rng(self.query.device, self.dropout_generator()))

    def mask_view(self) -> torch.Tensor | None:
        """The mask as every backend receives it: (B, H_q, L_q, L_k), stride 0 where broadcast."""
        if self.attn_mask is None:
            return None
        b, h, q = self.query.shape[:3]
        return self.attn_mask.expand(b, h, q, self.key.shape[2])


def random_inputs(case: Case, dtype: torch.dtype, rotation: int, generator, device="cpu") -> Inputs:
    """Fresh random inputs for `case` on `device`: q, k, v, out and grad_out laid out by
    `rotated_layouts(rotation)`, the mask in `case.mask_layout`, the key padding and grad_lse strided."""
    layouts = rotated_layouts(rotation)

    def tensor(name, heads, length, dim):
        values = torch.randn(case.batch, heads, length, dim, generator=generator).to(dtype).to(device)
        return strided(values, layouts[name])

    query = tensor("query", case.heads_q, case.len_q, case.dim_qk)
    key = tensor("key", case.heads_kv, case.len_k, case.dim_qk)
    value = tensor("value", case.heads_kv, case.len_k, case.value_dim)
    grad_out = tensor("grad_out", case.heads_q, case.len_q, case.value_dim)
    out = poisoned_output(query, case.value_dim, layouts["out"])
    mask = None
    if case.mask is not None:
        shape = MASK_SHAPES[case.mask_shape](case.batch, case.heads_q, case.len_q, case.len_k)
        values = random_mask(shape, case.mask, dtype, generator=generator)
        if case.hidden_rows:
            values = hide_rows(values, case.len_q, case.len_k, generator)
        mask = laid_out_mask(values.to(device), case.mask_layout, generator)
    padding = None
    if case.key_padding:
        # Each batch row padded as users pad: keys missing at the end (right padding), at the start
        # (left padding), or scattered; the shapes rotate over the rows from a random first one.
        # Every other column of (L_k, 2B) storage, transposed: (B, L_k) with no unit stride.
        hidden = torch.rand(case.len_k, 2 * case.batch, generator=generator) < 0.25
        kept = torch.randint(0, case.len_k + 1, (case.batch,), generator=generator).tolist()
        first_shape = int(torch.randint(0, 3, (), generator=generator))
        position = torch.arange(case.len_k)
        for b in range(case.batch):
            shape = (first_shape + b) % 3
            if shape == 0:
                hidden[:, 2 * b] = position >= kept[b]
            elif shape == 1:
                hidden[:, 2 * b] = position < case.len_k - kept[b]
        if case.hidden_rows:
            hidden[:, 0] = True  # the whole first batch sees no key
        padding = hidden.to(device)[:, ::2].t()
    grad_lse = None
    if case.lse_grad:  # (B, L_q, H_q) storage viewed as (B, H_q, L_q)
        grad_lse = torch.randn(case.batch, case.len_q, case.heads_q, generator=generator).to(device, lse_dtype(dtype))
        grad_lse = grad_lse.permute(0, 2, 1)
    dropout_seed = int(torch.randint(0, 2 ** 62, (), generator=generator))
    slopes = None
    if case.alibi is not None:  # (H_q, B) storage, so a (B, H_q) view has no unit stride
        slopes = (torch.rand(case.heads_q, case.batch, generator=generator) * 0.5).to(device).t()
        slopes = slopes[0] if case.alibi == "heads" else slopes
    sinks = None
    if case.sinks:  # around the scores' scale, some far above it (a row's weights then mostly go to the sink)
        sinks = torch.randn(case.heads_q, generator=generator) * 2.0
        sinks[0] += 4.0
        sinks = sinks.to(device, lse_dtype(dtype))
    program = None
    if case.program is not None:
        program = random_program(case, generator, device)
    return Inputs(case, query, key, value, out, grad_out, grad_lse, mask, padding, dropout_seed, slopes, sinks,
                  program)


def reference_for(inputs: Inputs, dtype: torch.dtype) -> Results:
    """The einsum reference of `inputs` on the CPU in `dtype`, differentiated through the output and,
    where the case has one, through the log-sum-exp (by grad_lse)."""
    # A learned mask's gradient is compared in the mask's own (broadcast) shape, as autograd gives it.
    mask = inputs.attn_mask if inputs.case.mask_grad else inputs.mask_view()
    return reference_results(inputs.query, inputs.key, inputs.value, inputs.grad_out, dtype=dtype,
                             attn_mask=mask, key_padding_mask=inputs.key_padding_mask,
                             is_causal=inputs.case.is_causal, scale=inputs.case.scale,
                             grad_lse=inputs.grad_lse, dropout=inputs.dropout(),
                             mask_grad=inputs.case.mask_grad, variant=inputs.variant())


def check_inputs(actual: Results, inputs: Inputs) -> dict[str, tuple[float, float]]:
    """`assert_close_to_reference` of a backend's results on `inputs` (grad_lse included); for a case
    with hidden rows also: there are such rows, and they have output 0, lse -inf (with sinks: the sink)
    and dq 0."""
    exact = reference_for(inputs, torch.float64)
    report = assert_close_to_reference(actual, exact, reference_for(inputs, inputs.dtype), inputs.dtype)
    if inputs.case.hidden_rows:
        no_key = torch.full_like(exact.lse, float("-inf"))
        if inputs.sinks is not None:  # a row that sees no key has the sink alone in its softmax
            no_key = inputs.sinks.detach().cpu().double().view(1, -1, 1).expand_as(exact.lse)
        hidden = rows_that_see_no_key(inputs)
        assert hidden.any(), "the case was meant to have rows that see no key"
        assert (actual.lse.detach().cpu().double()[hidden] == no_key[hidden]).all()
        assert (actual.out.detach().cpu()[hidden] == 0).all()
        if actual.grad_query is not None:
            assert (actual.grad_query.detach().cpu()[hidden] == 0).all()
    return report


def rows_that_see_no_key(inputs: Inputs) -> torch.Tensor:
    """Bool (B, H_q, L_q): the rows whose every score is hidden, from the reference's lse without sinks or dropout
    (with them a row's lse or output cannot tell: a sink far above its scores gives the sink's lse in float64 too,
    and dropout can zero its output)."""
    case = inputs.case
    variant = dataclasses.replace(inputs.variant(), sinks=None)
    plain = reference_results(inputs.query, inputs.key, inputs.value, dtype=torch.float64, attn_mask=inputs.mask_view(),
                              key_padding_mask=inputs.key_padding_mask, is_causal=case.is_causal, scale=case.scale,
                              variant=variant)
    return plain.lse == float("-inf")


def run_backend(backend, inputs: Inputs, out_layout: str | None = None) -> Results:
    """Forward and backward through a backend's own entry points (`Backend.forward` / `backward`,
    below the ops and autograd) into the inputs' NaN-poisoned output, or a fresh NaN-poisoned one in
    `out_layout`; a mask gradient summed into the mask's own shape, as autograd does."""
    case = inputs.case
    q, k, v = inputs.query, inputs.key, inputs.value
    mask = inputs.mask_view()
    out = inputs.out if out_layout is None else poisoned_output(q, case.value_dim, out_layout)
    dropout = inputs.dropout()
    variant = inputs.variant()
    lse = backend.forward(q, k, v, mask, inputs.key_padding_mask, case.is_causal, case.softmax_scale, out,
                          dropout, variant)
    grad_mask = torch.zeros(mask.shape, dtype=mask.dtype, device=mask.device) if case.mask_grad else None
    dq, dk, dv = backend.backward(q, k, v, mask, inputs.key_padding_mask, case.is_causal, case.softmax_scale,
                                  out, lse, inputs.grad_out, inputs.grad_lse, dropout, grad_mask, variant)
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype, name
    if grad_mask is not None:
        grad_mask = grad_mask.sum_to_size(inputs.attn_mask.shape)
    # The sinks' gradient comes from the call's results alone, the same for every backend.
    grad_sinks = None
    if variant.sinks is not None:
        grad_sinks = sink_gradient(variant.sinks, lse, out, inputs.grad_out, inputs.grad_lse)
    return Results(out, lse, dq, dk, dv, grad_mask, grad_sinks)


def check_padding_is_not_read(backend, dtype: torch.dtype, generator, margin: int = 0, device="cpu",
                              poison: float = float("nan"), len_q: int = 19, len_k: int | None = None,
                              laid_out=None) -> dict[str, tuple[float, float]]:
    """Keys that a batch row's padding leaves outside its span of unpadded keys, further than `margin`
    from it, are never read by `backend` (Backend.forward / backward): K and V poisoned with `poison`
    (NaN, inf or -inf) there give the results of clean ones. Row 0 is left-padded, row 1 right-padded,
    row 2 both, so each span starts and ends inside a key block of the kernels. `margin` allows for
    kernels that read whole key blocks at the span's edges (masking the padded keys of those); len_k
    defaults to 2 * margin + 60. `laid_out`: None, or a function giving the inputs in other layouts (those
    a kernel variant reads), applied before K and V are poisoned."""
    len_k = 2 * margin + 60 if len_k is None else len_k
    case = Case(batch=3, heads_q=2, heads_kv=1, len_q=len_q, len_k=len_k, dim_qk=16, key_padding=True)
    inputs = random_inputs(case, dtype, 0, generator, device)
    first, end = margin + 13, len_k - margin - 11
    padding = torch.zeros(3, len_k, dtype=torch.bool)
    padding[[0, 2], :first] = True
    padding[[1, 2], end:] = True
    inputs = dataclasses.replace(inputs, key_padding_mask=padding.to(device))
    if laid_out is not None:
        inputs = laid_out(inputs)
    expected = reference_for(inputs, torch.float64), reference_for(inputs, dtype)
    with torch.no_grad():
        for tensor in (inputs.key, inputs.value):
            tensor[[0, 2], :, :first - margin] = poison
            tensor[[1, 2], :, end + margin:] = poison
    return assert_close_to_reference(run_backend(backend, inputs), *expected, dtype)


def run_attention(inputs: Inputs, backend: str) -> Results:
    """`fused_attn.attention(..., backend=backend)` on `inputs` with autograd: output, lse and the
    gradients of q, k, v by grad_out (and grad_lse where the case has one)."""
    from .functional import attention

    case = inputs.case
    q, k, v = (t.detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    mask = inputs.call_mask()
    if case.mask_grad:
        mask = mask.detach().requires_grad_()
    keywords = inputs.variant_keywords()
    sinks = keywords["sinks"] = None if inputs.sinks is None else inputs.sinks.detach().requires_grad_()
    out, lse = attention(q, k, v, attn_mask=mask, is_causal=case.is_causal, scale=case.scale,
                         enable_gqa=case.heads_q != case.heads_kv, key_padding_mask=inputs.key_padding_mask,
                         return_lse=True, backend=backend, dropout_p=case.dropout_p,
                         generator=inputs.dropout_generator(), **keywords)
    outputs, grads_in = [out], [inputs.grad_out]
    if inputs.grad_lse is not None:
        outputs.append(lse)
        grads_in.append(inputs.grad_lse)
    wrt = [q, k, v] + ([mask] if case.mask_grad else []) + ([sinks] if sinks is not None else [])
    grads = list(torch.autograd.grad(outputs, wrt, grads_in))
    return Results(out.detach(), lse.detach(), *grads[:3], grads[3] if case.mask_grad else None,
                   grads[-1] if sinks is not None else None)


def check_dropout_at_positions(backend, rows: tuple[int, int], keys: tuple[int, int], dtype: torch.dtype,
                               generator: torch.Generator) -> None:
    """Asserts that `backend` (its forward and backward) on rows q0:q1 and keys k0:k1 of a (2, 3, 17 or 40,
    16) problem, given the rng shifted to (q0, k0), drops exactly the elements the whole call drops there."""
    (q0, q1), (k0, k1) = rows, keys
    q, k, v = (torch.randn(2, 3, length, 16, generator=generator, dtype=dtype) for length in (17, 40, 40))
    whole = Dropout(0.3, next_rng(q.device, generator))
    block = Dropout(0.3, shifted_rng(whole.rng, query_start=q0, key_start=k0))
    q, k, v = q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1]
    keep = keep_mask(whole, 2, 3, 17, 40)[:, :, q0:q1, k0:k1]
    assert torch.equal(keep_mask(block, 2, 3, q1 - q0, k1 - k0), keep)
    out = torch.empty(q.shape[:-1] + (16,), dtype=dtype)
    lse = backend.forward(q, k, v, None, None, False, 0.25, out, block)
    weights = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1)
    torch.testing.assert_close(out, (weights * keep / 0.7) @ v, atol=3e-5, rtol=3e-5)
    grad_out = torch.randn(out.shape, generator=generator, dtype=dtype)
    grads = backend.backward(q, k, v, None, None, False, 0.25, out, lse, grad_out, None, block)
    torch.testing.assert_close(grads[2], (weights * keep / 0.7).transpose(-1, -2) @ grad_out, atol=3e-5, rtol=3e-5)
