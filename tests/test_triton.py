"""The `triton` backend against the float64 reference, by the criterion of DESIGN.md.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1);
with one, the same tests run compiled on CUDA tensors. Problems are small: the interpreter executes
every program in Python. To cover several blocks per row and column with them, half of the cases force
small tiles (16 and 32, different for queries and keys), the other half use the default configs.

Every case gives q, k, v, the output, grad_out and the mask each its own memory layout, fills the
output and the gradients with NaN before the kernels run, and checks output, log-sum-exp, dq, dk, dv.

Triton's interpreter computes `tl.dot` on bfloat16 operands on their raw bit patterns
(triton-lang/triton#11584) and truncates fp32 -> bfloat16 conversions where the GPU rounds to nearest
even. The `bf16_dot_remedy` fixture patches both inside the interpreter to what the GPU computes; the
kernel source stays exactly what the GPU compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import pytest
import torch

import fused_attn
from fused_attn import masks, quantization, testing
from fused_attn.backends import registry
from fused_attn.backends.reference import ReferenceBackend
from fused_attn.problem import lse_dtype
from fused_attn.scores import ScoreVariant, sink_gradient

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fused_attn.backends import triton_compat  # noqa: E402
from fused_attn.backends import triton_kernels as tk  # noqa: E402
from fused_attn.backends.triton import TritonBackend  # noqa: E402

pytest.importorskip("hypothesis")
import combinations  # noqa: E402
from hypothesis import given  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_IDS = ("fp16", "bf16", "fp32")
BACKEND = TritonBackend()
Case = testing.Case

if not HAS_CUDA and not tk.interpreting():
    pytest.skip("no CUDA device and the triton kernels were not built for the interpreter",
                allow_module_level=True)

# Small tiles, different along queries and keys, so that a 40-long sequence spans several blocks and
# the causal start of the dK/dV loop is rounded down to a query block.
SMALL_TILES = dict(fwd=tk.KernelConfig(16, 32, 4, 1), bwd_dkdv=tk.KernelConfig(32, 16, 4, 1),
                   bwd_dq=tk.KernelConfig(16, 32, 4, 1))

# The tests that need the tensor-descriptor variants offered: by the installed Triton (triton_compat.DESCRIPTORS_FROM)
# and, on a GPU, by the device (TMA from compute capability 9.0 on).
_DESCRIPTORS_UNAVAILABLE = tk.descriptors_unavailable(torch.device(DEVICE))
needs_descriptors = pytest.mark.skipif(_DESCRIPTORS_UNAVAILABLE is not None, reason=str(_DESCRIPTORS_UNAVAILABLE))
# How the kernels of a test read Q, K, V and write their outputs: through pointers, or through tensor descriptors
# (`reading_through`).
READS = ["pointers", pytest.param("descriptors", marks=needs_descriptors)]
# The dtypes the descriptor variants take (fp32 keeps pointers: tk.FLOAT32_REFUSAL).
DESCRIPTOR_DTYPES = (torch.float16, torch.bfloat16)


def reads_and_dtypes(params) -> list:
    """(reads, dtype, ...) params: each of `params` (dtype, ...) through pointers, and through descriptors where its
    dtype takes them (DESCRIPTOR_DTYPES)."""
    found = []
    for reads in READS:
        name = getattr(reads, "values", (reads,))[0]
        marks = getattr(reads, "marks", ())
        for param in params:
            values, id_ = (param.values, param.id) if hasattr(param, "values") else ((param,), None)
            if name == "descriptors" and values[0] not in DESCRIPTOR_DTYPES:
                continue
            id_ = id_ or DTYPE_IDS[DTYPES.index(values[0])]
            found.append(pytest.param(name, *values, marks=[*marks, *getattr(param, "marks", ())], id=f"{name}-{id_}"))
    return found


def reading_through(reads: str, monkeypatch) -> dict:
    """For "descriptors", forces the descriptor variants (FUSED_ATTN_TRITON_DESCRIPTORS=1) and returns the record of
    each launch's variant, by kernel (`_recording_variants`); for "pointers", an empty record."""
    if reads == "pointers":
        return {}
    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, "1")
    return _recording_variants(monkeypatch, decode=True)


# ---------------------------------------------------------------------------------------------------
# The bf16 remedy of the interpreter
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def bf16_dot_remedy(interpreter_remedies):
    """conftest's `interpreter_remedies`, for every test here: counters and the original methods."""
    return interpreter_remedies


@pytest.fixture(autouse=True)
def nan_gradients(monkeypatch):
    """Gradients start as NaN, so an element the kernels fail to write shows."""
    monkeypatch.setattr(tk, "new_gradient", testing.nan_filled_like)


# ---------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------

CASES = {
    "plain": Case(),
    "causal": Case(is_causal=True),
    "causal_short_queries": Case(len_q=19, len_k=50, is_causal=True),
    "causal_long_queries": Case(len_q=50, len_k=19, is_causal=True),
    "lq_ne_lk": Case(len_q=23, len_k=57),
    "bool_mask_full_transposed": Case(mask="bool", mask_layout="transposed"),
    "bool_mask_2d_sliced": Case(mask="bool", mask_shape="2d", mask_layout="sliced", is_causal=True),
    "bool_mask_keys": Case(mask="bool", mask_shape="keys", len_q=33, len_k=41),
    "additive_mask_heads_keys": Case(mask="additive", mask_shape="heads_keys"),
    "additive_mask_batch_sliced": Case(mask="additive", mask_shape="batch", mask_layout="sliced",
                                       is_causal=True),
    "additive_mask_full_transposed": Case(mask="additive", mask_layout="transposed", len_q=21, len_k=35),
    "key_padding": Case(key_padding=True, len_k=45),
    "key_padding_and_mask": Case(key_padding=True, mask="bool", mask_shape="batch", is_causal=True),
    "gqa": Case(heads_q=4, heads_kv=2, is_causal=True),
    "mqa": Case(heads_q=3, heads_kv=1, mask="additive", mask_shape="heads_keys"),
    "head_dim_1": Case(dim_qk=1, len_q=17, len_k=29),
    "head_dim_3": Case(dim_qk=3, is_causal=True),
    "head_dim_40_dv_24": Case(dim_qk=40, dim_v=24),
    "dv_ne_dqk": Case(dim_qk=8, dim_v=20, heads_q=4, heads_kv=1),
    "head_dims_200_160": Case(dim_qk=200, dim_v=160, len_q=36, len_k=28, batch=1, is_causal=True),
    "single_key_and_query": Case(len_q=1, len_k=1),
    "custom_scale": Case(scale=0.37, mask="additive", mask_shape="2d"),
    "hidden_rows": Case(hidden_rows=True, mask="bool", is_causal=True, key_padding=True),
    "hidden_rows_additive": Case(hidden_rows=True, mask="additive", mask_shape="batch"),
    "lse_grad": Case(lse_grad=True, is_causal=True, mask="bool", mask_shape="2d"),
    "lse_grad_gqa": Case(lse_grad=True, heads_q=4, heads_kv=2, key_padding=True),
    "dropout": Case(dropout_p=0.3),
    "dropout_causal_mask": Case(dropout_p=0.17, is_causal=True, mask="additive", mask_shape="heads_keys",
                                len_q=23, len_k=45),
    "dropout_gqa_padding_lse_grad": Case(dropout_p=0.5, heads_q=4, heads_kv=2, key_padding=True,
                                         lse_grad=True, dim_qk=24, dim_v=8),
    "dropout_hidden_rows": Case(dropout_p=0.9, hidden_rows=True, mask="bool", mask_shape="batch"),
    "mask_grad_full": Case(mask="additive", mask_grad=True, mask_layout="transposed", len_q=29, len_k=37),
    "mask_grad_heads_causal_dropout": Case(mask="additive", mask_shape="heads_keys", mask_grad=True,
                                           is_causal=True, dropout_p=0.2, heads_q=4, heads_kv=2),
    "mask_grad_2d_padding_lse": Case(mask="additive", mask_shape="2d", mask_grad=True, key_padding=True,
                                     lse_grad=True, mask_layout="sliced"),
    "mask_grad_hidden_rows": Case(mask="additive", mask_shape="batch", mask_grad=True, hidden_rows=True),
}

# The score variants (fused_attn.scores), together with each other and the features above.
VARIANT_CASES = {
    "window_causal_bottom_right_gqa": Case(len_q=23, len_k=57, heads_q=4, heads_kv=2, is_causal=True,
                                           causal_alignment="bottom_right", window=(19, -1)),
    "window_both_sides_dropout_padding": Case(len_q=45, len_k=45, window=(5, 11), dropout_p=0.3,
                                              key_padding=True, lse_grad=True),
    "bottom_right_more_queries_than_keys": Case(len_q=50, len_k=19, is_causal=True,
                                                causal_alignment="bottom_right", dim_qk=24, dim_v=8),
    "softcap_alibi_additive": Case(softcap=2.5, alibi="heads", mask="additive", mask_shape="heads_keys",
                                   mask_layout="transposed", len_q=21, len_k=35),
    "softcap_learned_bias_window": Case(softcap=4.0, mask="additive", mask_grad=True, window=(5, 20),
                                        len_q=29, len_k=37),
    "everything": Case(heads_q=4, heads_kv=1, len_q=30, len_k=50, is_causal=True,
                       causal_alignment="bottom_right", window=(20, 3), softcap=3.0, alibi="batch",
                       mask="additive", mask_grad=True, mask_shape="2d", key_padding=True, dropout_p=0.2,
                       lse_grad=True, dim_qk=20),
    "window_hides_rows": Case(len_q=40, len_k=30, window=(0, 0), hidden_rows=True, mask="bool",
                              key_padding=True),
    **testing.INTEGER_ALIGNMENT_CASES,
}

# Each rotation gives q, k, v, out and grad_out five different layouts, and across the rotations
# every tensor sees every layout. Every dtype runs rotations 0 (small tiles) and 1 (default tiles);
# bf16 also the other three, so that every tensor meets every layout.
DTYPE_ROTATIONS = [pytest.param(dtype, rotation, id=f"{str(dtype).removeprefix('torch.')}-{rotation}")
                   for dtype, rotation in testing.dtype_rotations(DTYPES, torch.bfloat16, (0, 1))]


def make_inputs(case: Case, dtype, rotation: int, generator) -> testing.Inputs:
    return testing.random_inputs(case, dtype, rotation, generator, DEVICE)


# ---------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------

def run_backend(inputs: testing.Inputs, out_layout: str | None = None) -> testing.Results:
    return testing.run_backend(BACKEND, inputs, out_layout)


def _tiles(rotation: int) -> dict:
    return SMALL_TILES if rotation % 2 == 0 else {}


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------

# Each case with every (dtype, rotation) pair; `make test` (not slow) takes two pairs of each, turned along the cases
# so that every pair still meets a share of them, and the drawn combinations (tests/combinations.py) the rest.
MATCH_RUNS = [pytest.param(name, *pair.values, id=f"{name}-{pair.id}",
                           marks=() if (index - turn) % len(DTYPE_ROTATIONS) in (0, 4) else pytest.mark.slow)
              for index, name in enumerate(CASES) for turn, pair in enumerate(DTYPE_ROTATIONS)]


@pytest.mark.parametrize("name,dtype,rotation", MATCH_RUNS)
def test_matches_reference(name, dtype, rotation, generator):
    case = CASES[name]
    inputs = make_inputs(case, dtype, rotation, generator)
    with tk.forced_configs(**_tiles(rotation)):
        results = run_backend(inputs)
    testing.check_inputs(results, inputs)


@pytest.mark.parametrize("rotation", [0, 1])  # small tiles, then the default ones
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_score_variants_match_reference(name, dtype, rotation, generator):
    """Windows (key blocks outside skipped), bottom-right alignment, softcap and ALiBi, drawn together
    with masks, dropout, learned biases and GQA."""
    inputs = make_inputs(VARIANT_CASES[name], dtype, rotation, generator)
    with tk.forced_configs(**_tiles(rotation)):
        results = run_backend(inputs)
    testing.check_inputs(results, inputs)


# Few query rows: the split-KV decode kernels (fused_attn.backends.triton_decode) run the forward.
DECODE_CASES = testing.DECODE_CASES


@pytest.mark.parametrize("splits", [None, "3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_kernels_match_reference(name, dtype, splits, generator, monkeypatch):
    """Split-KV forward (the backward runs the long-query kernels on its output and lse): splits from
    the problem, and three forced ones (uneven, some empty under a window or padding)."""
    from fused_attn.backends import triton_decode

    if splits is not None:
        monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", splits)
    inputs = make_inputs(DECODE_CASES[name], dtype, 3, generator)
    assert triton_decode.takes(inputs.query, inputs.key, inputs.value, None)
    launched = []
    original = triton_decode.split_count
    monkeypatch.setattr(triton_decode, "split_count", lambda *a: launched.append(original(*a)) or launched[-1])
    results = run_backend(inputs)
    assert launched and (splits is None or launched == [3])
    testing.check_inputs(results, inputs)


# Each NaN case in one dtype, taken in turn.
NAN_RUNS = [pytest.param(name, DTYPES[i % len(DTYPES)], id=f"{name}-{DTYPE_IDS[i % len(DTYPES)]}")
            for i, name in enumerate(testing.NAN_CASES)]


@pytest.mark.parametrize("name,dtype", NAN_RUNS)
def test_nan_inputs_give_nan_rows(name, dtype, generator, monkeypatch):
    """A NaN query element and a NaN key element: NaN rows where the reference has them (the GPU's maximum passes
    over NaN and the interpreter's carries it; the row's sum is NaN either way), in small tiles so that rows
    cross key blocks, and the decode case over three splits."""
    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "3")
    inputs = testing.nan_poisoned(make_inputs(testing.NAN_CASES[name], dtype, 0, generator))
    with tk.forced_configs(**SMALL_TILES):
        results = run_backend(inputs)
    testing.check_nan_inputs(results, inputs)


@combinations.settings(12)
@given(problem=combinations.problems(DTYPES, longer=False))  # the interpreter takes seconds per program tile
def test_any_combination_meets_criterion(problem):
    """Every feature drawn together (tests/combinations.py), in small tiles: the long-query and decode kernels."""
    inputs = combinations.inputs_of(problem, DEVICE)
    with tk.forced_configs(**SMALL_TILES):
        results = run_backend(inputs)
    combinations.check(results, inputs)


def test_decode_split_count_override_is_checked(monkeypatch):
    from fused_attn.backends import triton_decode

    cpu = torch.device("cpu")
    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "5")
    assert triton_decode.split_count(1, 1, 4096, cpu) == 5
    assert triton_decode.split_count(1, 1, 3, cpu) == 3  # at most one split per key
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", bad)
        with pytest.raises(ValueError, match="FUSED_ATTN_TRITON_DECODE_SPLITS"):
            triton_decode.split_count(1, 1, 4096, cpu)


def test_decode_split_count_follows_the_problem():
    from fused_attn.backends import triton_decode

    cpu = torch.device("cpu")
    sms = triton_decode.INTERPRETER_SMS
    assert triton_decode.split_count(1, 1, 4096, cpu) == 8  # 1 program -> 2 * sms, keys allow it
    assert triton_decode.split_count(1, 1, 300, cpu) == 1   # too few keys to split
    assert triton_decode.split_count(2 * sms, 1, 8192, cpu) == 1  # enough programs already
    small = torch.empty(1, 8, 40, 16)
    assert triton_decode.takes(torch.empty(1, 8, 16, 16), small, small, None)
    assert not triton_decode.takes(torch.empty(1, 8, 17, 16), small, small, None)
    assert not triton_decode.takes(torch.empty(1, 32, 4, 16), small[:, :1], small[:, :1], None)  # 128 rows
    assert not triton_decode.takes(torch.empty(1, 8, 1, 256), torch.empty(1, 8, 40, 256), small, None)
    assert not triton_decode.takes(torch.empty(1, 8, 1, 16), small, small, object())  # dropout


@pytest.mark.parametrize("name", ["gqa", "key_padding_and_mask", "lse_grad_gqa", "hidden_rows"])
@pytest.mark.parametrize("reads,dtype", reads_and_dtypes(DTYPES))
def test_gradients_bitwise_identical_on_two_runs(reads, name, dtype, generator, monkeypatch):
    case = CASES[name]
    inputs = make_inputs(case, dtype, 1, generator)
    variants = reading_through(reads, monkeypatch)
    if reads == "descriptors":
        inputs = in_descriptor_layouts(inputs, 1)
    with tk.forced_configs(**SMALL_TILES):
        first = run_backend(inputs, "contiguous")
        second = run_backend(inputs, "seq_first")
    for field in ("grad_query", "grad_key", "grad_value"):
        a, b = getattr(first, field), getattr(second, field)
        assert not torch.isnan(a).any()
        assert torch.equal(a, b), field
    if reads == "descriptors":
        assert variants == {"fwd": [True] * 2, "bwd_dkdv": [True] * 2, "bwd_dq": [True] * 2}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["causal", "gqa", "additive_mask_batch_sliced", "key_padding_and_mask",
                                  "head_dim_40_dv_24"])
def test_public_attention_with_autograd(name, dtype, generator):
    """fused_attn.attention(backend="triton"): the registered ops, their autograd, the mask view."""
    inputs = make_inputs(CASES[name], dtype, 2, generator)
    with tk.forced_configs(**SMALL_TILES):
        results = testing.run_attention(inputs, "triton")
    testing.check_inputs(results, inputs)


def test_opcheck_with_triton_backend(generator):
    """The registered op, its fake kernel and autograd hold with the triton kernels inside."""
    q = torch.randn(1, 2, 20, 16, generator=generator).to(DEVICE).requires_grad_()
    k = torch.randn(1, 2, 24, 16, generator=generator).to(DEVICE).requires_grad_()
    v = torch.randn(1, 2, 24, 16, generator=generator).to(DEVICE).requires_grad_()
    with tk.forced_configs(**SMALL_TILES):
        torch.library.opcheck(fused_attn.ops.attention_fwd,
                              (q, k, v, None, None, True, 0.25, 0.0, None, False, "triton"))
        rng = torch.tensor([12345, 6, 0, 0], device=DEVICE)
        torch.library.opcheck(fused_attn.ops.attention_fwd,
                              (q, k, v, None, None, True, 0.25, 0.2, rng, False, "triton"))


def _recording_launches(monkeypatch):
    """Records, for every kernel launch, the tensors handed to the kernel."""
    launches = []
    launch = tk._launch

    def recording(kernel, programs_along, args, constexprs, tensor, **options):
        launches.append((kernel, [a for a in args if isinstance(a, torch.Tensor)]))
        return launch(kernel, programs_along, args, constexprs, tensor, **options)

    monkeypatch.setattr(tk, "_launch", recording)
    return launches


@pytest.mark.parametrize("batch_first", [True, False], ids=["BLE", "LBE"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_split_heads_on_packed_projection_reads_and_writes_in_place(batch_first, dtype, generator,
                                                                     monkeypatch):
    """Q, K, V are slices of one packed (B, L, 3E) / (L, B, 3E) projection; the kernel gets those very
    views and writes the merged (B, L, E) output itself: no copy on the way in or out."""
    batch, length, heads, dim = 2, 37, 3, 12
    embed = heads * dim
    shape = (batch, length, 3 * embed) if batch_first else (length, batch, 3 * embed)
    packed = torch.randn(shape, generator=generator).to(dtype).to(DEVICE).requires_grad_()
    q, k, v = packed.split(embed, dim=-1)
    launches = _recording_launches(monkeypatch)
    with tk.forced_configs(**SMALL_TILES):
        merged, lse = fused_attn.split_heads_attention(q, k, v, heads, is_causal=True, batch_first=batch_first,
                                                       return_lse=True, backend="triton")
        grad_merged = torch.randn(merged.shape, generator=generator).to(dtype).to(DEVICE)
        (grad_packed,) = torch.autograd.grad(merged, packed, grad_merged)

    kernel, tensors = launches[0]
    assert kernel == "fwd"
    kernel_q, kernel_k, kernel_v, kernel_out = tensors[:4]
    storage = packed.untyped_storage().data_ptr()
    for got, part in zip((kernel_q, kernel_k, kernel_v), (q, k, v)):
        assert got.untyped_storage().data_ptr() == storage      # the projection itself, not a copy
        assert got.data_ptr() == part.data_ptr()
    assert kernel_q.stride() == fused_attn.functional._split_heads("q", q, heads, batch_first).stride()
    # The kernel wrote the merged output in place: same storage and offset, and a free view of it.
    assert merged.untyped_storage().data_ptr() == kernel_out.untyped_storage().data_ptr()
    assert merged.data_ptr() == kernel_out.data_ptr()
    assert merged.is_contiguous()
    assert [name for name, _ in launches] == ["fwd", "bwd_dkdv", "bwd_dq"]
    for _, backward_tensors in launches[1:]:
        assert backward_tensors[0].untyped_storage().data_ptr() == storage

    def reference_call(dtype_ref):
        packed_ref = packed.detach().cpu().to(dtype_ref).requires_grad_()
        parts = packed_ref.split(embed, dim=-1)
        out_ref, lse_ref = fused_attn.split_heads_attention(*parts, heads, is_causal=True,
                                                            batch_first=batch_first, return_lse=True,
                                                            backend="reference")
        (grad_ref,) = torch.autograd.grad(out_ref, packed_ref, grad_merged.cpu().to(dtype_ref))
        return testing.Results(out_ref.detach(), lse_ref.detach(), grad_ref)

    testing.assert_close_to_reference(testing.Results(merged, lse, grad_packed),
                                      reference_call(torch.float64), reference_call(dtype), dtype)


def test_bf16_remedy_is_exercised(bf16_dot_remedy, generator):
    if HAS_CUDA:
        pytest.skip("compiled kernels compute bf16 dots on the GPU; no remedy involved")
    case = CASES["causal"]
    before, casts_before = bf16_dot_remedy["bf16_dots"], bf16_dot_remedy["bf16_casts"]
    inputs = make_inputs(case, torch.bfloat16, 0, generator)
    with tk.forced_configs(**SMALL_TILES):
        results = run_backend(inputs, "contiguous")
    testing.check_inputs(results, inputs)
    # Forward: 2 dots per visited key block; backward: 3 per dK/dV step and 2 per dQ step; every
    # step rounds P or dS to bf16.
    assert bf16_dot_remedy["bf16_dots"] - before >= 2 * 3
    assert bf16_dot_remedy["bf16_casts"] - casts_before >= 3


def test_bf16_without_remedy_is_wrong_in_the_interpreter(bf16_dot_remedy, generator):
    """Shows the remedy is needed: the unpatched interpreter's bf16 dot breaks the forward."""
    if HAS_CUDA:
        pytest.skip("interpreter only")
    from triton.runtime import interpreter

    case = CASES["plain"]
    inputs = make_inputs(case, torch.bfloat16, 0, generator)
    patched = interpreter.InterpreterBuilder.create_dot
    try:
        interpreter.InterpreterBuilder.create_dot = bf16_dot_remedy["create_dot"]
        out = torch.full((*inputs.query.shape[:3], inputs.value.shape[3]), float("nan"), dtype=torch.bfloat16)
        BACKEND.forward(inputs.query, inputs.key, inputs.value, None, None, False, case.softmax_scale, out)
    finally:
        interpreter.InterpreterBuilder.create_dot = patched
    exact = testing.reference_results(inputs.query, inputs.key, inputs.value, dtype=torch.float64)
    error = testing.max_error(out, exact.out)
    if error < 0.1:
        pytest.skip(f"this Triton's interpreter computes bf16 dots right (error {error:.1e}); "
                    "the remedy is no longer needed")
    assert not error < 0.1


def test_bf16_conversion_without_remedy_truncates_in_the_interpreter(bf16_dot_remedy):
    """1 + 3 * 2^-9 lies nearer 1 + 2^-7 than 1 among bf16 values: the GPU rounds up, the unpatched
    interpreter truncates to 1, the remedy rounds up."""
    if HAS_CUDA:
        pytest.skip("interpreter only")
    from triton.runtime import interpreter

    value = interpreter.TensorHandle(np.array([1 + 3 * 2.0 ** -9], dtype=np.float32), tl.float32)
    builder = interpreter.interpreter_builder

    def converted(cast_impl):
        bits = cast_impl(builder, value, tl.bfloat16).data.astype(np.uint16)
        return float(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)[0])

    assert converted(interpreter.InterpreterBuilder.cast_impl) == 1 + 2.0 ** -7  # the remedy
    unpatched = converted(bf16_dot_remedy["cast_impl"])
    if unpatched == 1 + 2.0 ** -7:
        pytest.skip("this Triton's interpreter rounds fp32 -> bf16 to nearest; the remedy is no longer needed")
    assert unpatched == 1.0


# ---------------------------------------------------------------------------------------------------
# Attention sinks (fused_attn.scores): folded into the forward's log-sum-exp, once per row
# ---------------------------------------------------------------------------------------------------

def sink_inputs(case: Case, dtype, rotation: int, generator) -> testing.Inputs:
    """`make_inputs` of the case with sinks, large enough to matter: testing's (randn * 2, head 0 raised),
    head 0's set to 9 (its rows' weights go mostly to the sink: their lse without it is near log L_k) and, in
    a case with hidden rows, the last head's to -inf (no sink: those rows keep lse -inf)."""
    inputs = make_inputs(dataclasses.replace(case, sinks=True), dtype, rotation, generator)
    inputs.sinks[0] = 9.0
    if case.hidden_rows and case.heads_q > 1:
        inputs.sinks[-1] = float("-inf")
    return inputs


def check_sinks(results: testing.Results, inputs: testing.Inputs) -> None:
    """`testing.check_inputs` (the sinks' gradient included), no NaN anywhere, and the head whose sink
    dominates: the sink takes most of its rows' weight."""
    testing.check_inputs(results, inputs)
    assert results.grad_sinks is not None
    for name, value in results.named().items():
        assert not torch.isnan(value.detach().cpu()).any(), name
    lse, sinks = results.lse.detach().cpu(), inputs.sinks.cpu()
    seen = lse[:, 0] != sinks[0]  # head 0's rows that see keys (a row that sees none has lse = the sink)
    assert (torch.exp(sinks[0] - lse[:, 0][seen]) > 0.5).all()


# Sinks with every feature of the long-query kernels: causal both ways, windows, softcap, ALiBi, bool and
# additive masks, key padding, dropout, learned biases, GQA, rows that see no key (testing.SINK_CASES, which
# every backend runs, and more); the decode cases there run the split-KV kernels.
SINK_CASES = {
    **testing.SINK_CASES,
    "sinks_top_left_causal_gqa": Case(heads_q=4, heads_kv=2, is_causal=True, lse_grad=True),
    "sinks_bottom_right_hides_rows": Case(len_q=50, len_k=19, is_causal=True, causal_alignment="bottom_right",
                                          hidden_rows=True, dim_qk=24, dim_v=8),
    "sinks_bool_mask_padding_hidden_rows": Case(hidden_rows=True, mask="bool", is_causal=True, key_padding=True),
    "sinks_everything": VARIANT_CASES["everything"],
}
# Each case once per dtype, small tiles for fp32 and bf16 (rotations 0 and 2), the default ones for fp16.
SINK_RUNS = [pytest.param(dtype, rotation, id=f"{dtype_id}-{rotation}")
             for dtype, dtype_id, rotation in zip(DTYPES, DTYPE_IDS, (1, 2, 0))]


@pytest.mark.parametrize("dtype,rotation", SINK_RUNS)
@pytest.mark.parametrize("name", list(SINK_CASES))
def test_sinks_match_reference(name, dtype, rotation, generator):
    inputs = sink_inputs(SINK_CASES[name], dtype, rotation, generator)
    with tk.forced_configs(**_tiles(rotation)):
        results = run_backend(inputs)
    check_sinks(results, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["few_queries_bottom_right_window", "queries_over_keys_masks",
                                  "bool_mask_mqa_odd_dims"])
def test_sinks_in_decode_kernels_fold_once(name, dtype, generator, monkeypatch):
    """The split-KV forward, in three splits (some empty under the window or the masks): the sink joins in
    the combine, once per row; the backward runs the long-query kernels on its lse. (One query with GQA:
    testing.SINK_CASES's decode case, in the splits of the problem.)"""
    from fused_attn.backends import triton_decode

    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "3")
    inputs = sink_inputs(DECODE_CASES[name], dtype, 3, generator)
    assert triton_decode.takes(inputs.query, inputs.key, inputs.value, None)
    combines = []
    combine = triton_decode.combine_args

    def recording(*args):
        args, constexprs = combine(*args)
        combines.append(constexprs["HAS_SINKS"])
        return args, constexprs

    monkeypatch.setattr(triton_decode, "combine_args", recording)
    results = run_backend(inputs)
    assert combines == [True]
    check_sinks(results, inputs)


def test_sinks_of_minus_inf_are_no_sinks(generator):
    """A sink of -inf on every head gives the results of the call without sinks, bit for bit (rows that see
    no key keep output 0 and lse -inf, no NaN), in the long-query and the decode kernels."""
    for case in (Case(hidden_rows=True, mask="bool", key_padding=True, len_q=20, len_k=30),
                 Case(hidden_rows=True, mask="additive", mask_shape="batch", len_q=3, len_k=70)):
        inputs = sink_inputs(case, torch.float32, 0, generator)
        inputs.sinks.fill_(float("-inf"))
        with tk.forced_configs(**SMALL_TILES):
            with_sinks, plain = run_backend(inputs), run_backend(dataclasses.replace(inputs, sinks=None))
        for name, value in plain.named().items():
            assert torch.equal(getattr(with_sinks, name), value), name
        assert torch.isinf(plain.lse).any()
        assert torch.equal(with_sinks.grad_sinks, torch.zeros_like(inputs.sinks))


def _packed_sequences(generator, dtype, lengths_q, lengths_k, heads_q, heads_kv, dim):
    """Packed (total, H, D) query, key, value and grad_out (key and grad_out slices of wider tensors) and the
    cumulative lengths."""
    def cumulative(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)

    def draw(total, heads, sliced):
        values = torch.randn(total, heads, dim, generator=generator).to(dtype).to(DEVICE)
        if not sliced:
            return values
        wide = torch.full((total, heads, dim + 3), float("nan"), dtype=dtype, device=DEVICE)
        wide[..., 2:2 + dim] = values
        return wide[..., 2:2 + dim]

    total_q, total_k = sum(lengths_q), sum(lengths_k)
    return (draw(total_q, heads_q, False), draw(total_k, heads_kv, True), draw(total_k, heads_kv, False),
            draw(total_q, heads_q, True), cumulative(lengths_q), cumulative(lengths_k))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sinks_in_packed_batches(dtype, generator):
    """`forward_varlen` / `backward_varlen` with sinks (one launch per kernel for the batch; fused_attn.varlen
    does not pass sinks yet): against the reference backend's varlen path in float64 and in the dtype, the
    sinks' gradient from each one's results. Sequences without queries, without keys (their rows: output 0,
    lse the sink) and with more queries than keys (bottom-right: rows that see none)."""
    lengths_q, lengths_k, heads_q, heads_kv, dim = (5, 0, 33, 9, 12), (17, 4, 21, 0, 30), 4, 2, 16
    oracle = ReferenceBackend()
    query, key, value, grad_out, cu_q, cu_k = _packed_sequences(generator, dtype, lengths_q, lengths_k, heads_q,
                                                                heads_kv, dim)
    grad_lse = torch.randn(sum(lengths_q), heads_q, generator=generator).to(DEVICE).t()
    sinks = torch.randn(heads_q, generator=generator) * 2
    sinks[0] = 9.0
    slopes = torch.rand(len(lengths_q), heads_q, generator=generator)
    variant = ScoreVariant(bottom_right=True, window_left=11, window_right=2, softcap=3.0,
                           alibi_slopes=slopes.to(DEVICE), sinks=sinks.to(DEVICE))

    def run(backend, dtype_run, device):
        q, k, v, g = (t.detach().to(device, dtype_run) for t in (query, key, value, grad_out))
        g_lse = grad_lse.to(device, lse_dtype(dtype_run))
        run_variant = dataclasses.replace(variant, alibi_slopes=variant.alibi_slopes.to(device),
                                          sinks=variant.sinks.to(device))
        bounds = (cu_q.to(device), cu_k.to(device), max(lengths_q), max(lengths_k))
        out = torch.full((q.shape[0], heads_q, dim), float("nan"), dtype=dtype_run, device=device)
        lse = torch.full((heads_q, q.shape[0]), float("nan"), dtype=lse_dtype(dtype_run), device=device)
        backend.forward_varlen(q, k, v, *bounds, True, 0.3, out, lse, None, run_variant)
        grads = backend.backward_varlen(q, k, v, *bounds, True, 0.3, out, lse, g, g_lse, None, run_variant)
        grad_sinks = sink_gradient(run_variant.sinks, lse, out.transpose(0, 1), g.transpose(0, 1), g_lse,
                                   heads_dim=0)
        return testing.Results(out, lse, *grads, grad_sinks=grad_sinks)

    with tk.forced_configs(**SMALL_TILES):
        actual = run(BACKEND, dtype, DEVICE)
    exact = run(oracle, torch.float64, "cpu")
    testing.assert_close_to_reference(actual, exact, run(oracle, dtype, "cpu"), dtype)
    hidden = exact.lse == sinks.double()[:, None]
    assert hidden.any() and (actual.out.cpu().transpose(0, 1)[hidden] == 0).all()
    assert (actual.lse.cpu()[hidden] == sinks[:, None].expand_as(hidden)[hidden]).all()


@pytest.mark.parametrize("len_q", [3, 20], ids=["decode", "long_query"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sinks_in_paged_caches(len_q, dtype, generator, monkeypatch):
    """`forward_paged` with sinks through a shuffled block table (fused_attn.kvcache does not pass sinks
    yet), by the decode kernels (L_q = 3, three splits) and the long-query one (L_q = 20): against the
    reference backend on the gathered blocks; an empty cache's rows get output 0 and lse the sink."""
    from fused_attn.backends import triton_decode

    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "3")
    batch, heads_q, heads_kv, dim, block_size, max_blocks = 3, 4, 2, 16, 5, 9
    num_blocks = batch * max_blocks + 4
    query = torch.randn(batch, heads_q, len_q, dim, generator=generator).to(dtype).to(DEVICE)
    k_blocks, v_blocks = (torch.randn(num_blocks, block_size, heads_kv, dim, generator=generator).to(dtype).to(DEVICE)
                          for _ in range(2))
    table = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks].view(batch, max_blocks).int()
    lengths = torch.tensor([0, 23, max_blocks * block_size])
    padding = torch.arange(max_blocks * block_size)[None, :] >= lengths[:, None]
    sinks = torch.randn(heads_q, generator=generator) * 2
    sinks[0] = 9.0
    variant = ScoreVariant(softcap=4.0, alibi_slopes=torch.rand(batch, heads_q, generator=generator), sinks=sinks)
    blocks = tk.block_major(k_blocks)
    assert triton_decode.takes(query, blocks, blocks, None, max_blocks * block_size) == (len_q == 3)

    def run(backend, dtype_run, device):
        out = torch.full((batch, heads_q, len_q, dim), float("nan"), dtype=dtype_run, device=device)
        run_variant = dataclasses.replace(variant, alibi_slopes=variant.alibi_slopes.to(device),
                                          sinks=variant.sinks.to(device))
        lse = backend.forward_paged(*(t.to(device, dtype_run) for t in (query, k_blocks, v_blocks)), table.to(device),
                                    None, padding.to(device), False, 0.25, out, run_variant)
        return testing.Results(out, lse)

    with tk.forced_configs(**SMALL_TILES):
        actual = run(BACKEND, dtype, DEVICE)
    testing.assert_close_to_reference(actual, run(ReferenceBackend(), torch.float64, "cpu"),
                                      run(ReferenceBackend(), dtype, "cpu"), dtype)
    assert (actual.out[0] == 0).all()
    assert (actual.lse[0].cpu() == sinks[:, None].expand(heads_q, len_q)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_public_varlen_and_kvcache_take_sinks(dtype, generator):
    """`attention_varlen` (sinks requiring grad) and a paged `attention_with_kvcache` with sinks, backend
    "triton" against "reference" in float64 and in the dtype by the criterion."""
    # attention_varlen: the sinks' gradient through its autograd (sequences without keys: the test above).
    lengths_q, lengths_k, heads_q, heads_kv, dim = (7, 0, 26), (19, 5, 11), 4, 2, 16
    query, key, value, grad_out, cu_q, cu_k = _packed_sequences(generator, dtype, lengths_q, lengths_k, heads_q,
                                                                heads_kv, dim)
    sinks = torch.randn(heads_q, generator=generator) * 2
    sinks[0] = 9.0

    def varlen(backend, dtype_run, device):
        q, k, v = (t.detach().to(device, dtype_run).requires_grad_() for t in (query, key, value))
        s = sinks.to(device, lse_dtype(dtype_run)).requires_grad_()
        out, lse = fused_attn.attention_varlen(q, k, v, cu_q.to(device), cu_k.to(device), is_causal=True,
                                               causal_alignment="bottom_right", window_size=(8, -1), sinks=s,
                                               return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v, s), grad_out.to(device, dtype_run))
        return testing.Results(out.detach(), lse.detach(), *grads[:3], grad_sinks=grads[3])

    with tk.forced_configs(**SMALL_TILES):
        actual = varlen("triton", dtype, DEVICE)
    testing.assert_close_to_reference(actual, varlen("reference", torch.float64, "cpu"),
                                      varlen("reference", dtype, "cpu"), dtype)

    # A paged cache, two queries per sequence (the decode kernels), one sequence empty before the call.
    batch, block_size, max_blocks = 3, 4, 6
    k_blocks, v_blocks = (torch.randn(batch * max_blocks, block_size, heads_kv, dim, generator=generator).to(dtype)
                          for _ in range(2))
    table = torch.randperm(batch * max_blocks, generator=generator).view(batch, max_blocks).int()
    lengths = torch.tensor([0, 9, 22], dtype=torch.int32)
    q = torch.randn(batch, heads_q, 2, dim, generator=generator).to(dtype)
    new_k, new_v = (torch.randn(batch, heads_kv, 2, dim, generator=generator).to(dtype) for _ in range(2))

    def kvcache(backend, dtype_run, device):
        blocks = [t.to(device, dtype_run).clone() for t in (k_blocks, v_blocks)]
        out, lse = fused_attn.attention_with_kvcache(
            q.to(device, dtype_run), *blocks, new_k.to(device, dtype_run), new_v.to(device, dtype_run),
            cache_seqlens=lengths.to(device), block_table=table.to(device), softcap=3.0,
            sinks=sinks.to(device, lse_dtype(dtype_run)), return_lse=True, backend=backend)
        return testing.Results(out, lse)

    actual = kvcache("triton", dtype, DEVICE)
    testing.assert_close_to_reference(actual, kvcache("reference", torch.float64, "cpu"),
                                      kvcache("reference", dtype, "cpu"), dtype)


PUBLIC_SINK_CASES = {
    "long_query": SINK_CASES["sinks_top_left_causal_gqa"],
    "decode": Case(len_q=1, len_k=90, heads_q=4, heads_kv=2, key_padding=True, lse_grad=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(PUBLIC_SINK_CASES))
def test_public_attention_sinks_require_grad(name, dtype, generator):
    """fused_attn.attention(..., sinks=s, backend="triton") with s requiring grad: the registered ops and
    their autograd give the sinks' gradient beside dq, dk, dv (the decode case runs the split-KV forward)."""
    inputs = sink_inputs(PUBLIC_SINK_CASES[name], dtype, 2, generator)
    with tk.forced_configs(**SMALL_TILES):
        results = testing.run_attention(inputs, "triton")
    check_sinks(results, inputs)


# ---------------------------------------------------------------------------------------------------
# 8-bit key/value caches (fused_attn.quantization), read in place by forward_paged
# ---------------------------------------------------------------------------------------------------

CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def random_8bit(shape, dtype8, generator) -> torch.Tensor:
    """8-bit values of every kind: int8 -127 .. 127; float8_e4m3fn every bit pattern but NaN's (zeros of both signs,
    subnormals, +-448)."""
    if dtype8 == torch.int8:
        return torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    bits = torch.randint(0, 254, shape, generator=generator)
    return (bits + (bits >= 0x7F).long()).to(torch.uint8).view(torch.float8_e4m3fn)  # skips 0x7F and 0xFF


def poison_8bit(cache: torch.Tensor, where: torch.Tensor) -> None:
    """Fills the (block, row) entries `where` of 8-bit cache blocks, which no call may read, with NaN, or for int8
    (no NaN) -128, which no quantized value is."""
    if cache.dtype == torch.int8:
        cache[where] = -128
    else:
        cache.view(torch.uint8)[where] = 0x7F


@dataclasses.dataclass(frozen=True)
class QuantizedCase:
    """A paged 8-bit cache of three sequences: empty, ending inside a block, filling every block of its row."""

    len_q: int
    block_size: int
    max_blocks: int
    cache: str  # a key of CACHE_DTYPES
    layout: str  # "sequence": scales (B, H_kv); "token": (num_blocks, block_size, H_kv)
    heads_q: int = 2
    heads_kv: int = 2
    dim: int = 16
    dim_v: int = 16
    bottom_right_window: tuple[int, int] | None = None  # (left, right), bottom-right aligned
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    mask: bool = False  # a boolean (B, 1, L_q, L_k) mask, as attention_with_kvcache passes windows


QUANTIZED_CASES = {
    "decode_int8_tokens_gqa_softcap_block16": QuantizedCase(1, 16, 4, "int8", "token", heads_q=4, softcap=3.0),
    "decode_fp8_sequences_alibi_sinks_block1": QuantizedCase(3, 1, 37, "fp8", "sequence", heads_kv=1,
                                                             bottom_right_window=(-1, 0), alibi=True, sinks=True),
    "decode_fp8_tokens_window_mask_block5": QuantizedCase(2, 5, 9, "fp8", "token", heads_q=3, heads_kv=3,
                                                          bottom_right_window=(7, 0), mask=True),
    "decode_int8_sequences_mqa_dv_block7": QuantizedCase(4, 7, 6, "int8", "sequence", heads_q=4, heads_kv=1,
                                                         dim_v=24, softcap=2.0),
    "long_int8_tokens_window_gqa_block5": QuantizedCase(20, 5, 10, "int8", "token", heads_q=4,
                                                        bottom_right_window=(9, 0)),
    "long_fp8_tokens_alibi_sinks_block16": QuantizedCase(18, 16, 3, "fp8", "token", bottom_right_window=(-1, 0),
                                                         alibi=True, sinks=True, dim=20),
    "long_fp8_sequences_softcap_mask_block1": QuantizedCase(17, 1, 45, "fp8", "sequence", softcap=2.5, mask=True),
    "long_int8_sequences_dv_block3": QuantizedCase(20, 3, 14, "int8", "sequence", heads_q=4, heads_kv=1, dim_v=8),
}


def quantized_cache(case: QuantizedCase, generator):
    """(query (fp32), k_blocks, v_blocks, table, key_padding_mask, mask, variant, k_scale, v_scale): the blocks and
    per-token scales hold NaN (int8: -128) past each sequence's end and in the blocks the table does not name,
    whose unused entries name no block; the scales have strides of their own (per sequence: the empty sequence's
    is NaN)."""
    batch, dtype8 = 3, CACHE_DTYPES[case.cache]
    len_k = case.max_blocks * case.block_size
    num_blocks = batch * case.max_blocks + 3
    lengths = torch.tensor([0, len_k - case.block_size - 2 if case.block_size > 2 else len_k // 2, len_k])
    # Block 0, where a masked lookup of the table lands, is never named: poisoned, as is what it reads of the scales.
    table = (torch.randperm(num_blocks - 1, generator=generator)[:batch * case.max_blocks] + 1).view(batch, -1).int()
    used = torch.arange(case.max_blocks)[None, :] * case.block_size < lengths[:, None]
    blocks = [random_8bit((num_blocks, case.block_size, case.heads_kv, dim), dtype8, generator)
              for dim in (case.dim, case.dim_v)]
    largest = quantization.LARGEST[dtype8]
    if case.layout == "token":  # (num_blocks, block_size, H_kv) views of (H_kv, num_blocks, 2 * block_size) buffers
        scales = [((torch.rand(case.heads_kv, num_blocks, 2 * case.block_size, generator=generator) + 0.5) / largest)
                  [:, :, ::2].permute(1, 2, 0) for _ in range(2)]
    else:  # (B, H_kv) views of (H_kv, B) buffers
        scales = [((torch.rand(case.heads_kv, batch, generator=generator) + 0.5) / largest).t() for _ in range(2)]
        for scale in scales:
            scale[0] = float("nan")
    key_index = torch.arange(len_k)
    stored = key_index[None, :] < lengths[:, None]
    holds = torch.zeros(num_blocks, case.block_size, dtype=torch.bool)  # (block, row) holding a sequence's key
    rows = (key_index % case.block_size).expand(batch, -1)
    holds[table.long()[:, key_index // case.block_size][stored], rows[stored]] = True
    for cache in blocks:
        poison_8bit(cache, ~holds)
    if case.layout == "token":
        for scale in scales:
            scale[~holds] = float("nan")
    table = table.masked_fill(~used, num_blocks + 1000)
    padding = ~stored
    query = torch.randn(batch, case.heads_q, case.len_q, case.dim, generator=generator)
    mask = None
    if case.mask:
        mask = (torch.rand(batch, 1, case.len_q, len_k, generator=generator) > 0.2).expand(-1, case.heads_q, -1, -1)
    left, right = case.bottom_right_window or (-1, -1)
    variant = ScoreVariant(bottom_right=case.bottom_right_window is not None, window_left=left, window_right=right,
                           softcap=case.softcap,
                           alibi_slopes=torch.rand(batch, case.heads_q, generator=generator) if case.alibi else None,
                           sinks=torch.randn(case.heads_q, generator=generator) * 2 if case.sinks else None)
    return query, *blocks, table, padding, mask, variant, *scales


def run_quantized(backend, inputs, dtype, device) -> testing.Results:
    """`forward_paged` of `quantized_cache`'s inputs with the query in `dtype` on `device`; NaN-filled output."""
    query, k_blocks, v_blocks, table, padding, mask, variant, k_scale, v_scale = inputs
    batch, heads_q, len_q, _ = query.shape
    out = torch.full((batch, heads_q, len_q, v_blocks.shape[3]), float("nan"), dtype=dtype, device=device)
    variant = dataclasses.replace(variant, **{name: tensor.to(device) for name in ("alibi_slopes", "sinks")
                                              if (tensor := getattr(variant, name)) is not None})
    lse = backend.forward_paged(query.to(device, dtype), k_blocks.to(device), v_blocks.to(device), table.to(device),
                                None if mask is None else mask.to(device), padding.to(device), False, 0.3, out, variant,
                                k_scale.to(device), v_scale.to(device))
    return testing.Results(out, lse)


def check_quantized(inputs, dtype) -> testing.Results:
    """The kernels against the reference backend on the dequantized cache (its forward_paged), by the criterion; the
    empty sequence's rows give output 0 and lse -inf (with sinks: the sink)."""
    with tk.forced_configs(**SMALL_TILES):
        actual = run_quantized(BACKEND, inputs, dtype, DEVICE)
    oracle = ReferenceBackend()
    testing.assert_close_to_reference(actual, run_quantized(oracle, inputs, torch.float64, "cpu"),
                                      run_quantized(oracle, inputs, dtype, "cpu"), dtype)
    sinks = inputs[6].sinks
    assert (actual.out[0] == 0).all()
    assert (actual.lse[0].cpu() == (float("-inf") if sinks is None else sinks[:, None])).all()
    return actual


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(QUANTIZED_CASES))
def test_quantized_paged_caches_match_reference(name, dtype, generator, monkeypatch):
    """forward_paged over int8 and float8_e4m3fn blocks with per-sequence and per-token scales, by the decode
    kernels (L_q <= 16, three splits) and the long-query forward (small tiles): the blocks are read in place,
    dequantized where they are loaded, against the reference on the dequantized cache; what lies past each
    sequence's end, in blocks no table entry names, or behind table entries that name no block (NaN values and
    scales) is never read."""
    from fused_attn.backends import triton_decode

    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "3")
    case = QUANTIZED_CASES[name]
    inputs = quantized_cache(case, generator)
    keys = tk.cache_blocks(inputs[1], False)
    assert triton_decode.takes(inputs[0], keys, keys, None, case.max_blocks * case.block_size) == \
        name.startswith("decode")
    check_quantized(inputs, dtype)


@pytest.mark.parametrize("layout", ["sequence", "token"])
def test_fp8_caches_read_as_their_type(layout, generator, monkeypatch):
    """Where the GPU has an fp8 type (sm_89 on), Triton converts float8_e4m3fn blocks itself: the same kernels
    with the blocks' own dtype (in the interpreter: its emulation of the conversion)."""
    monkeypatch.setattr(tk, "reads_fp8_type", lambda device: True)
    launched = []
    original = tk.cache_blocks
    monkeypatch.setattr(tk, "cache_blocks", lambda blocks, fp8_type: launched.append(original(blocks, fp8_type)) or
                        launched[-1])
    for len_q in (2, 17):  # decode, long-query
        case = QuantizedCase(len_q, 4, 10, "fp8", layout, heads_q=4, softcap=2.0)
        check_quantized(quantized_cache(case, generator), torch.float16)
    assert launched and all(blocks.dtype == torch.float8_e4m3fn for blocks in launched)


@triton.jit
def _converted(X, Y, N: tl.constexpr):
    """Y = X's 8-bit values as Y's dtype (`tk._cache_values` times the scale factor `tk._bits_factor`)."""
    offs = tl.arange(0, N)
    values = tk._cache_values(tl.load(X + offs), Y.dtype.element_ty) * tk._bits_factor(X)
    tl.store(Y + offs, values.to(Y.dtype.element_ty))


@pytest.mark.parametrize("fp8_type", [False, True], ids=["bits", "fp8_type"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_8bit_value_converts_exactly(dtype, fp8_type):
    """All 256 float8_e4m3fn bit patterns (NaN at 0x7F and 0xFF) and int8 values, as the kernels convert them,
    equal torch's conversion: exact in fp16, bf16 and fp32, subnormals included. (Triton's interpreter converts
    the fp8 type's NaN to +-480, where the GPU gives NaN: those two are left out there.)"""
    for values in (torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn),
                   torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)):
        out = torch.full((256,), 7.0, dtype=dtype, device=DEVICE)
        _converted[(1,)](tk.cache_blocks(values[None, :, None], fp8_type)[0, 0].to(DEVICE), out, N=256)
        out, expected = out.cpu(), values.to(dtype)
        if fp8_type and tk.interpreting() and values.dtype == torch.float8_e4m3fn:
            out, expected = out[~expected.isnan()], expected[~expected.isnan()]
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.nan_to_num(), expected.nan_to_num())


def test_quantized_cache_arguments_are_checked():
    """forward_paged refuses what the kernels cannot read: 8-bit blocks without scales of either layout, scales of
    another dtype or shape, scales with blocks of the query's dtype."""
    query = torch.randn(2, 2, 1, 8, device=DEVICE)
    blocks = torch.zeros(5, 4, 2, 8, dtype=torch.int8, device=DEVICE)
    table = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 2, 1, 8, device=DEVICE)

    def call(k_blocks, v_blocks, k_scale, v_scale):
        BACKEND.forward_paged(query, k_blocks, v_blocks, table, None, None, False, 0.5, out, k_scale=k_scale,
                              v_scale=v_scale)

    sequence, token = torch.ones(2, 2, device=DEVICE), torch.ones(5, 4, 2, device=DEVICE)
    call(blocks, blocks, sequence, sequence)
    call(blocks, blocks, token, token)
    for k_scale, v_scale in ((None, None), (sequence, token), (sequence.double(), sequence), (token, token[:, :3]),
                             (sequence, None)):
        with pytest.raises(ValueError, match="k_scale|v_scale"):
            call(blocks, blocks, k_scale, v_scale)
    with pytest.raises(TypeError, match="k_blocks, v_blocks"):
        call(blocks, blocks.view(torch.float8_e4m3fn), sequence, sequence)
    with pytest.raises(ValueError, match="scales are for an 8-bit cache"):
        call(blocks.float(), blocks.float(), sequence, sequence)
    assert BACKEND.reads_quantized_cache


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_public_kvcache_reads_8bit_caches(dtype, generator):
    """attention_with_kvcache with dense 8-bit caches and appends (quantized on the way in), backend "triton"
    against "reference" in float64 and in the dtype: int8 with per-token scales, two queries (decode kernels);
    float8_e4m3fn with per-sequence scales, seventeen queries (long-query kernels) and a window."""
    batch, heads_q, heads_kv, dim, capacity = 3, 4, 2, 16, 40
    lengths = torch.tensor([0, 9, 20], dtype=torch.int32)
    for dtype8, layout, len_new, window in ((torch.int8, "token", 2, None), (torch.float8_e4m3fn, "sequence", 17,
                                                                              (6, 0))):
        largest = quantization.LARGEST[dtype8]
        caches = [random_8bit((batch, heads_kv, capacity, dim), dtype8, generator) for _ in range(2)]
        if layout == "token":
            scales = [(torch.rand(batch, heads_kv, capacity, generator=generator) + 0.5) / largest for _ in range(2)]
        else:
            scales = [(torch.rand(batch, heads_kv, generator=generator) + 0.5) * 3 / largest for _ in range(2)]
        # In the dtype, then exactly in float64: every run quantizes the same new keys into the same bytes.
        query, new_k, new_v = (torch.randn(batch, heads, len_new, dim, generator=generator).to(dtype)
                               for heads in (heads_q, heads_kv, heads_kv))

        def run(backend, dtype_run, device):
            out, lse = fused_attn.attention_with_kvcache(
                query.to(device, dtype_run), *(c.clone().to(device) for c in caches), new_k.to(device, dtype_run),
                new_v.to(device, dtype_run), cache_seqlens=lengths.to(device),
                k_scale=scales[0].clone().to(device), v_scale=scales[1].clone().to(device), window_size=window,
                softcap=2.0, return_lse=True, backend=backend)
            return testing.Results(out, lse)

        with tk.forced_configs(**SMALL_TILES):
            actual = run("triton", dtype, DEVICE)
        testing.assert_close_to_reference(actual, run("reference", torch.float64, "cpu"),
                                          run("reference", dtype, "cpu"), dtype)


# ---------------------------------------------------------------------------------------------------
# Mask programs (fused_attn.masks): one tile state per block decides it (empty: skipped, full: nothing
# read per score, partial: its bits)
# ---------------------------------------------------------------------------------------------------

# Blocks of 32 and 64, different along queries and keys: several blocks per tile of the program, the keys
# of a block one or two words of a row's bits. The fp16 and bf16 defaults have blocks of the tile's 128 rows
# or keys (the forward and dQ: query rows; dK/dV: keys).
PROGRAM_TILES = dict(fwd=tk.KernelConfig(32, 64, 4, 1), bwd_dkdv=tk.KernelConfig(64, 32, 4, 1),
                     bwd_dq=tk.KernelConfig(32, 64, 4, 1))
# Keys in blocks of 16, as fp32's default dQ tiles at D = 128 have them: a block reads half a word of each row's bits.
HALF_WORD_TILES = dict(fwd=tk.KernelConfig(64, 16, 4, 1), bwd_dkdv=tk.KernelConfig(32, 16, 4, 1),
                       bwd_dq=tk.KernelConfig(64, 16, 4, 1))
# testing.PROGRAM_CASES: fp32 at PROGRAM_TILES, fp16 and bf16 at the default configs (bf16 at PROGRAM_TILES
# doubles the interpreter's time of the case with dropout).
PROGRAM_RUNS = [pytest.param(dtype, rotation, PROGRAM_TILES if dtype == torch.float32 else {},
                             id=f"{dtype_id}-{rotation}")
                for dtype, dtype_id, rotation in zip(DTYPES, DTYPE_IDS, (1, 3, 0))]
# The tests of chosen programs: fp32 at HALF_WORD_TILES, fp16 at the default configs.
PROGRAM_CHECKS = [pytest.param(torch.float32, 0, HALF_WORD_TILES, id="fp32-0-keys16"),
                  pytest.param(torch.float16, 1, {}, id="fp16-1-default"),
                  pytest.param(torch.float16, 0, HALF_WORD_TILES, id="fp16-0-keys16")]


def program_inputs(case: Case, mask_mod, dtype, rotation: int, generator) -> testing.Inputs:
    """`make_inputs` of the case with the program of `mask_mod`, shared by the batch rows and heads."""
    inputs = make_inputs(case, dtype, rotation, generator)
    return dataclasses.replace(inputs, program=masks.mask_program(mask_mod, None, None, case.len_q,
                                                                  case.len_k).to(DEVICE))


@pytest.mark.parametrize("dtype,rotation,tiles", PROGRAM_RUNS)
@pytest.mark.parametrize("name", list(testing.PROGRAM_CASES))
def test_mask_programs_match_reference(name, dtype, rotation, tiles, generator):
    """Every kind of program (documents, prefix LM, chunks, functions of the head) with the other features:
    GQA, dropout, key padding, softcap, ALiBi, windows, both alignments and an integer offset, sinks, rows
    that see no key; the case with three queries runs the long-query kernels (the decode kernels take no
    program)."""
    inputs = make_inputs(testing.PROGRAM_CASES[name], dtype, rotation, generator)
    with tk.forced_configs(**tiles):
        results = run_backend(inputs)
    testing.check_inputs(results, inputs)


def _seen_but_in_tile_1(b, h, q_idx, kv_idx):
    """No query of query tile 1 (rows 128 .. 255) sees a key; tile (2, 0) is full, the others partial."""
    pattern = ((q_idx + kv_idx) % 7 != 0) | ((q_idx >= 2 * masks.TILE) & (kv_idx < masks.TILE))
    return (q_idx // masks.TILE != 1) & pattern


@pytest.mark.parametrize("dtype,rotation,tiles", PROGRAM_CHECKS)
def test_program_query_tile_whose_tiles_are_all_empty(dtype, rotation, tiles, generator):
    """Its rows see no key: output 0, log-sum-exp -inf and dQ 0 (the forward and dQ loops visit no block), and
    dK, dV take nothing from them; the other rows as the reference."""
    case = Case(batch=2, heads_q=2, heads_kv=1, len_q=300, len_k=200, lse_grad=True)
    inputs = program_inputs(case, masks.mask_function(_seen_but_in_tile_1), dtype, rotation, generator)
    states = inputs.program.tiles[0, 0]
    assert (states[1] == masks.EMPTY).all() and states[2, 0] == masks.FULL and (states[0] >= 0).all()
    with tk.forced_configs(**tiles):
        results = run_backend(inputs)
    testing.check_inputs(results, inputs)
    rows = slice(masks.TILE, 2 * masks.TILE)
    assert (results.out[:, :, rows] == 0).all()
    assert (results.lse[:, :, rows] == float("-inf")).all()
    assert (results.grad_query[:, :, rows] == 0).all()


def test_full_program_is_no_program(generator):
    """A program of full tiles only changes nothing, bit for bit, with every other feature at work."""
    case = Case(batch=2, heads_q=4, heads_kv=2, len_q=150, len_k=270, is_causal=True,
                causal_alignment="bottom_right", window=(120, 0), softcap=3.0, alibi="heads", key_padding=True,
                dropout_p=0.2, lse_grad=True, sinks=True)
    inputs = program_inputs(case, masks.sliding_window(), torch.float32, 0, generator)
    assert inputs.program.counts() == {"empty": 0, "full": 2 * 3, "partial": 0}
    with tk.forced_configs(**PROGRAM_TILES):
        with_program = run_backend(inputs, "contiguous")
        without = run_backend(dataclasses.replace(inputs, program=None), "contiguous")
    testing.check_inputs(with_program, inputs)
    for name, value in with_program.named().items():
        assert torch.equal(value, getattr(without, name)), name


def _seen_but_in_tiles_1(b, h, q_idx, kv_idx):
    """Query tile 1 sees no key and key tile 1 is seen by no query; tiles (2, 0) and (2, 2) are full."""
    pattern = ((3 * q_idx + kv_idx) % 5 != 0) | (q_idx >= 2 * masks.TILE)
    return (q_idx // masks.TILE != 1) & (kv_idx // masks.TILE != 1) & pattern


@pytest.mark.parametrize("reads,dtype,rotation,tiles", reads_and_dtypes(PROGRAM_CHECKS))
def test_program_empty_tiles_are_never_read(reads, dtype, rotation, tiles, generator, monkeypatch):
    """Keys and values NaN in a key tile no query sees, queries and dO NaN in a query tile that sees no key:
    the results of clean ones. A block of an empty tile that were visited, even with every score hidden, would
    turn them into NaN (0 * NaN in P V, dS K, P^T dO and dP = dO V^T) in the forward, dQ and dK/dV alike."""
    case = Case(batch=1, heads_q=2, heads_kv=1, len_q=300, len_k=330, lse_grad=True)
    inputs = program_inputs(case, masks.mask_function(_seen_but_in_tiles_1), dtype, rotation, generator)
    variants = reading_through(reads, monkeypatch)
    if reads == "descriptors":
        inputs = in_descriptor_layouts(inputs, rotation)
    states = inputs.program.tiles[0, 0]
    assert (states[1] == masks.EMPTY).all() and (states[:, 1] == masks.EMPTY).all()
    expected = testing.reference_for(inputs, torch.float64), testing.reference_for(inputs, dtype)
    tile_1 = slice(masks.TILE, 2 * masks.TILE)
    with torch.no_grad():
        for tensor in (inputs.query, inputs.grad_out, inputs.key, inputs.value):
            tensor[:, :, tile_1] = float("nan")
    with tk.forced_configs(**tiles):
        results = run_backend(inputs)
    testing.assert_close_to_reference(results, *expected, dtype)
    assert (results.grad_key[:, :, tile_1] == 0).all() and (results.grad_value[:, :, tile_1] == 0).all()
    if reads == "descriptors":
        assert variants == {"fwd": [True], "bwd_dkdv": [True], "bwd_dq": [True]}


def test_public_attention_takes_a_program(generator):
    """fused_attn.attention(..., attn_mask=program, backend="triton"): the registered ops and their autograd."""
    inputs = make_inputs(testing.PROGRAM_CASES["program_prefix_lm_padding_softcap"], torch.float32, 2, generator)
    with tk.forced_configs(**PROGRAM_TILES):
        results = testing.run_attention(inputs, "triton")
    testing.check_inputs(results, inputs)


def _causal_program(query, key) -> ScoreVariant:
    """The variant of a call on (query, key) with a causal mask program, as `attention` makes it."""
    program = masks.mask_program(masks.causal(), None, None, query.shape[2], key.shape[2]).to(query.device)
    return masks.with_program(program, ScoreVariant(), False, query, key)[1]


def test_programs_skip_the_decode_kernels_and_are_refused_by_paged_caches():
    """The decode kernels decline a call with a program (the long-query kernels take it, at every L_q); a paged
    cache takes none (attention_with_kvcache passes none)."""
    from fused_attn.backends import triton_decode

    q, k, v = _small()
    variant = _causal_program(q, k)
    assert triton_decode.takes(q, k, v, None)
    assert not triton_decode.takes(q, k, v, None, variant=variant)
    with pytest.raises(ValueError, match="forward_paged takes no mask program"):
        BACKEND.forward_paged(q, k[0].transpose(0, 1), v[0].transpose(0, 1), torch.zeros(1, 1, dtype=torch.int32),
                              None, None, False, 1.0, q, variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_program_with_a_packed_batch_runs_one_sequence_at_a_time(dtype, generator, monkeypatch):
    """attention_varlen with a program (row b: causal documents of sequence b) runs each sequence through the
    long-query kernels with its row of the program (the varlen launch takes none): against the reference
    backend in float64 and in the dtype, forward and backward; a sequence without tokens among them."""
    from fused_attn.backends import packed

    lengths, heads_q, heads_kv, dim = (150, 0, 40), 4, 2, 16
    query, key, value, grad_out, cu_q, cu_k = _packed_sequences(generator, dtype, lengths, lengths, heads_q,
                                                                heads_kv, dim)
    ids = torch.randint(0, 4, (len(lengths), max(lengths)), generator=generator).sort(dim=1).values
    program = masks.mask_program(masks.documents(ids) & masks.causal(), len(lengths), None, max(lengths))
    per_sequence = []

    def recorded(name):
        run = getattr(packed, name)

        def call(*args):
            per_sequence.append(name)
            return run(*args)
        return call

    for name in ("forward", "backward"):
        monkeypatch.setattr(packed, name, recorded(name))

    def varlen(backend, dtype_run, device):
        q, k, v = (t.detach().to(device, dtype_run).requires_grad_() for t in (query, key, value))
        out, lse = fused_attn.attention_varlen(q, k, v, cu_q.to(device), cu_k.to(device), attn_mask=program.to(device),
                                               return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, (q, k, v), grad_out.to(device, dtype_run))
        return testing.Results(out.detach(), lse.detach(), *grads)

    with tk.forced_configs(**PROGRAM_TILES):
        actual = varlen("triton", dtype, DEVICE)
    assert per_sequence == ["forward", "backward"]  # (the reference's runs below come after)
    testing.assert_close_to_reference(actual, varlen("reference", torch.float64, "cpu"),
                                      varlen("reference", dtype, "cpu"), dtype)


def test_program_arguments_are_checked():
    q, k, _ = _small()
    lse = torch.empty(q.shape[:3], device=DEVICE)
    variant = _causal_program(q, k)
    tiles, bits = variant.block_tiles, variant.block_bits
    assert tk.program_args(variant, 1, 2, 5, 5, lse)[3] == dict(HAS_PROGRAM=True)
    for wrong in (tiles.long(), tiles[:, :1]):
        with pytest.raises(ValueError, match="block_tiles: expected an int32 tensor of shape"):
            tk.program_args(dataclasses.replace(variant, block_tiles=wrong), 1, 2, 5, 5, lse)
    for wrong in (None, torch.zeros(1, 128, 8, dtype=torch.int32, device=DEVICE)[:, :, ::2]):
        with pytest.raises(ValueError, match="block_bits: expected a contiguous int32 tensor"):
            tk.program_args(dataclasses.replace(variant, block_bits=wrong), 1, 2, 5, 5, lse)
    assert tk.program_args(ScoreVariant(), 1, 2, 5, 5, lse) == (lse, lse, (0, 0, 0, 0), dict(HAS_PROGRAM=False))


# ---------------------------------------------------------------------------------------------------
# Choice and refusals
# ---------------------------------------------------------------------------------------------------

def _small(dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 2, 5, 8, generator=g).to(dtype).to(device) for _ in range(3)]


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("rotation", [0, 1])  # small tiles, then the default ones
@pytest.mark.parametrize("path", ["long_query", "decode"])
@pytest.mark.parametrize("reads", ["pointers", pytest.param("descriptors", marks=needs_descriptors)])
def test_padded_keys_are_never_read(reads, path, rotation, poison, generator, monkeypatch):
    """No padded key is read, not even in the key block holding a span's first or last key: NaN or inf
    in K and V before and after each row's span (which starts and ends mid-block) change nothing in the
    forward (long-query or decode kernels, three splits), dK/dV or dQ. Through tensor descriptors too, which load
    whole blocks of rows, padding included, and zero the padded ones after the load."""
    from fused_attn.backends import triton_decode

    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "3")
    len_q, len_k = (19, 60) if path == "long_query" else (3, 200)
    assert triton_decode.takes(torch.empty(1, 2, len_q, 16), torch.empty(1, 1, len_k, 16),
                               torch.empty(1, 1, len_k, 16), None) == (path == "decode")
    variants = reading_through(reads, monkeypatch)
    laid_out = functools.partial(in_descriptor_layouts, rotation=rotation) if reads == "descriptors" else None
    dtype = torch.float32 if reads == "pointers" else DESCRIPTOR_DTYPES[0]
    with tk.forced_configs(**_tiles(rotation)):
        testing.check_padding_is_not_read(BACKEND, dtype, generator, device=DEVICE, poison=poison,
                                          len_q=len_q, len_k=len_k, laid_out=laid_out)
    if reads == "descriptors":
        forward = "decode" if path == "decode" else "fwd"
        assert variants == {forward: [True], "bwd_dkdv": [True], "bwd_dq": [True]}


def test_padding_spans():
    padding = torch.tensor([[1, 1, 0, 0, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0]], dtype=torch.bool)
    spans = tk.padding_spans(padding)
    assert spans.dtype == torch.int32
    assert spans.tolist() == [[2, 4], [0, 3], [5, 5], [0, 5]]
    assert tk.padding_spans(torch.ones(3, 0, dtype=torch.bool)).tolist() == [[0, 0]] * 3


def test_dropout_drops_the_mask_the_public_helper_gives(generator):
    """The public path: `testing.dropout_mask` before a call, then the call with the same generator,
    against attention written out with that mask."""
    q, k, v = (torch.randn(2, 3, 21, 16, generator=generator).to(DEVICE) for _ in range(3))
    state = torch.Generator(DEVICE).manual_seed(77)
    keep = testing.dropout_mask(0.4, 2, 3, 21, 21, device=DEVICE, generator=state)
    out = fused_attn.attention(q, k, v, dropout_p=0.4, is_causal=True, backend="triton", generator=state)
    weights = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(torch.ones(21, 21, dtype=torch.bool,
                            device=DEVICE).triu(1), float("-inf")), dim=-1)
    expected = (weights * keep / 0.6) @ v
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # The generator advanced: the next call drops other elements.
    assert not torch.equal(testing.dropout_mask(0.4, 2, 3, 21, 21, device=DEVICE, generator=state), keep)


def test_learned_bias_gradient_through_the_public_call(generator):
    """A (L_q, L_k) bias shared by batch and heads: its gradient is dS summed over both, as autograd
    gives it for the reference."""
    q, k, v = (torch.randn(2, 3, 9, 16, generator=generator).to(DEVICE).requires_grad_() for _ in range(3))
    bias = torch.randn(9, 9, generator=generator).to(DEVICE).requires_grad_()
    out = fused_attn.attention(q, k, v, attn_mask=bias, is_causal=True, backend="triton")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    expected_out = fused_attn.attention(q, k, v, attn_mask=bias, is_causal=True, backend="reference")
    expected = torch.autograd.grad(expected_out.square().sum(), (q, k, v, bias))
    assert grads[3].shape == bias.shape
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype, dim, reason", [
    (torch.float64, 8, "dtype torch.float64 is not supported"),
    (torch.float32, 300, "head dims up to 256, got 300"),
])
def test_explicit_request_refused_for_unsupported_problem(dtype, dim, reason):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 3, dim, generator=g).to(dtype).to(DEVICE) for _ in range(3))
    with pytest.raises(registry.BackendError, match=reason):
        fused_attn.attention(q, k, v, backend="triton")


def test_never_chosen_automatically_for_cpu_tensors():
    q, k, v = _small(device="cpu")
    problem = fused_attn.problem.Problem.of(q, k, v, None, None, False, 0.0)
    assert registry.choose(problem).name != "triton"
    if tk.interpreting():  # on request, the interpreter takes them; GPU-built kernels never do
        assert registry.choose(problem, "triton").name == "triton"
    else:
        with pytest.raises(registry.BackendError, match="TRITON_INTERPRET"):
            registry.choose(problem, "triton")


def test_cpu_tensors_refused_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _small(device="cpu")
    problem = fused_attn.problem.Problem.of(q, k, v, None, None, False, 0.0)
    assert any("TRITON_INTERPRET" in reason for reason in BACKEND.refusals(problem))


def test_cpu_tensors_refused_when_kernels_were_built_for_the_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tk, "interpreting", lambda: False)
    q, k, v = _small(device="cpu")
    problem = fused_attn.problem.Problem.of(q, k, v, None, None, False, 0.0)
    assert any("after the kernels were imported" in reason for reason in BACKEND.refusals(problem))


def test_empty_problems():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 8, generator=g).to(DEVICE).requires_grad_()
    k = torch.randn(1, 2, 0, 8, generator=g).to(DEVICE).requires_grad_()
    v = torch.randn(1, 2, 0, 8, generator=g).to(DEVICE).requires_grad_()
    out, lse = fused_attn.attention(q, k, v, return_lse=True, backend="triton")
    assert (out == 0).all() and (lse == float("-inf")).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert (grads[0] == 0).all() and grads[1].shape == k.shape


@pytest.mark.parametrize("allow_tf32, expected", [(False, "ieee"), (True, "tf32")])
def test_fp32_precision_follows_torch_allow_tf32(allow_tf32, expected):
    q, k, v = _small(torch.float32)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3])
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        _, constexprs = tk.forward_args(q, k, v, None, None, False, 0.5, out, lse)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert constexprs["PRECISION"] == expected
    _, constexprs = tk.forward_args(q.half(), k.half(), v.half(), None, None, False, 0.5, out.half(), lse)
    assert constexprs["PRECISION"] == "ieee"  # irrelevant for fp16: tensor cores with fp32 accumulation


# ---------------------------------------------------------------------------------------------------
# Larger problems: compiled on a GPU, or slow in the interpreter
# ---------------------------------------------------------------------------------------------------

LARGE_CASES = {
    "causal_gqa_d64": Case(batch=2, heads_q=8, heads_kv=2, len_q=300, len_k=300, dim_qk=64, is_causal=True),
    "mask_d128": Case(batch=1, heads_q=4, heads_kv=4, len_q=257, len_k=513, dim_qk=128, mask="additive",
                      mask_shape="batch", key_padding=True),
    "d256_dv96": Case(batch=1, heads_q=2, heads_kv=2, len_q=130, len_k=190, dim_qk=256, dim_v=96,
                      is_causal=True),
}


# Compiled on a GPU (one rotation of layouts), and slow in the interpreter (another rotation).
LARGE_RUNS = [pytest.param(1, marks=pytest.mark.cuda, id="gpu"),
              pytest.param(3, marks=pytest.mark.slow, id="interpreter")]


@pytest.mark.parametrize("rotation", LARGE_RUNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(LARGE_CASES))
def test_large_default_configs(name, dtype, rotation, generator):
    inputs = make_inputs(LARGE_CASES[name], dtype, rotation, generator)
    testing.check_inputs(run_backend(inputs), inputs)


# ---------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------

class _FakeCudaTensor:
    """What the autotuner's pruning looks at: a device and an element size."""

    device = torch.device("cuda", 0)

    def element_size(self):
        return 2


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkdv", "bwd_dq"])
@pytest.mark.parametrize("capability, shared", [((8, 0), 163 * 1024), ((9, 0), 227 * 1024),
                                                ((8, 6), 99 * 1024), ((7, 5), 64 * 1024)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_autotune_candidates_pruned_to_device_shared_memory(kernel, capability, shared, head_dim,
                                                            monkeypatch):
    monkeypatch.setattr(tk, "_device_limits", lambda index: (capability, shared))
    tuner = tk._autotuned(kernel)
    assert tuner.keys == tk.autotune_key(kernel)
    assert set(tk.autotune_key(kernel)) <= set(tk.KERNELS[kernel].arg_names)
    constexprs = dict(BLOCK_DQK=head_dim, BLOCK_DV=head_dim, D_QK=head_dim, D_V=head_dim)
    pruned = tuner.early_config_prune(tuner.configs, {"Q": _FakeCudaTensor()}, **constexprs)
    assert pruned
    chosen = [tk.KernelConfig(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
              for c in pruned]
    # The generation's default comes first when it fits; every candidate fits the device.
    default = tk.default_config(kernel, tk.arch_of(capability), head_dim, 2)
    if tk.shared_memory_estimate(kernel, default, head_dim, head_dim, 2) <= shared:
        assert chosen[0] == default
    for config in chosen[1:]:
        assert tk.shared_memory_estimate(kernel, config, head_dim, head_dim, 2) <= shared
    assert len(set(chosen)) == len(chosen)


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkdv", "bwd_dq"])
def test_blocks_of_a_launch_with_a_program_fit_its_tiles(kernel, monkeypatch):
    """Autotuning keeps only the candidates whose blocks lie inside one tile of a program."""
    monkeypatch.setattr(tk, "_device_limits", lambda index: ((9, 0), 227 * 1024))
    tuner = tk._autotuned(kernel)
    constexprs = dict(BLOCK_DQK=64, BLOCK_DV=64, D_QK=64, D_V=64)

    def largest_block(**program):
        pruned = tuner.early_config_prune(tuner.configs, {"Q": _FakeCudaTensor()}, **constexprs, **program)
        return max(max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in pruned)

    assert largest_block() > masks.TILE  # so the pruning below is what keeps them out
    assert largest_block(HAS_PROGRAM=True) <= masks.TILE


def test_forced_config_beyond_a_program_tile_is_refused():
    q, k, v = _small()
    with tk.forced_configs(fwd=tk.KernelConfig(256, 32, 4, 1)), pytest.raises(ValueError, match="larger than a mask"):
        BACKEND.forward(q, k, v, None, None, False, 1.0, torch.empty_like(q), None, _causal_program(q, k))


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkdv", "bwd_dq"])
def test_default_configs_fit_their_generation(kernel):
    for arch, limit in tk.SHARED_MEMORY_LIMIT.items():
        for head_dim in (16, 32, 64, 128, 256):
            for size in (2, 4):
                config = tk.default_config(kernel, arch, head_dim, size)
                assert tk.shared_memory_estimate(kernel, config, head_dim, head_dim, size) <= limit


def _launch_features(features) -> dict:
    """Constexprs of a launch with every one of a table entry's features (SCORES: a softcap)."""
    return {("SOFTCAP" if name == "SCORES" else name): True for name in features}


@pytest.mark.parametrize("table", ["_FLOAT32_DEFAULTS", "_BLACKWELL_DEFAULTS"])
def test_feature_tiles_are_reached_and_fit(table, monkeypatch):
    """Every entry of the feature-keyed tables is what a launch with its features gets on the newest Triton (no
    earlier entry of its key shadows it), on its generation and, for sm_90's fp32 entries, on sm_100's, and fits the
    device's shared memory (dropout's random bits counted)."""
    monkeypatch.setattr(tk.triton_compat, "older_than", lambda release: False)
    for key, entries in getattr(tk, table).items():
        kernel, *arch, dim = key
        size, archs = (4, [arch[0]] + ["sm_100"] * (arch[0] == "sm_90")) if arch else (2, ["sm_100"])
        for features, config in entries:
            constexprs = _launch_features(features)
            for target in archs:
                assert tk.default_config(kernel, target, dim, size, constexprs) == config, (key, features, target)
                estimate = tk.shared_memory_estimate(kernel, config, dim, dim, size, "HAS_DROPOUT" in features)
                assert estimate <= tk.SHARED_MEMORY_LIMIT[target], (key, features)



@pytest.mark.parametrize("table, size", [("_OLD_RELEASE_DEFAULTS", 2), ("_FLOAT32_OLD_RELEASE_DEFAULTS", 4)])
def test_old_release_tiles_are_reached_and_fit(table, size, monkeypatch):
    """On the release just before the one an entry names, the entry is what a launch with its features gets (no
    earlier entry of its key that holds on that release shadows it), on its generation and, for sm_90's, on sm_100
    where neither its own entries nor Blackwell's tiles come first, and fits the device's shared memory with dropout's
    random bits counted."""
    for (kernel, arch, dim), entries in getattr(tk, table).items():
        for features, (major, minor), config in entries:
            monkeypatch.setattr(tk.triton_compat, "older_than", lambda release: release > (major, minor - 1))
            constexprs = _launch_features(features)
            inherited = arch == "sm_90" and tk._old_release_default(kernel, "sm_100", dim, size, constexprs) is None \
                and (size > 2 or tk._blackwell_default(kernel, dim, constexprs) is None)
            for target in [arch] + ["sm_100"] * inherited:
                assert tk.default_config(kernel, target, dim, size, constexprs) == config, (table, kernel, target,
                                                                                           features)
                estimate = tk.shared_memory_estimate(kernel, config, dim, dim, size, "HAS_DROPOUT" in features)
                assert estimate <= tk.SHARED_MEMORY_LIMIT[target], (table, kernel, target, features)


def test_narrow_tiles_at_256_are_reached_and_fit():
    """Each feature set of _NARROW_AT_256 gives its launches the narrow tiles at head dim 256 (fp16/bf16, with a bias
    gradient too for dK/dV), and they fit the device's shared memory with dropout's random bits counted; a launch
    with none of the sets keeps other tiles."""
    for (kernel, arch), feature_sets in tk._NARROW_AT_256.items():
        narrow = tk._NARROW_TILES[kernel]
        for features in feature_sets:
            for grad in (False, True) if kernel == "bwd_dkdv" else (False,):
                constexprs = dict(_launch_features(features), HAS_MASK_GRAD=grad)
                assert tk.default_config(kernel, arch, 256, 2, constexprs) == narrow, (kernel, arch, features)
        assert tk.default_config(kernel, arch, 256, 2, {}) != narrow or kernel == "bwd_dkdv" and arch == "sm_90"
        estimate = tk.shared_memory_estimate(kernel, narrow, 256, 256, 2, dropout=True)
        assert estimate <= tk.SHARED_MEMORY_LIMIT[arch], (kernel, arch)

# ---------------------------------------------------------------------------------------------------
# The tensor-descriptor variants (DESCRIPTORS: the forward's Q, K, V and O, the backward's Q, K, V, dO, dQ, dK and
# dV through tl.make_tensor_descriptor, TMA on sm_90 and later), forced by FUSED_ATTN_TRITON_DESCRIPTORS=1 where a
# call's layouts allow it
# ---------------------------------------------------------------------------------------------------

# Layouts a descriptor reads: unit stride along D, the other strides multiples of 16 bytes when D's are.
DESCRIPTOR_LAYOUTS = ("contiguous", "heads_inner", "seq_first")
# Every case of the pointer kernels' tests (plain, score variants, sinks, mask programs; the decode cases too, with
# the decode kernels turned off), once per dtype: small tiles and the default ones alternate over the cases.
DESCRIPTOR_CASES = {**CASES, **VARIANT_CASES,
                    **{name: dataclasses.replace(case, sinks=True) for name, case in SINK_CASES.items()},
                    **testing.PROGRAM_CASES}
# fp16 and bf16, and one fp32 case, which the variants refuse (it runs on pointers: tk.FLOAT32_REFUSAL).
DESCRIPTOR_RUNS = [pytest.param(name, dtype, index % len(DESCRIPTOR_LAYOUTS), id=f"{name}-{dtype_id}")
                   for index, name in enumerate(DESCRIPTOR_CASES) for dtype, dtype_id in zip(DTYPES, DTYPE_IDS)
                   if dtype in DESCRIPTOR_DTYPES or index == 0]


def in_descriptor_layouts(inputs: testing.Inputs, rotation: int) -> testing.Inputs:
    """The inputs with q, k and v in three different DESCRIPTOR_LAYOUTS (rotated by `rotation`), the NaN-poisoned
    output in the first of them and grad_out in the second (masks and the rest as they were; the gradients are laid
    out as their inputs)."""
    layouts = [DESCRIPTOR_LAYOUTS[(rotation + i) % len(DESCRIPTOR_LAYOUTS)] for i in range(3)]
    query, key, value = (testing.strided(getattr(inputs, name), layout)
                         for name, layout in zip(("query", "key", "value"), layouts))
    out = testing.poisoned_output(query, inputs.case.value_dim, layouts[0])
    grad_out = testing.strided(inputs.grad_out, layouts[1])
    return dataclasses.replace(inputs, query=query, key=key, value=value, out=out, grad_out=grad_out)


def descriptor_inputs(case: Case, dtype, rotation: int, generator) -> testing.Inputs:
    """`make_inputs` `in_descriptor_layouts`."""
    return in_descriptor_layouts(make_inputs(case, dtype, rotation, generator), rotation)


def forward_tensors(inputs: testing.Inputs) -> dict:
    """What the forward reads and writes through descriptors, by name (`descriptor_refusals`)."""
    return dict(query=inputs.query, key=inputs.key, value=inputs.value, out=inputs.out)


def backward_tensors(inputs: testing.Inputs) -> dict:
    """What the dK/dV and dQ kernels read and write through descriptors, the gradients laid out as `new_gradient`
    (here `nan_filled_like`) lays them out."""
    grads = tuple(testing.nan_filled_like(t) for t in (inputs.query, inputs.key, inputs.value))
    return tk.backward_tensors(inputs.query, inputs.key, inputs.value, inputs.grad_out, grads)


class _Recording:
    """A kernel whose launches record one constexpr (DESCRIPTORS unless named) into `variants[name]`."""

    def __init__(self, name, kernel, variants, constexpr="DESCRIPTORS"):
        self.name, self.kernel, self.variants, self.constexpr = name, kernel, variants, constexpr

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.variants.setdefault(self.name, []).append(kwargs[self.constexpr])
            return self.kernel[grid](*args, **kwargs)
        return launch


def _recording_variants(monkeypatch, constexpr="DESCRIPTORS", decode=False) -> dict:
    """Records `constexpr` of every launch of the kernels that have the variants, by kernel: the long-query ones and,
    with `decode`, the split-KV decode kernel (as "decode")."""
    from fused_attn.backends import triton_decode

    # Launches at the default or forced configs: on a GPU an autotuner would launch the kernel it wrapped when it was
    # first built (it is cached), through its own `run`, never the recording.
    monkeypatch.setenv("FUSED_ATTN_TRITON_AUTOTUNE", "0")
    variants = {}
    for name in tk.DESCRIPTOR_KERNELS:
        monkeypatch.setitem(tk.KERNELS, name, _Recording(name, tk.KERNELS[name], variants, constexpr))
    if decode:
        monkeypatch.setattr(triton_decode, "_attn_decode",
                            _Recording("decode", triton_decode._attn_decode, variants, constexpr))
    return variants


class _NoKernel:
    """A kernel whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("kernel", [*tk.DESCRIPTOR_KERNELS, "decode"])
def test_recorded_kernels_launch_without_an_autotuner_on_a_gpu(kernel, monkeypatch):
    """What the recording tests see on a GPU, whose launches this one makes for a CUDA tensor (of a kernel that does
    nothing): the recorded kernel launched with the descriptor variant FUSED_ATTN_TRITON_DESCRIPTORS=1 forces, not
    through an autotuner."""
    from fused_attn.backends import triton_decode

    monkeypatch.setattr(tk, "interpreting", lambda: False)
    monkeypatch.setattr(tk, "_device_limits", lambda index: ((9, 0), 227 * 1024))

    def autotuned(*args, **kwargs):
        pytest.fail("launched through an autotuner")
    monkeypatch.setattr(tk, "_autotuned", autotuned)
    monkeypatch.setattr(triton_decode, "_autotuned_decode", autotuned)
    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, "1")
    if kernel == "decode":
        monkeypatch.setattr(triton_decode, "_attn_decode", _NoKernel())
        variants = _recording_variants(monkeypatch, decode=True)
        triton_decode._launch_decode((1,), (), {}, _FakeCudaTensor.device, descriptors=True)
    else:
        monkeypatch.setitem(tk.KERNELS, kernel, _NoKernel())
        variants = _recording_variants(monkeypatch)
        tk._launch(kernel, lambda m, n: 1, (), dict(BLOCK_DQK=64, BLOCK_DV=64), _FakeCudaTensor(), descriptors=True)
    assert variants == {kernel: [True]}


def _descriptor_tiles(case: Case, dtype, rotation: int) -> dict:
    """As the pointer kernels' tests: a mask program's tiles of 32 and 64 for fp16 (blocks smaller than a program's
    tile, as the forward's 128 x 16 at D = 256 on sm_90) and its default ones for bf16, else small tiles and the
    default ones alternately."""
    if case.program is not None:
        return PROGRAM_TILES if dtype == torch.float16 else {}
    return SMALL_TILES if rotation % 2 == 0 else {}


@pytest.mark.parametrize("name,dtype,rotation", DESCRIPTOR_RUNS)
def test_descriptor_kernels_match_reference(name, dtype, rotation, generator, monkeypatch):
    """The descriptor variants (forward, dK/dV, dQ) run wherever `descriptor_refusals` finds nothing (head dims
    whose rows are not multiples of 16 bytes keep pointers), and give what the reference gives, by the same
    criterion."""
    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, "1")
    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE", "0")
    case = DESCRIPTOR_CASES[name]
    inputs = descriptor_inputs(case, dtype, rotation, generator)
    forward = tk.descriptor_refusals(forward_tensors(inputs))
    backward = tk.descriptor_refusals(backward_tensors(inputs))
    variants = _recording_variants(monkeypatch)
    with tk.forced_configs(**_descriptor_tiles(case, dtype, rotation)):
        results = run_backend(inputs)
    assert variants == {"fwd": [not forward], "bwd_dkdv": [not backward], "bwd_dq": [not backward]}, (forward,
                                                                                                     backward)
    testing.check_inputs(results, inputs)


# The calls the warp-specialized variants are offered for (no score variant, padding, sinks, mask or program:
# triton_kernels.NOT_WARP_SPECIALIZED): plain, causal, grouped heads, dropout, unequal lengths and head dims.
WARP_SPECIALIZED_CASES = ("plain", "causal", "causal_short_queries", "gqa", "head_dim_40_dv_24", "dropout")


@needs_descriptors
@pytest.mark.parametrize("dtype", DESCRIPTOR_DTYPES, ids=DTYPE_IDS[:2])
@pytest.mark.parametrize("name", WARP_SPECIALIZED_CASES)
def test_warp_specialized_kernels_match_reference(name, dtype, generator, monkeypatch):
    """The forward, dK/dV and dQ kernels at configs with their loops warp-specialized (which the interpreter runs as
    written) give what the reference gives, by the same criterion, with the variant's constexpr in every launch."""
    case = CASES[name]
    inputs = descriptor_inputs(case, dtype, 0, generator)
    assert not tk.descriptor_refusals(forward_tensors(inputs)) and not tk.descriptor_refusals(backward_tensors(inputs))
    launched = _recording_variants(monkeypatch, "WARP_SPECIALIZE")
    forced = {kernel: dataclasses.replace(config, descriptors=True, warp_specialize=True)
              for kernel, config in SMALL_TILES.items()}
    with tk.forced_configs(**forced):
        results = run_backend(inputs)
    assert launched == {"fwd": [True], "bwd_dkdv": [True], "bwd_dq": [True]}
    testing.check_inputs(results, inputs)


# The decode cases the warp-specialized decode is offered for (triton_kernels.warp_specializable: no softcap, ALiBi,
# key padding or mask), and a causal one over a window.
WARP_SPECIALIZED_DECODE_CASES = {
    **{name: case for name, case in DECODE_CASES.items()
       if not (case.softcap or case.alibi or case.key_padding or case.mask)},
    "few_queries_causal_window_gqa": Case(len_q=4, len_k=600, heads_q=8, heads_kv=2, batch=1, is_causal=True,
                                          causal_alignment="bottom_right", window=(300, 0)),
}
DECODE_DESCRIPTOR_RUNS = [*(pytest.param(name, "descriptors", id=f"{name}-descriptors") for name in DECODE_CASES),
                          *(pytest.param(name, "warp_specialized", id=f"{name}-warp_specialized")
                            for name in WARP_SPECIALIZED_DECODE_CASES)]


@pytest.mark.parametrize("dtype", DESCRIPTOR_DTYPES, ids=DTYPE_IDS[:2])
@pytest.mark.parametrize("name,variant", DECODE_DESCRIPTOR_RUNS)
def test_descriptor_decode_matches_reference(name, variant, dtype, generator, monkeypatch):
    """The split-KV decode kernel reads a dense cache's K and V and writes each split's output through descriptors
    wherever `descriptor_refusals` finds nothing for them (three splits, so that a block reads keys of the next
    split), as FUSED_ATTN_TRITON_DESCRIPTORS=1 runs it, and forced with its key loop warp-specialized (which the
    interpreter runs as written), by the same criterion, with the variant's constexprs in every launch."""
    from fused_attn.backends import triton_decode

    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, "1")
    monkeypatch.setenv("FUSED_ATTN_TRITON_DECODE_SPLITS", "3")
    inputs = descriptor_inputs({**DECODE_CASES, **WARP_SPECIALIZED_DECODE_CASES}[name], dtype, 1, generator)
    assert triton_decode.takes(inputs.query, inputs.key, inputs.value, None)
    refusals = tk.descriptor_refusals(dict(key=inputs.key, value=inputs.value))
    descriptors = _recording_variants(monkeypatch, decode=True)
    specialized = _recording_variants(monkeypatch, "WARP_SPECIALIZE", decode=True)
    with triton_decode.forced_variant(variant) if variant != "descriptors" else contextlib.nullcontext():
        results = run_backend(inputs)
    assert descriptors["decode"] == [not refusals], refusals
    assert specialized["decode"] == [not refusals and variant == "warp_specialized"], refusals
    testing.check_inputs(results, inputs)


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_decode_autotune_offers_its_variants(mode, monkeypatch):
    """On sm_90 the decode kernel is tuned between pointers (not with FUSED_ATTN_TRITON_DESCRIPTORS=1), descriptors
    and, where Triton has it, descriptors with the key loop warp-specialized, offered as the forward's is: without
    score variants, padding or masks, and where its shared memory fits the device."""
    from fused_attn.backends import triton_decode

    monkeypatch.setattr(tk, "_device_limits", lambda index: ((9, 0), 227 * 1024))
    tuner = triton_decode._autotuned_decode(mode == "1")
    constexprs = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_DQK=128, BLOCK_DV=128)

    def offered(**features):
        configs = tuner.early_config_prune(tuner.configs, {"Q": _FakeCudaTensor()}, **constexprs, **features)
        return [name for name, switches in triton_decode.VARIANTS.items() if any(c.kwargs == switches for c in configs)]

    assert offered() == ["pointers"] * (mode == "auto") + ["descriptors"] + \
        ["warp_specialized"] * triton_compat.warp_specialization()
    for feature in dict(SOFTCAP=True), dict(HAS_ALIBI=True), dict(HAS_KPM=True), dict(MASK_KIND=1):
        assert "warp_specialized" not in offered(**feature), feature
    wide = dict(constexprs, BLOCK_DQK=256, BLOCK_DV=256)  # over tk.WARP_SPECIALIZED_MAX_HEAD_DIM (and the device)
    assert tk.warp_specializable(constexprs) and not tk.warp_specializable(wide)
    monkeypatch.setattr(tk, "_device_limits", lambda index: ((12, 0), 99 * 1024))  # its four stages do not fit
    assert "warp_specialized" not in offered()


@needs_descriptors
def test_descriptor_decode_serves_the_dense_cases(generator):
    """The decode matrix above runs the descriptor variant in every case, not the fallback."""
    for name, case in DECODE_CASES.items():
        inputs = descriptor_inputs(case, torch.float16, 1, generator)
        assert tk.descriptor_refusals(dict(key=inputs.key, value=inputs.value)) == [], name


@needs_descriptors
@pytest.mark.parametrize("tensors", [forward_tensors, backward_tensors], ids=["forward", "backward"])
def test_descriptor_variants_serve_most_cases(tensors, generator):
    """The matrix above runs the descriptor variants for most of its cases, not the fallback."""
    served = []
    for name, case in DESCRIPTOR_CASES.items():
        inputs = descriptor_inputs(case, torch.float16, 0, generator)
        if not tk.descriptor_refusals(tensors(inputs)):
            served.append(name)
    assert len(served) >= 0.8 * len(DESCRIPTOR_CASES), sorted(set(DESCRIPTOR_CASES) - set(served))


@needs_descriptors
def test_descriptor_refusals_name_each_reason(generator):
    q = torch.randn(2, 2, 40, 16, generator=generator).to(torch.float16).to(DEVICE)
    assert tk.descriptor_refusals(dict(query=q, key=q, value=q, out=q)) == []
    reversed_v = testing.strided(q, "reversed")
    packed_k = testing.strided(q, "packed")  # rows of 3 * H * (D + 1) elements
    narrow_out = torch.empty(2, 2, 40, 12, dtype=torch.float16, device=DEVICE)  # rows of 24 bytes
    reasons = tk.descriptor_refusals(dict(query=q, key=packed_k, value=reversed_v, out=narrow_out))
    assert any(r.startswith("key: strides") and "bytes" in r for r in reasons), reasons
    assert any(r.startswith("value: stride") and "along the head dim, not 1" in r for r in reasons), reasons
    assert any(r.startswith("out: strides") for r in reasons), reasons
    assert not any(r.startswith("query") for r in reasons)
    pages = tk.Pages(torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), 16)
    plain = dict(query=q, key=q, value=q, out=q)
    assert any("paged cache" in r for r in tk.descriptor_refusals(plain, pages))
    bounds = torch.tensor([0, 20, 40], dtype=torch.int32, device=DEVICE)
    packed = tk.Sequences(bounds, bounds, 20, 20)
    assert any("packed batch" in r for r in tk.descriptor_refusals(plain, None, packed))
    wide = q.float()
    assert tk.descriptor_refusals(dict(query=wide, key=wide, value=wide, out=wide)) == [tk.FLOAT32_REFUSAL]
    # The backward's: its gradients and grad_out too, by name.
    assert tk.descriptor_refusals(tk.backward_tensors(q, q, q, q, (q, q, q))) == []
    reasons = tk.descriptor_refusals(tk.backward_tensors(q, q, q, reversed_v, (q, packed_k, narrow_out)))
    assert any(r.startswith("grad_out: stride") and "along the head dim, not 1" in r for r in reasons), reasons
    assert any(r.startswith("grad_key: strides") for r in reasons), reasons
    assert any(r.startswith("grad_value: strides") for r in reasons), reasons
    assert not any(r.startswith(("query", "key", "value", "grad_query")) for r in reasons), reasons


def test_forced_descriptor_config_falls_back_where_a_call_cannot_take_it(generator, monkeypatch):
    """A forced config of the variant on layouts it cannot read launches the pointer variant, correctly."""
    inputs = make_inputs(CASES["causal"], torch.float32, 0, generator)  # the output "packed": rows of 17 floats
    assert tk.descriptor_refusals(forward_tensors(inputs))
    assert tk.descriptor_refusals(backward_tensors(inputs))  # grad_out "reversed": no unit stride along D
    variants = _recording_variants(monkeypatch)
    forced = {name: dataclasses.replace(config, descriptors=True) for name, config in SMALL_TILES.items()}
    with tk.forced_configs(**forced):
        results = run_backend(inputs)
    assert variants == {"fwd": [False], "bwd_dkdv": [False], "bwd_dq": [False]}
    testing.check_inputs(results, inputs)


def test_descriptor_mode_is_checked(monkeypatch):
    for value, mode in (("", "auto"), ("auto", "auto"), ("1", "on"), ("0", "off")):
        monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, value)
        assert tk.descriptor_mode() == mode
    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, "yes")
    with pytest.raises(ValueError, match=tk.DESCRIPTORS_VARIABLE):
        tk.descriptor_mode()


@pytest.mark.parametrize("kernel", ["fwd", "bwd_dkdv", "bwd_dq"])
@pytest.mark.parametrize("mode", ["auto", "1"])
def test_autotune_offers_the_descriptor_variant_beside_pointers(kernel, mode, monkeypatch):
    """On sm_90 the descriptor variant of each kept candidate joins them (alone with FUSED_ATTN_TRITON_DESCRIPTORS=1),
    and the default's warp-specialized one where Triton has it; an autotuner without descriptors
    offers none."""
    from fused_attn.backends import triton_compat

    monkeypatch.setattr(tk, "_device_limits", lambda index: ((9, 0), 227 * 1024))
    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, mode)
    constexprs = dict(BLOCK_DQK=64, BLOCK_DV=64, D_QK=64, D_V=64)
    plain = tk._autotuned(kernel).early_config_prune([], {"Q": _FakeCudaTensor()}, **constexprs)
    both = tk._autotuned(kernel, True).early_config_prune([], {"Q": _FakeCudaTensor()}, **constexprs)
    assert not any(c.kwargs["DESCRIPTORS"] or c.kwargs.get("WARP_SPECIALIZE") for c in plain)
    pointers = [c for c in both if not c.kwargs["DESCRIPTORS"]]
    descriptors = [c for c in both if c.kwargs["DESCRIPTORS"] and not c.kwargs.get("WARP_SPECIALIZE")]
    specialized = [c for c in both if c.kwargs.get("WARP_SPECIALIZE")]
    assert len(descriptors) == len(plain)
    assert [str(c) for c in pointers] == ([] if mode == "1" else [str(c) for c in plain])
    warp_specialized = kernel in tk.WARP_SPECIALIZED_KERNELS and triton_compat.warp_specialization()
    assert len(specialized) == (1 if warp_specialized else 0)  # constexprs without scores
    assert all(c.kwargs["DESCRIPTORS"] for c in specialized)
    # With score variants and key padding its partitions spill on sm_100: not offered.
    scored = tk._autotuned(kernel, True).early_config_prune([], {"Q": _FakeCudaTensor()}, **constexprs, SOFTCAP=True,
                                                            HAS_KPM=True)
    assert not any(c.kwargs.get("WARP_SPECIALIZE") for c in scored)
    # Nor at head dim 256, where they used local memory.
    wide = dict(constexprs, BLOCK_DQK=256, D_QK=256)
    assert not any(c.kwargs.get("WARP_SPECIALIZE")
                   for c in tk._autotuned(kernel, True).early_config_prune([], {"Q": _FakeCudaTensor()}, **wide))


POINTERS_ONLY = "its kernels read through pointers only (no tensor-descriptor or warp-specialized variant): "
FORWARD_DESCRIPTORS = "its forward also tries Q, K, V and O through tensor descriptors (TMA), its backward Q, K, V, dO"


def gpu_problem(**fields):
    """A call on CUDA tensors (fp16, B=1, H=2, L=64, D=64, nothing else) with `fields` changed."""
    from fused_attn.problem import Problem

    return Problem(torch.device("cuda", 0), torch.float16, 1, 2, 2, 64, 64, 64, 64, False, 0.0, None, False,
                   False)._replace(**fields)


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """Makes the triton backend see a GPU of the capability given to the returned function."""
    def set_capability(capability):
        monkeypatch.setattr(tk, "interpreting", lambda: False)
        monkeypatch.setattr(tk, "_device_limits", lambda index: (capability, 227 * 1024))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return set_capability


@needs_descriptors
@pytest.mark.parametrize("capability, fields, expected", [
    ((9, 0), {}, FORWARD_DESCRIPTORS),
    ((10, 0), {}, FORWARD_DESCRIPTORS),
    ((9, 0), dict(len_q=1), "its forward's split-KV decode kernel also tries K and V through tensor descriptors (TMA)"),
    ((9, 0), dict(len_q=1, dropout_p=0.1), FORWARD_DESCRIPTORS),  # dropout: the long-query forward
    ((8, 0), {}, POINTERS_ONLY + "tensor descriptors (TMA) need compute capability 9.0 or newer, got 8.0"),
    ((9, 0), dict(varlen=True), POINTERS_ONLY + "a packed batch"),
    # A paged cache of the query's dtype (no cache_dtype) as well as an 8-bit one.
    ((9, 0), dict(paged=True), POINTERS_ONLY + "a paged cache"),
    ((9, 0), dict(paged=True, len_q=1, cache_dtype=torch.int8), POINTERS_ONLY + "a paged cache"),
    ((9, 0), dict(dtype=torch.float32), POINTERS_ONLY + tk.FLOAT32_REFUSAL),
])
def test_registry_notes_say_whether_the_kernels_take_descriptors(capability, fields, expected, gpu_of_capability):
    gpu_of_capability(capability)
    problem = gpu_problem(**fields)
    verdict = registry.explain(problem)["triton"]
    assert verdict.startswith("can run it") and expected in verdict, verdict


@needs_descriptors
def test_registry_notes_say_where_descriptors_are_turned_off(gpu_of_capability, monkeypatch):
    gpu_of_capability((9, 0))
    monkeypatch.setenv(tk.DESCRIPTORS_VARIABLE, "0")
    assert POINTERS_ONLY + f"{tk.DESCRIPTORS_VARIABLE}=0" in BACKEND.notes(gpu_problem())


OFFERED = "warp-specialized forms of its {} descriptor variants too, where the device's shared memory fits them"
NOT_OFFERED = "no warp-specialized form of its {} descriptor variants: {}: its builds spilled registers"


@needs_descriptors
@pytest.mark.skipif(not triton_compat.warp_specialization(), reason=str(triton_compat.warp_specialization_missing()))
@pytest.mark.parametrize("fields, expected", [
    ({}, [OFFERED.format("forward's and backward's")]),
    (dict(is_causal=True, dropout_p=0.2, score_features=("window",)), [OFFERED.format("forward's and backward's")]),
    (dict(len_q=1), [OFFERED.format("forward's and backward's")]),  # the decode kernel's too
    (dict(score_features=("softcap", "alibi"), has_key_padding_mask=True),
     [NOT_OFFERED.format("forward's and backward's", "softcap, ALiBi slopes, key padding")]),
    (dict(mask_dtype=torch.bool), [NOT_OFFERED.format("forward's and backward's", "an attn_mask")]),
    (dict(head_dim_qk=256, head_dim_v=256),
     ["no warp-specialized form of its forward's and backward's descriptor variants: head dims over 128"]),
    (dict(head_dim_qk=96, head_dim_v=160), ["descriptor variants: head dims over 128"]),  # padded to 128 and 256
    (dict(head_dim_qk=80, head_dim_v=128), [OFFERED.format("forward's and backward's")]),
    # The sinks reach the long-query forward alone: the backward takes them through the lse, the decode kernel
    # through its combine.
    (dict(score_features=("sinks",)),
     [NOT_OFFERED.format("forward's", "attention sinks"), OFFERED.format("backward's")]),
    (dict(score_features=("sinks",), len_q=1), [OFFERED.format("forward's and backward's")]),
    (dict(score_features=("sinks", "mask_program")),
     [NOT_OFFERED.format("forward's", "attention sinks, a mask program"),
      NOT_OFFERED.format("backward's", "a mask program")]),
])
def test_registry_notes_say_whether_warp_specialized_variants_are_offered(fields, expected, gpu_of_capability):
    gpu_of_capability((9, 0))
    notes = BACKEND.notes(gpu_problem(**fields))
    assert all(any(text in note for note in notes) for text in expected), notes
    assert len([note for note in notes if "warp-specialized" in note]) == len(expected), notes


@needs_descriptors
def test_registry_notes_name_the_triton_without_warp_specialization(gpu_of_capability, monkeypatch):
    gpu_of_capability((9, 0))
    monkeypatch.setattr(triton_compat, "release", lambda: (3, 8))
    notes = BACKEND.notes(gpu_problem())
    assert any(note.startswith("no warp-specialized form of its forward's and backward's descriptor variants: "
                               "triton 3.8") for note in notes), notes


def test_registry_notes_name_every_feature_that_keeps_warp_specialization_out():
    from fused_attn.backends import triton as triton_backend

    assert set(triton_backend._WARP_SPECIALIZATION_CONSTEXPRS) == set(tk.NOT_WARP_SPECIALIZED)


def test_a_descriptor_variant_triton_cannot_build_falls_back_to_pointers(monkeypatch, generator):
    """On a GPU, a failure to build the variant (a Triton that cannot compile it) runs the launch on the pointer
    candidates, and every later call is refused the variant with that reason."""
    launched = []

    class Tuner:
        def __init__(self, descriptors):
            self.descriptors = descriptors

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(self.descriptors)
                if self.descriptors:
                    raise RuntimeError("PassManager::run failed\n(the pass's diagnostics)")
            return run

    monkeypatch.setattr(tk, "_autotuned", lambda kernel, descriptors=False: Tuner(descriptors))
    monkeypatch.setattr(tk, "interpreting", lambda: False)
    monkeypatch.setattr(tk, "_descriptor_failure", [])
    tk._launch("fwd", lambda m, n: 1, (), {}, _FakeCudaTensor(), descriptors=True)
    assert launched == [True, False]
    q = torch.randn(1, 2, 32, 16, generator=generator).to(torch.float16)
    assert tk.descriptor_refusals(dict(query=q, key=q, value=q, out=q)) == [
        "triton could not build the descriptor variant (RuntimeError: PassManager::run failed)"]
