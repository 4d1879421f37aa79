"""The `cuda` backend's kernels against the float64 reference, by the criterion of DESIGN.md: ordinary
calls, the split-KV decode kernels (few query rows), packed batches (attention_varlen, against
tests/test_varlen.py's padded definition), attention sinks and mask programs (fused_attn.masks).

Without a GPU (`emulated_cuda`): csrc/cuda is compiled with the host compiler against the emulation
of the CUDA execution model in tests/emulation and run on CPU tensors; the host glue that checks the
arguments and launches the kernels is the one the CUDA build uses (csrc/cuda/flash_dispatch.h).
The same kernels also run, without torch, under ThreadSanitizer (a shared-memory race, i.e. a
missing __syncthreads, is reported) and AddressSanitizer + UBSan (tests/emulation/sanitized_run.cpp).
With a GPU (`cuda`): the same cases through `fused_attn.attention(..., backend="cuda")`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fused_attn
from fused_attn import masks, testing
from fused_attn.backends import registry
from fused_attn.backends.extension import dropout_args
from fused_attn.dropout import Dropout, peek_rng
from fused_attn.problem import lse_dtype
from fused_attn.scores import PLAIN, sink_gradient, variant_of

import test_varlen as varlen_tests  # packed batches and their padded definition
from emulation import build  # tests/emulation: one module, which conftest starts compiling early

pytest.importorskip("hypothesis")
import combinations  # noqa: E402
from hypothesis import given  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = testing.LAYOUTS


def skip_without_cuda_headers():
    if build.cuda_include_dir() is None:
        pytest.skip("no cuda_fp16.h / cuda_bf16.h (neither a CUDA toolkit nor the triton wheel)")


def test_a_killed_builds_lock_file_does_not_stop_the_next_build(tmp_path):
    """cpp_extension waits forever on a `lock` file a killed build left; under the builder's own lock (which the
    system releases when its holder dies) that file is removed, and a second builder waits its turn."""
    import fcntl
    import subprocess
    import sys

    (tmp_path / "lock").touch()
    probe = ("import fcntl, sys\n"
             "handle = open(sys.argv[1], 'w')\n"
             "try:\n    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except BlockingIOError:\n    print('held')\n")
    with build._builder_alone(tmp_path):
        assert not (tmp_path / "lock").exists()
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "builder.flock")], capture_output=True,
                              text=True, timeout=60, check=True).stdout.strip()
        assert held == "held"
    with open(tmp_path / "builder.flock") as handle:  # released on leaving
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.fixture(scope="module")
def emulated():
    """The emulated kernels (built once per session; a kernel that does not compile fails here)."""
    skip_without_cuda_headers()
    return build.load()


Case = testing.Case
# Masks are stored column-major (mask_layout="transposed"): a layout the tensors never get.
CASES = {
    "plain": Case(len_q=40, len_k=40, dim_qk=32),
    "causal_lq_gt_lk": Case(len_q=70, len_k=45, dim_qk=40, is_causal=True),
    "causal_lq_lt_lk": Case(len_q=33, len_k=80, dim_qk=16, is_causal=True, lse_grad=True),
    "bool_mask_padding": Case(len_q=50, len_k=37, dim_qk=24, mask="bool", mask_shape="2d",
                              mask_layout="transposed", key_padding=True),
    "additive_mask_causal": Case(len_q=45, len_k=45, dim_qk=64, is_causal=True, mask="additive",
                                 mask_shape="batch", mask_layout="transposed"),
    "gqa_dims_differ": Case(heads_q=4, heads_kv=2, len_q=36, len_k=52, dim_qk=24, dim_v=40, mask="bool",
                            mask_shape="heads_keys", mask_layout="transposed", lse_grad=True),
    "hidden_rows": Case(len_q=30, len_k=26, dim_qk=20, mask="bool", mask_layout="transposed",
                        key_padding=True, hidden_rows=True),
    "hidden_rows_additive": Case(heads_q=4, heads_kv=1, len_q=19, len_k=70, dim_qk=8, mask="additive",
                                 mask_shape="batch", mask_layout="transposed", key_padding=True,
                                 hidden_rows=True, is_causal=True),
}
# Not the default scale: the kernels must take the scale they are given.
LARGE_HEAD_CASES = {
    "head_128": Case(batch=1, heads_q=2, heads_kv=1, len_q=24, len_k=33, dim_qk=100, dim_v=72,
                     is_causal=True, key_padding=True, scale=0.3),
    "head_256": Case(batch=1, heads_q=1, heads_kv=1, len_q=20, len_k=35, dim_qk=200, dim_v=160,
                     mask="additive", mask_shape="2d", mask_layout="transposed", lse_grad=True, scale=0.3),
}
# Dropout and learned additive masks (mask_grad), with the other features.
TRAINING_CASES = {
    "dropout": Case(dropout_p=0.3, len_q=37, len_k=70, dim_qk=32),
    "dropout_gqa_padding_lse_grad": Case(dropout_p=0.5, heads_q=4, heads_kv=2, key_padding=True, lse_grad=True,
                                         dim_qk=24, dim_v=8),
    "dropout_hidden_rows": Case(dropout_p=0.9, hidden_rows=True, mask="bool", mask_shape="batch",
                                mask_layout="transposed", is_causal=True),
    "mask_grad_full": Case(mask="additive", mask_grad=True, mask_layout="transposed", len_q=29, len_k=37),
    "mask_grad_heads_causal_dropout": Case(mask="additive", mask_shape="heads_keys", mask_grad=True,
                                           is_causal=True, dropout_p=0.2, heads_q=4, heads_kv=2, len_q=45,
                                           len_k=70, dim_qk=24),
    "mask_grad_2d_padding_lse": Case(mask="additive", mask_shape="2d", mask_grad=True, key_padding=True,
                                     lse_grad=True, mask_layout="sliced"),
    "mask_grad_hidden_rows": Case(mask="additive", mask_shape="batch", mask_grad=True, hidden_rows=True,
                                  dropout_p=0.4),
}
# The score variants (fused_attn.scores), with each other and with the features above.
VARIANT_CASES = {
    "window_causal_bottom_right_gqa": Case(len_q=23, len_k=75, heads_q=4, heads_kv=2, is_causal=True,
                                           causal_alignment="bottom_right", window=(19, -1), dim_qk=32),
    "window_both_sides_dropout_padding": Case(len_q=70, len_k=70, window=(5, 11), dropout_p=0.3,
                                              key_padding=True, lse_grad=True),
    "bottom_right_more_queries_than_keys": Case(len_q=50, len_k=19, is_causal=True,
                                                causal_alignment="bottom_right", dim_qk=24, dim_v=8),
    "softcap_alibi_learned_bias": Case(softcap=2.5, alibi="heads", mask="additive", mask_grad=True,
                                       mask_shape="heads_keys", mask_layout="transposed", len_q=21, len_k=35),
    "everything": Case(heads_q=4, heads_kv=1, len_q=30, len_k=50, is_causal=True, causal_alignment="bottom_right",
                       window=(20, 3), softcap=3.0, alibi="batch", mask="additive", mask_grad=True, mask_shape="2d",
                       key_padding=True, dropout_p=0.2, lse_grad=True, dim_qk=20),
    "window_hides_rows": Case(len_q=40, len_k=30, window=(0, 0), hidden_rows=True, mask="bool", key_padding=True),
    **testing.INTEGER_ALIGNMENT_CASES,
}
# Few query rows: the forward runs the split-KV decode kernels (a GQA group's G · L_q rows in one tile
# of 16 or 64, keys split by the SM count: 4 in the emulation, 2 splits from 512 keys on).
DECODE_CASES = {
    **testing.DECODE_CASES,
    "group_of_64_rows_head_128": Case(batch=1, heads_q=8, heads_kv=2, len_q=16, len_k=200, window=(20, 150),
                                      dim_qk=100, dim_v=72, scale=0.3),
}
ALL_CASES = {**CASES, **LARGE_HEAD_CASES, **TRAINING_CASES, **VARIANT_CASES, **DECODE_CASES}
# Rotations of the tensor layouts: two by default, the other three marked slow.
# Every dtype with rotations 0 and 2; fp16 also with the other three, so that every tensor meets
# every layout.
DTYPE_ROTATIONS = [pytest.param(dtype, rotation, id=f"{str(dtype).removeprefix('torch.')}-{rotation}")
                   for dtype, rotation in testing.dtype_rotations(DTYPES, torch.float16, (0, 2))]


class EmulatedBackend:
    """The emulated host glue behind the `Backend.forward` / `backward` interface, as the `cuda`
    backend calls the real one (fused_attn/backends/extension.py)."""

    def __init__(self, module):
        self.module = module

    # The forwards take the whole variant (op_args: the sinks too), the backwards its score_args: the lse
    # they are given holds the sinks.
    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout=None,
                variant=PLAIN):
        return self.module.forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out,
                                   *dropout_args(dropout), *variant.op_args())

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, grad_out,
                 grad_lse, dropout=None, grad_mask=None, variant=PLAIN):
        return self.module.backward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                                    grad_out, grad_lse, *dropout_args(dropout), grad_mask, *variant.score_args())

    def forward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                       scale, out, lse, dropout=None, variant=PLAIN):
        self.module.forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   is_causal, scale, out, lse, *dropout_args(dropout), *variant.op_args())

    def backward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                        scale, out, lse, grad_out, grad_lse, dropout=None, variant=PLAIN):
        return self.module.backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           is_causal, scale, out, lse, grad_out, grad_lse, *dropout_args(dropout),
                                           *variant.score_args())


def run_emulated(module, inputs: testing.Inputs) -> testing.Results:
    """Forward and backward through the emulated host glue, into the inputs' NaN-poisoned output."""
    return testing.run_backend(EmulatedBackend(module), inputs)


def run_emulated_forward(module, inputs: testing.Inputs) -> testing.Results:
    """The forward alone (output and lse), into the inputs' NaN-poisoned output."""
    case = inputs.case
    lse = EmulatedBackend(module).forward(inputs.query, inputs.key, inputs.value, inputs.mask_view(),
                                          inputs.key_padding_mask, case.is_causal, case.softmax_scale, inputs.out,
                                          inputs.dropout(), inputs.variant())
    return testing.Results(inputs.out, lse)


# ---- emulated on the CPU ---------------------------------------------------------------------------

@pytest.mark.emulated_cuda
@pytest.mark.parametrize("dtype,rotation", DTYPE_ROTATIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_emulated_matches_reference(emulated, name, dtype, rotation, generator):
    inputs = testing.random_inputs(CASES[name], dtype, rotation, generator)
    testing.check_inputs(run_emulated(emulated, inputs), inputs)


@pytest.mark.emulated_cuda
@combinations.settings(40)
@given(problem=combinations.problems(DTYPES))
def test_emulated_any_combination_meets_criterion(emulated, problem):
    """Every feature drawn together (tests/combinations.py): the long-query and decode kernels, forward and backward."""
    inputs = combinations.inputs_of(problem)
    combinations.check(run_emulated(emulated, inputs), inputs)


# Each NaN case in one dtype, taken in turn.
NAN_RUNS = [pytest.param(name, DTYPES[i % len(DTYPES)], id=f"{name}-{DTYPES[i % len(DTYPES)]}")
            for i, name in enumerate(testing.NAN_CASES)]


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name,dtype", NAN_RUNS)
def test_emulated_nan_inputs_give_nan_rows(emulated, name, dtype, generator):
    """A NaN query element and a NaN key element: NaN rows where the reference has them, on the long-query, decode
    and program paths (the CUDA maximum, fmaxf, passes over NaN: the row's sum carries it)."""
    inputs = testing.nan_poisoned(testing.random_inputs(testing.NAN_CASES[name], dtype, 0, generator))
    testing.check_nan_inputs(run_emulated(emulated, inputs), inputs)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("rotation", [0, 2])  # the other three layouts: test_emulated_matches_reference
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(TRAINING_CASES))
def test_emulated_dropout_and_mask_gradient(emulated, name, dtype, rotation, generator):
    """Against the float64 reference that drops the very same elements (fused_attn.dropout); the mask
    gradient in the mask's own broadcast shape."""
    inputs = testing.random_inputs(TRAINING_CASES[name], dtype, rotation, generator)
    testing.check_inputs(run_emulated(emulated, inputs), inputs)


@pytest.mark.emulated_cuda
def test_emulated_drops_what_every_backend_drops(emulated, generator):
    """With V the identity, the output is the dropped, rescaled weights: their zeros are exactly
    where `testing.dropout_mask` drops, as on the cpu backend."""
    case = Case(batch=2, heads_q=3, heads_kv=3, len_q=21, len_k=32, dim_qk=16, dim_v=32, dropout_p=0.4)
    inputs = testing.random_inputs(case, torch.float32, 0, generator)
    value = torch.eye(32).expand(2, 3, 32, 32)
    backend = EmulatedBackend(emulated)
    out = torch.empty(2, 3, 21, 32)
    backend.forward(inputs.query, inputs.key, value, None, None, False, 0.25, out, inputs.dropout())
    keep = testing.dropout_mask(0.4, 2, 3, 21, 32, generator=inputs.dropout_generator())
    assert torch.equal(out != 0, keep)
    cpu_out = torch.empty_like(out)
    registry.get("cpu").forward(inputs.query, inputs.key, value, None, None, False, 0.25, cpu_out,
                                inputs.dropout())
    torch.testing.assert_close(out, cpu_out, rtol=1e-5, atol=1e-6)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_training_backward_is_deterministic(emulated, dtype, generator):
    inputs = testing.random_inputs(TRAINING_CASES["mask_grad_heads_causal_dropout"], dtype, 1, generator)
    first, second = run_emulated(emulated, inputs), run_emulated(emulated, inputs)
    for name, value in first.named().items():
        assert torch.equal(value, second.named()[name]), name


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [*LARGE_HEAD_CASES, *VARIANT_CASES])
def test_emulated_large_heads_and_score_variants(emulated, name, dtype, generator):
    """Head dims 128 and 256; windows, bottom-right alignment, softcap and ALiBi drawn together with
    the other features."""
    inputs = testing.random_inputs({**LARGE_HEAD_CASES, **VARIANT_CASES}[name], dtype, 1, generator)
    testing.check_inputs(run_emulated(emulated, inputs), inputs)


@pytest.mark.emulated_cuda
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_many_tiles(emulated, dtype, generator):
    case = Case(batch=1, heads_q=2, heads_kv=1, len_q=200, len_k=170, dim_qk=64, is_causal=True, mask="bool",
                mask_shape="2d", mask_layout="transposed", key_padding=True, lse_grad=True, scale=0.125)
    inputs = testing.random_inputs(case, dtype, 3, generator)
    testing.check_inputs(run_emulated(emulated, inputs), inputs)


# Every case with every dtype at the split count of the problem; with three forced splits (uneven, some
# empty under a window or padding) in one dtype each.
DECODE_RUNS = [pytest.param(name, dtype, None, id=f"{name}-{str(dtype).removeprefix('torch.')}")
               for name in DECODE_CASES for dtype in DTYPES]
DECODE_RUNS += [pytest.param(name, DTYPES[i % len(DTYPES)], "3", id=f"{name}-{str(DTYPES[i % len(DTYPES)])[6:]}-3")
                for i, name in enumerate(DECODE_CASES)]


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name,dtype,splits", DECODE_RUNS)
def test_emulated_decode_kernels_match_reference(emulated, name, dtype, splits, generator, monkeypatch):
    """The split-KV forward (the backward runs the long-query kernels, tested above) in each case's own
    rotation of the layouts."""
    if splits is not None:
        monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE_SPLITS", splits)
    inputs = testing.random_inputs(DECODE_CASES[name], dtype, list(DECODE_CASES).index(name) % len(LAYOUTS),
                                   generator)
    expected = 3 if splits else (2 if inputs.key.shape[2] >= 512 else 1)
    assert emulated.decode_splits(inputs.query, inputs.key, inputs.value) == expected
    testing.check_inputs(run_emulated_forward(emulated, inputs), inputs)


@pytest.mark.emulated_cuda
def test_emulated_backward_takes_the_decode_forward(emulated, generator):
    """Forward (decode kernels, split) and backward (long-query kernels) with a gradient into the lse."""
    case = dataclasses.replace(DECODE_CASES["one_query_padding_softcap"], batch=1, lse_grad=True, len_k=520)
    inputs = testing.random_inputs(case, torch.float16, 1, generator)
    assert emulated.decode_splits(inputs.query, inputs.key, inputs.value) == 2
    testing.check_inputs(run_emulated(emulated, inputs), inputs)


@pytest.mark.emulated_cuda
def test_emulated_decode_selection_and_split_count(emulated, monkeypatch):
    """As triton_decode's: L_q <= 16, G · L_q <= 64, head dims <= 128, keys, no dropout; splits doubled
    while the blocks are fewer than two per SM (4 here) and each split keeps 256 keys."""
    def splits(batch, heads_q, heads_kv, len_q, len_k, dim=16, dropout_p=0.0):
        q = torch.empty(batch, heads_q, len_q, dim)
        k = torch.empty(batch, heads_kv, len_k, dim)
        rng = torch.tensor([1, 2, 0, 0]) if dropout_p else None
        return emulated.decode_splits(q, k, k, dropout_p, rng)

    assert splits(1, 1, 1, 1, 4096) == 8  # 1 block -> 2 per SM, keys allow it
    assert splits(1, 1, 1, 1, 300) == 1   # too few keys to split
    assert splits(8, 1, 1, 1, 8192) == 1  # enough blocks already
    assert splits(1, 8, 8, 16, 40) == 1 and splits(1, 8, 2, 16, 40) == 1  # 64 rows
    assert splits(1, 8, 8, 17, 40) == 0   # more than 16 queries
    assert splits(1, 32, 1, 4, 40) == 0   # 128 rows in the group
    assert splits(1, 8, 8, 1, 40, dim=256) == 0
    assert splits(1, 8, 8, 1, 0) == 0     # no keys
    assert splits(1, 8, 8, 1, 40, dropout_p=0.1) == 0
    monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE", "0")
    assert splits(1, 1, 1, 1, 4096) == 0
    monkeypatch.delenv("FUSED_ATTN_CUDA_DECODE")
    monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE_SPLITS", "5")
    assert splits(1, 1, 1, 1, 4096) == 5
    assert splits(1, 1, 1, 1, 3) == 3  # at most one split per key
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE_SPLITS", bad)
        with pytest.raises(RuntimeError, match="FUSED_ATTN_CUDA_DECODE_SPLITS: expected a positive integer"):
            splits(1, 1, 1, 1, 4096)


def run_emulated_varlen(module, inputs, dropout=None, max_seqlen=None, index_dtype=torch.int32,
                        backend=None) -> testing.Results:
    """attention_varlen's forward and backward of a test_varlen.Packed batch through a backend's
    `forward_varlen` / `backward_varlen` (the emulated glue by default), into a NaN-poisoned output and lse.
    `max_seqlen`: the (max_seqlen_q, max_seqlen_k) given, default the longest sequences. With the batch's
    sinks, also their gradient (scores.sink_gradient of out and lse, as fused_attn.varlen computes it)."""
    backend = backend or EmulatedBackend(module)
    case = inputs.case
    device = inputs.query.device
    cu_q, cu_k = (varlen_tests.cumulative(lengths).to(device, index_dtype) for lengths in (case.lengths_q, case.keys))
    max_q, max_k = max_seqlen or (max(case.lengths_q), max(case.keys))
    variant = variant_of(inputs.query.new_empty((len(case.lengths_q), case.heads_q, 0, 0)), case.causal_alignment,
                         case.window, case.softcap or None, inputs.alibi_slopes, inputs.sinks)
    total_q, dtype = inputs.query.shape[0], inputs.query.dtype
    out = torch.full((total_q, case.heads_q, case.dim_v), float("nan"), dtype=dtype, device=device)
    lse = torch.full((case.heads_q, total_q), float("nan"), dtype=lse_dtype(dtype), device=device)
    args = (inputs.query, inputs.key, inputs.value, cu_q, cu_k, max_q, max_k, case.is_causal, case.dim_qk ** -0.5)
    backend.forward_varlen(*args, out, lse, dropout, variant)
    grads = backend.backward_varlen(*args, out, lse, inputs.grad_out, inputs.grad_lse, dropout, variant)
    grad_sinks = None
    if variant.sinks is not None:  # out and grad_out as (H_q, total_q, D_v), lse's rows
        grad_sinks = sink_gradient(variant.sinks, lse, out.transpose(0, 1), inputs.grad_out.transpose(0, 1),
                                   inputs.grad_lse, heads_dim=0)
    return testing.Results(out, lse, *grads, grad_sinks=grad_sinks)


# test_varlen's packed batches: empty sequences, sequences without keys, more queries than keys, GQA,
# causal in both alignments, windows, softcap, ALiBi; a dtype and a rotation of the layouts each.
VARLEN_RUNS = [pytest.param(name, DTYPES[i % len(DTYPES)], i, id=f"{name}-{str(DTYPES[i % len(DTYPES)])[6:]}",
                            marks=[pytest.mark.slow] if name in ("long_window", "sinks_window_softcap_alibi") else [])
               for i, name in enumerate(varlen_tests.CASES)]


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name,dtype,rotation", VARLEN_RUNS)
def test_emulated_varlen_matches_padded_definition(emulated, name, dtype, rotation, generator):
    """Forward and backward of a packed batch against its definition (test_varlen.reference_of: padded,
    padding hidden, unpadded); a sequence without keys gives rows 0 and lse -inf (with sinks: the sink)."""
    inputs = varlen_tests.random_packed(varlen_tests.CASES[name], dtype, rotation, generator)
    actual = run_emulated_varlen(emulated, inputs)
    testing.assert_close_to_reference(actual, varlen_tests.reference_of(inputs, torch.float64),
                                      varlen_tests.reference_of(inputs, dtype), dtype)
    check_keyless_sequences(actual, inputs)


def check_keyless_sequences(actual: testing.Results, inputs) -> int:
    """The rows of the sequences without keys have output 0 and lse -inf, or sinks[h] with sinks; no lse is
    NaN. Returns the number of such rows."""
    case, start, keyless = inputs.case, 0, 0
    no_key = torch.full((case.heads_q, 1), float("-inf"))
    if inputs.sinks is not None:
        no_key = inputs.sinks.detach().cpu().float()[:, None]
    assert not torch.isnan(actual.lse).any()
    for n_q, n_k in zip(case.lengths_q, case.keys):
        if n_k == 0:
            assert torch.equal(actual.lse[:, start:start + n_q].cpu(), no_key.expand(-1, n_q))
            assert (actual.out[start:start + n_q] == 0).all()
            keyless += n_q
        start += n_q
    return keyless


@pytest.mark.emulated_cuda
def test_emulated_varlen_bounds_of_every_form(emulated, generator):
    """int64 bounds and max_seqlen -1 (read from the lengths), or bounds larger than the longest
    sequences (blocks past every sequence's end): the same results, bit for bit."""
    inputs = varlen_tests.random_packed(varlen_tests.CASES["cross_bottom_right"], torch.float32, 2, generator)
    expected = run_emulated_varlen(emulated, inputs)
    for options in (dict(index_dtype=torch.int64, max_seqlen=(-1, -1)), dict(max_seqlen=(200, 300))):
        for name, value in run_emulated_varlen(emulated, inputs, **options).named().items():
            assert torch.equal(value, getattr(expected, name)), (options, name)


@pytest.mark.emulated_cuda
def test_emulated_varlen_dropout_is_each_sequence_with_its_own_offset(emulated, generator):
    """Sequence b drops what a one-sequence call with (seed, offset + b) drops: against the reference
    backend's packed batch (each sequence's strided view, in turn), in float64 and in the dtype."""
    case = varlen_tests.VarlenCase((13, 0, 37, 6), (20, 4, 37, 6), is_causal=True, causal_alignment="bottom_right",
                                   window=(9, 0), softcap=3.0, alibi=True, lse_grad=True)
    inputs = varlen_tests.random_packed(case, torch.bfloat16, 1, generator)
    dropout = Dropout(0.3, peek_rng(torch.device("cpu"), torch.Generator().manual_seed(1234)))
    actual = run_emulated_varlen(emulated, inputs, dropout)
    reference = registry.get("reference")
    exact = run_emulated_varlen(None, varlen_tests.Packed(case, *(None if t is None else t.double() for t in (
        inputs.query, inputs.key, inputs.value, inputs.grad_out, inputs.grad_lse)), inputs.alibi_slopes), dropout,
        backend=reference)
    same = run_emulated_varlen(None, inputs, dropout, backend=reference)
    testing.assert_close_to_reference(actual, exact, same, torch.bfloat16)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("change, message", [
    (dict(query=torch.zeros(1, 10, 2, 8)), "query must be 3-D"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 4.0, 10.0])), "cu_seqlens_q must be int32 or int64"),
    (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), "cu_seqlens_k must have the shape"),
    (dict(max_seqlen_q=-2), "max_seqlen_q must be -1"),
    (dict(out=torch.zeros(10, 2, 7)), "out must have shape"),
    (dict(lse=torch.zeros(10, 2)), "lse must have shape"),
    (dict(lse=torch.zeros(2, 10, dtype=torch.float64)), "lse must be Float"),
    (dict(alibi_slopes=torch.zeros(3, 2)), "alibi_slopes must have shape"),
])
def test_emulated_varlen_glue_rejects_bad_arguments(emulated, change, message):
    args = dict(query=torch.zeros(10, 2, 8), key=torch.zeros(12, 2, 8), value=torch.zeros(12, 2, 8),
                cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=7,
                out=torch.zeros(10, 2, 8), lse=torch.zeros(2, 10), alibi_slopes=None)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        emulated.forward_varlen(args["query"], args["key"], args["value"], args["cu_seqlens_q"], args["cu_seqlens_k"],
                                args["max_seqlen_q"], args["max_seqlen_k"], False, 0.25, args["out"], args["lse"], 0.0,
                                None, -1, -1, False, 0.0, args["alibi_slopes"], 0)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", ["long_query", "decode"])
def test_emulated_padded_keys_are_never_read(emulated, path, poison, generator, monkeypatch):
    """No padded key is read (the span, AttentionParams::key_spans), not even in the key block holding a
    span's first or last key: NaN or inf in K and V before and after each row's span (which starts and
    ends mid-block) change nothing in the forward (long-query or decode kernels, three splits), dK/dV or dQ."""
    monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE_SPLITS", "3")
    len_q, len_k = (19, 60) if path == "long_query" else (3, 200)
    query, key = torch.empty(1, 2, len_q, 16, dtype=torch.float16), torch.empty(1, 1, len_k, 16, dtype=torch.float16)
    assert (emulated.decode_splits(query, key, key) > 0) == (path == "decode")
    testing.check_padding_is_not_read(EmulatedBackend(emulated), torch.float16, generator, poison=poison,
                                      len_q=len_q, len_k=len_k)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_backward_is_deterministic(emulated, dtype, generator):
    case = Case(heads_q=4, heads_kv=1, len_q=70, len_k=70, dim_qk=32, is_causal=True, lse_grad=True,
                scale=0.2)
    inputs = testing.random_inputs(case, dtype, 4, generator)
    first = run_emulated(emulated, inputs)
    second = run_emulated(emulated, inputs)
    for name in ("out", "lse", "grad_query", "grad_key", "grad_value"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


@pytest.mark.emulated_cuda
def test_emulated_empty_queries_give_zero_key_grads(emulated, generator):
    case = Case(len_q=0, len_k=20, dim_qk=32, scale=0.5)
    inputs = testing.random_inputs(case, torch.float32, 0, generator)
    result = run_emulated(emulated, inputs)
    assert result.lse.shape == (2, 2, 0)
    assert (result.grad_key == 0).all() and (result.grad_value == 0).all()


@pytest.mark.emulated_cuda
def test_emulated_empty_keys_give_zero_rows(emulated, generator):
    case = Case(len_q=20, len_k=0, dim_qk=32, scale=0.5)
    inputs = testing.random_inputs(case, torch.float16, 0, generator)
    result = run_emulated(emulated, inputs)
    assert torch.isneginf(result.lse).all() and (result.out == 0).all()
    assert (result.grad_query == 0).all() and result.grad_key.shape == (2, 2, 0, 32)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("change, message", [
    (dict(key=torch.zeros(2, 2, 8, 16, dtype=torch.float16)), "key and value must have query's dtype"),
    (dict(query=torch.zeros(2, 2, 8, 16, dtype=torch.float64),
          key=torch.zeros(2, 2, 8, 16, dtype=torch.float64),
          value=torch.zeros(2, 2, 8, 16, dtype=torch.float64),
          out=torch.zeros(2, 2, 8, 16, dtype=torch.float64)), "float16, bfloat16 or float32"),
    (dict(query=torch.zeros(2, 2, 8, 300), key=torch.zeros(2, 2, 8, 300)), "head dims up to 256"),
    (dict(query=torch.zeros(2, 3, 8, 16), out=torch.zeros(2, 3, 8, 16)), "multiple of the 2 key/value"),
    (dict(mask=torch.ones(2, 2, 8, 9, dtype=torch.bool)), "attn_mask must have shape"),
    (dict(mask=torch.ones(2, 2, 8, 8, dtype=torch.int32)), "attn_mask must be bool"),
    (dict(padding=torch.ones(2, 8)), "key_padding_mask must be bool"),
    (dict(out=torch.zeros(2, 2, 7, 16)), "out must have shape"),
    (dict(value=torch.zeros(2, 2, 9, 16)), "value must have shape"),
])
def test_emulated_glue_rejects_bad_arguments(emulated, change, message):
    args = dict(query=torch.zeros(2, 2, 8, 16), key=torch.zeros(2, 2, 8, 16),
                value=torch.zeros(2, 2, 8, 16), mask=None, padding=None, out=torch.zeros(2, 2, 8, 16))
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        emulated.forward(args["query"], args["key"], args["value"], args["mask"], args["padding"],
                         False, 0.25, args["out"])


@pytest.mark.emulated_cuda
def test_emulated_glue_rejects_outputs_sharing_memory(emulated):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="out: expected memory apart from query's"):
        emulated.forward(q, q.clone(), q.clone(), None, None, False, 0.25, q)
    storage = torch.randn(384)  # value in elements 0-127, out in 64-319: they meet
    key = torch.randn(1, 1, 8, 16)
    value, out = storage[:128].view(1, 1, 8, 16), storage[64:320].view(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="out: expected memory apart from value's"):
        emulated.forward(q, key, value, None, None, False, 0.25, out)
    # Interleaved slices of one packed projection, (B, L, 3, H, D): neither is one dense block.
    packed = torch.randn(1, 8, 3, 2, 16)
    query, into_key = (packed[:, :, i].transpose(1, 2) for i in (0, 1))
    with pytest.raises(RuntimeError, match="out: expected memory apart from query's"):
        emulated.forward(query, key.expand(1, 2, 8, 16).clone(), q.clone(), None, None, False, 0.25, into_key)
    with pytest.raises(RuntimeError, match="expanded view"):
        emulated.forward(q, q, q, None, None, False, 0.25, torch.zeros(1, 1, 8, 16).expand(1, 2, 8, 16))


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("rows, keys", [((3, 11), (8, 40)), ((0, 17), (5, 38)), ((2, 15), (6, 31)),
                                        ((4, 16), (11, 40))])
def test_emulated_dropout_at_positions_drops_what_the_whole_call_drops(emulated, rows, keys, generator):
    """A block of a longer sequence with its (query_start, key_start): four keys straddle two Philox
    blocks when the key start is not a multiple of 4 (kept4)."""
    testing.check_dropout_at_positions(EmulatedBackend(emulated), rows, keys, torch.float32, generator)


@pytest.mark.emulated_cuda
def test_emulated_glue_rejects_bad_backward_arguments(emulated):
    q = torch.zeros(1, 2, 8, 16)
    lse = torch.zeros(1, 2, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="lse must be float32"):
        emulated.backward(q, q, q, None, None, False, 0.25, q, lse, q, None)
    with pytest.raises(RuntimeError, match="grad_lse must have shape"):
        emulated.backward(q, q, q, None, None, False, 0.25, q, lse.float(), q, torch.zeros(1, 2, 7))
    rng = torch.tensor([5, 0, 0, 0])
    for dropout_p, dropout_rng, message in ((1.0, rng, "dropout_p must be in"), (0.1, None, "dropout_rng"),
                                            (0.1, rng.int(), "int64 tensor"), (0.1, torch.zeros(8, dtype=torch.long)[::2],
                                                                               "contiguous")):
        with pytest.raises(RuntimeError, match=message):
            emulated.forward(q, q, q, None, None, False, 0.25, torch.empty_like(q), dropout_p, dropout_rng)
    bias = torch.zeros(1, 2, 8, 8)
    with pytest.raises(RuntimeError, match="only for an additive"):
        emulated.backward(q, q, q, None, None, False, 0.25, q, lse.float(), q, None, 0.0, None, bias.clone())
    with pytest.raises(RuntimeError, match="grad_mask must have query's dtype"):
        emulated.backward(q, q, q, bias, None, False, 0.25, q, lse.float(), q, None, 0.0, None, bias.double())
    with pytest.raises(RuntimeError, match="not an expanded view"):
        emulated.backward(q, q, q, bias, None, False, 0.25, q, lse.float(), q, None, 0.0, None,
                          torch.zeros(1, 1, 8, 8).expand(1, 2, 8, 8))


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_emulated_kernels_are_clean_under_sanitizers(sanitizer, tmp_path):
    """Every kernel, forward, backward (also of a packed batch, and with a mask program) and decode (also with a
    mask program), with ThreadSanitizer (shared-memory races: a missing __syncthreads) or AddressSanitizer + UBSan
    (out-of-bounds accesses, undefined behaviour)."""
    import subprocess

    skip_without_cuda_headers()
    binary = build.build_sanitized(sanitizer, tmp_path)
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    if "unexpected memory mapping" in done.stderr:  # the sanitizer runtime vs this kernel's ASLR
        pytest.skip(f"{sanitizer} sanitizer cannot start here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stdout + done.stderr[-8000:]
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, done.stderr[-8000:]
    assert done.stdout.count(": ok") == 9, done.stdout


# ---- attention sinks --------------------------------------------------------------------------------

def random_sinks(heads: int, generator, device="cpu") -> torch.Tensor:
    """One logit per head, in turn: near a row's log-sum-exp (it dominates the rows that see few keys, not
    the others), far above every row's (it dominates them all), -inf (as no sink)."""
    sinks = torch.randn(heads, generator=generator) + 2.0
    sinks[1::3] += 8.0
    sinks[2::3] = float("-inf")
    return sinks.to(device)


def with_sinks(inputs: testing.Inputs, sinks: torch.Tensor | None = None, generator=None) -> testing.Inputs:
    """`inputs` with `sinks`, or with random_sinks drawn from `generator`."""
    if sinks is None:
        sinks = random_sinks(inputs.case.heads_q, generator, inputs.query.device)
    return dataclasses.replace(inputs, sinks=sinks.to(inputs.query.device))


def rows_that_see_no_key(inputs: testing.Inputs) -> torch.Tensor:
    """Bool (B, H_q, L_q): the rows whose log-sum-exp without the sinks is -inf (float64 reference)."""
    no_sinks = dataclasses.replace(inputs, sinks=None)
    return torch.isneginf(testing.reference_results(no_sinks.query, no_sinks.key, no_sinks.value, dtype=torch.float64,
                                                    attn_mask=no_sinks.mask_view(),
                                                    key_padding_mask=no_sinks.key_padding_mask,
                                                    is_causal=no_sinks.case.is_causal, scale=no_sinks.case.scale,
                                                    variant=no_sinks.variant()).lse)


def check_with_sinks(actual: testing.Results, inputs: testing.Inputs) -> dict[str, tuple[float, float]]:
    """testing.check_inputs (the criterion, for the sinks' gradient too where `actual` has one), and: no lse
    is NaN; every row that sees no key (hidden_rows or not) has output 0, lse sinks[h] exactly (-inf under a
    sink of -inf) and dq 0."""
    report = testing.check_inputs(actual, inputs)
    lse = actual.lse.detach().cpu()
    assert not torch.isnan(lse).any()
    hidden = rows_that_see_no_key(inputs)
    sink_of_row = inputs.sinks.cpu().view(1, -1, 1).expand(lse.shape)
    assert torch.equal(lse[hidden], sink_of_row[hidden])
    assert (actual.out.detach().cpu()[hidden] == 0).all()
    if actual.grad_query is not None:
        assert (actual.grad_query.detach().cpu()[hidden] == 0).all()
    return report


# testing.SINK_CASES (every backend runs them; the decode ones run the decode forward here) with every
# dtype; and these, one dtype each, with the sinks of random_sinks (near, dominating, -inf) per head.
MIXED_SINK_CASES = {
    "gqa_causal_lse_grad": Case(heads_q=4, heads_kv=2, len_q=37, len_k=45, dim_qk=24, is_causal=True, lse_grad=True),
    "bottom_right_window_softcap_alibi_padding": Case(heads_q=3, heads_kv=1, len_q=30, len_k=52, is_causal=True,
                                                      causal_alignment="bottom_right", window=(9, 2), softcap=2.5,
                                                      alibi="batch", key_padding=True, dim_qk=32),
    "learned_bias_padding_hidden_rows": Case(heads_q=3, heads_kv=1, len_q=29, len_k=40, mask="additive",
                                             mask_shape="batch", mask_layout="transposed", mask_grad=True,
                                             key_padding=True, hidden_rows=True),
    "dropout_bool_mask_hidden_rows": Case(heads_q=3, heads_kv=3, len_q=33, len_k=33, dropout_p=0.3, mask="bool",
                                          mask_shape="2d", mask_layout="sliced", hidden_rows=True, is_causal=True,
                                          lse_grad=True),
    "head_128_integer_alignment_window": Case(batch=1, heads_q=3, heads_kv=1, len_q=24, len_k=33, dim_qk=100,
                                              dim_v=72, is_causal=True, causal_alignment=-5, window=(7, -1),
                                              scale=0.3),
}
SINK_RUNS = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")
             for name in testing.SINK_CASES for dtype in DTYPES]
SINK_RUNS += [pytest.param(name, DTYPES[i % len(DTYPES)], id=f"{name}-{str(DTYPES[i % len(DTYPES)])[6:]}")
              for i, name in enumerate(MIXED_SINK_CASES)]


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name,dtype", SINK_RUNS)
def test_emulated_sinks_match_reference(emulated, name, dtype, generator):
    """Forward (the long-query kernel, or the decode kernels for few query rows) and backward with sinks,
    each case in its own rotation of the layouts; the sinks' gradient (scores.sink_gradient of the
    kernels' out and lse) too."""
    cases = {**testing.SINK_CASES, **MIXED_SINK_CASES}
    rotation = list(cases).index(name) % len(LAYOUTS)
    inputs = testing.random_inputs(cases[name], dtype, rotation, generator)
    if name in MIXED_SINK_CASES:
        inputs = with_sinks(inputs, generator=generator)
    decode = emulated.decode_splits(inputs.query, inputs.key, inputs.value, inputs.case.dropout_p,
                                    *dropout_args(inputs.dropout())[1:])
    assert (decode > 0) == (inputs.case.len_q <= 16 and inputs.case.dropout_p == 0.0), decode
    actual = run_emulated(emulated, inputs)
    assert actual.grad_sinks is not None
    check_with_sinks(actual, inputs)


@pytest.mark.emulated_cuda
def test_emulated_sink_dominates_some_rows(emulated, generator):
    """Causal: a sink of 3 takes most of the weight of rows that see few keys and little of those that
    see many; a sink of 12 takes nearly all of every row's."""
    case = Case(heads_q=2, heads_kv=1, len_q=48, len_k=48, dim_qk=32, is_causal=True, lse_grad=True)
    inputs = with_sinks(testing.random_inputs(case, torch.float16, 1, generator), torch.tensor([3.0, 12.0]))
    actual = run_emulated(emulated, inputs)
    check_with_sinks(actual, inputs)
    weight = torch.exp(inputs.sinks.double().view(1, 2, 1) - testing.reference_for(inputs, torch.float64).lse)
    assert (weight[:, 0] > 0.9).any() and (weight[:, 0] < 0.5).any()
    assert (weight[:, 1] > 0.99).all()
    assert (actual.out[:, 1].abs() < 1e-2).all()


# The decode kernels with sinks (the combine kernel folds them in), forward only: every case of
# DECODE_CASES with one dtype, the odd ones with three forced splits.
SINK_DECODE_RUNS = [pytest.param(name, DTYPES[i % len(DTYPES)], "3" if i % 2 else None,
                                 id=f"{name}-{str(DTYPES[i % len(DTYPES)])[6:]}{'-3' if i % 2 else ''}")
                    for i, name in enumerate(DECODE_CASES)]


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name,dtype,splits", SINK_DECODE_RUNS)
def test_emulated_sinks_decode_kernels(emulated, name, dtype, splits, generator, monkeypatch):
    if splits is not None:
        monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE_SPLITS", splits)
    inputs = testing.random_inputs(DECODE_CASES[name], dtype, list(DECODE_CASES).index(name) % len(LAYOUTS),
                                   generator)
    inputs = with_sinks(inputs, generator=generator)
    assert emulated.decode_splits(inputs.query, inputs.key, inputs.value) > 0
    check_with_sinks(run_emulated_forward(emulated, inputs), inputs)


SINK_VARLEN_CASES = ("causal_gqa_lse", "cross_bottom_right", "window_softcap_alibi")


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name", SINK_VARLEN_CASES)
def test_emulated_sinks_varlen(emulated, name, generator):
    """Packed batches with the sinks of random_sinks (near, dominating, -inf per head): empty sequences,
    sequences without keys (rows 0 with lse sinks[h]); the sinks' gradient too. (test_varlen's own sink
    cases run in test_emulated_varlen_matches_padded_definition.)"""
    index = SINK_VARLEN_CASES.index(name)
    dtype = DTYPES[index % len(DTYPES)]
    inputs = varlen_tests.random_packed(varlen_tests.CASES[name], dtype, index, generator)
    inputs = dataclasses.replace(inputs, sinks=random_sinks(inputs.case.heads_q, generator))
    actual = run_emulated_varlen(emulated, inputs)
    assert actual.grad_sinks is not None
    testing.assert_close_to_reference(actual, varlen_tests.reference_of(inputs, torch.float64),
                                      varlen_tests.reference_of(inputs, dtype), dtype)
    assert check_keyless_sequences(actual, inputs) or name != "cross_bottom_right"


@pytest.mark.emulated_cuda
def test_emulated_sinks_of_minus_inf_change_nothing(emulated, generator):
    """Sinks of -inf give, bit for bit, the results of no sinks: the long-query kernel (hidden rows: lse -inf,
    out 0, no NaN, with dropout), the decode kernels and a packed batch."""
    minus_inf = torch.full((3,), float("-inf"))
    dense = Case(heads_q=3, heads_kv=1, len_q=27, len_k=35, mask="bool", key_padding=True, hidden_rows=True,
                 dropout_p=0.2, is_causal=True, lse_grad=True, window=(10, -1))
    decode = dataclasses.replace(DECODE_CASES["queries_over_keys_masks"], heads_q=3, heads_kv=1)
    for case, run in ((dense, run_emulated), (decode, run_emulated_forward)):
        inputs = testing.random_inputs(case, torch.float16, 3, generator)
        expected = {name: value.clone() for name, value in run(emulated, inputs).named().items()}
        with_minus_inf = with_sinks(dataclasses.replace(inputs, out=testing.nan_filled_like(inputs.out)), minus_inf)
        actual = run(emulated, with_minus_inf)
        for name, value in expected.items():
            assert torch.equal(getattr(actual, name), value), (case, name)
        assert torch.isneginf(actual.lse).any() and not torch.isnan(actual.lse).any()
        check_with_sinks(actual, with_minus_inf)
    keyless = varlen_tests.VarlenCase((3, 12, 5), (17, 0, 2), heads_q=2, heads_kv=1, is_causal=True,
                                      causal_alignment="bottom_right", lse_grad=True)
    packed = varlen_tests.random_packed(keyless, torch.bfloat16, 2, generator)
    expected = run_emulated_varlen(emulated, packed)
    actual = run_emulated_varlen(emulated, dataclasses.replace(packed, sinks=torch.full((packed.case.heads_q,),
                                                                                        float("-inf"))))
    for name, value in expected.named().items():
        assert torch.equal(getattr(actual, name), value), name
    assert (actual.grad_sinks == 0).all()


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("sinks, message", [
    (torch.zeros(2, dtype=torch.float64), "sinks must be float32"),
    (torch.zeros(2, dtype=torch.float16), "sinks must be float32"),
    (torch.zeros(3), "sinks must have shape"),
    (torch.zeros(1, 2), r"sinks must be \(H_q,\)"),
    (torch.zeros(4)[::2], "sinks must be contiguous"),
])
def test_emulated_glue_rejects_bad_sinks(emulated, sinks, message):
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match=message):
        emulated.forward(q, q, q, None, None, False, 0.25, torch.empty_like(q), sinks=sinks)
    packed = torch.zeros(8, 2, 16)
    bounds = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        emulated.forward_varlen(packed, packed, packed, bounds, bounds, 8, 8, False, 0.25, torch.empty_like(packed),
                                torch.empty(2, 8), 0.0, None, -1, -1, False, 0.0, None, 0, sinks=sinks)


def test_backend_takes_sinks():
    assert "sinks" in registry.get("cuda").takes_score_variants


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [*testing.SINK_CASES, *MIXED_SINK_CASES, *DECODE_CASES])
def test_cuda_sinks_match_reference(name, dtype, generator):
    """The sink cases, and the decode cases with sinks, through `attention(..., sinks=)` (the sinks'
    gradient through autograd)."""
    cases = {**testing.SINK_CASES, **MIXED_SINK_CASES, **DECODE_CASES}
    inputs = testing.random_inputs(cases[name], dtype, 1, generator, "cuda")
    if name not in testing.SINK_CASES:
        inputs = with_sinks(inputs, generator=generator)
    check_with_sinks(testing.run_attention(inputs, "cuda"), inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("name", SINK_VARLEN_CASES)
def test_cuda_sinks_varlen(name, generator):
    dtype = torch.float16
    inputs = varlen_tests.random_packed(varlen_tests.CASES[name], dtype, 1, generator)
    inputs = dataclasses.replace(inputs, sinks=random_sinks(inputs.case.heads_q, generator))
    on_gpu = varlen_tests.Packed(inputs.case, *(None if t is None else t.cuda() for t in (
        inputs.query, inputs.key, inputs.value, inputs.grad_out, inputs.grad_lse, inputs.alibi_slopes, inputs.sinks)))
    actual = run_emulated_varlen(None, on_gpu, backend=registry.get("cuda"))
    testing.assert_close_to_reference(actual, varlen_tests.reference_of(inputs, torch.float64),
                                      varlen_tests.reference_of(inputs, dtype), dtype)
    check_keyless_sequences(actual, on_gpu)


# ---- mask programs ---------------------------------------------------------------------------------

def program_runs(cases: dict, default_dtypes: int = 1) -> list:
    """(name, dtype, rotation) of every case in every dtype, case i in rotation i + (the dtype's index) of the
    layouts, so that each case meets three layouts; the first `default_dtypes` dtypes of each case (taken in
    turn from DTYPES) run by default, the others are marked slow (several tiles of 128 each way make these
    the longest emulated runs: 5-35 s each here)."""
    runs = []
    for i, name in enumerate(cases):
        for shift in range(len(DTYPES)):
            dtype = DTYPES[(i + shift) % len(DTYPES)]
            rotation = (i + shift) % len(LAYOUTS)
            runs.append(pytest.param(name, dtype, rotation, id=f"{name}-{str(dtype)[6:]}-{rotation}",
                                     marks=[pytest.mark.slow] if shift >= default_dtypes else []))
    return runs


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("name,dtype,rotation", program_runs(testing.PROGRAM_CASES))
def test_emulated_mask_programs_match_reference(emulated, name, dtype, rotation, generator):
    """testing.PROGRAM_CASES, forward and backward: random programs (EMPTY, FULL and partial tiles) with
    dropout, GQA, padding, softcap, ALiBi, windows, alignments, sinks and rows that see no key; the case with
    few query rows runs the decode kernels forward."""
    case = testing.PROGRAM_CASES[name]
    inputs = testing.random_inputs(case, dtype, rotation, generator)
    decode = emulated.decode_splits(inputs.query, inputs.key, inputs.value, case.dropout_p,
                                    *dropout_args(inputs.dropout())[1:])
    assert (decode > 0) == (case.len_q <= 16 and case.dropout_p == 0.0), decode
    testing.check_inputs(run_emulated(emulated, inputs), inputs)


# The decode kernels with programs that differ between the query heads of a GQA group (a key block is
# skipped only when every head's tile is EMPTY there), one split or three.
PROGRAM_DECODE_CASES = {
    "per_head_gqa_sinks": Case(heads_q=4, heads_kv=2, len_q=5, len_k=300, program="per_head_function", sinks=True),
    "documents_padding_group_of_16": Case(heads_q=8, heads_kv=1, len_q=2, len_k=600, program="documents",
                                          key_padding=True, dim_qk=24, dim_v=40),
}


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("splits", [None, "3"])
@pytest.mark.parametrize("name", list(PROGRAM_DECODE_CASES))
def test_emulated_mask_programs_in_decode_kernels(emulated, name, splits, generator, monkeypatch):
    if splits is not None:
        monkeypatch.setenv("FUSED_ATTN_CUDA_DECODE_SPLITS", splits)
    index = list(PROGRAM_DECODE_CASES).index(name)
    inputs = testing.random_inputs(PROGRAM_DECODE_CASES[name], DTYPES[index], index + 1, generator)
    assert emulated.decode_splits(inputs.query, inputs.key, inputs.value) == (3 if splits else index + 1)
    testing.check_inputs(run_emulated_forward(emulated, inputs), inputs)


def with_nan_outside_the_program(inputs: testing.Inputs, key_tiles: list[int], query_tiles: list[int] = ()):
    """`inputs` with NaN keys and values in the key tiles `key_tiles` and NaN queries in the query tiles
    `query_tiles` (of masks.TILE), which the program leaves EMPTY for every query, key and head."""
    tile = masks.TILE
    with torch.no_grad():
        for t in key_tiles:
            for tensor in (inputs.key, inputs.value):
                tensor[:, :, t * tile:(t + 1) * tile] = float("nan")
        for t in query_tiles:
            inputs.query[:, :, t * tile:(t + 1) * tile] = float("nan")
    return inputs


@pytest.mark.emulated_cuda
def test_emulated_empty_tiles_are_never_read(emulated, generator):
    """Key tile 2 and query tile 1 are EMPTY throughout the program (tile 0 of the keys FULL for the other
    query tiles, the rest partial): NaN keys, values and queries there give the results of clean ones, forward
    and backward. Were an EMPTY block visited, a NaN value would reach the output (0 · NaN) and the gradients."""
    case = Case(batch=1, heads_q=2, heads_kv=1, len_q=300, len_k=400, dim_qk=32, lse_grad=True)
    inputs = testing.random_inputs(case, torch.float16, 2, generator)

    def mask(b, h, q_idx, kv_idx):
        sparse = (kv_idx < masks.TILE) | ((q_idx * 7 + kv_idx * (h + 3)) % 5 != 0)
        return (q_idx // masks.TILE != 1) & (kv_idx // masks.TILE != 2) & sparse

    program = masks.mask_program(mask, None, case.heads_q, case.len_q, case.len_k)
    assert (program.tiles[0, :, :, 2] == masks.EMPTY).all() and (program.tiles[0, :, 1] == masks.EMPTY).all()
    assert (program.tiles[0, :, ::2, 0] == masks.FULL).all() and (program.tiles >= 0).sum() == 8
    inputs = dataclasses.replace(inputs, program=program)
    expected = testing.reference_for(inputs, torch.float64), testing.reference_for(inputs, torch.float16)
    actual = run_emulated(emulated, with_nan_outside_the_program(inputs, key_tiles=[2], query_tiles=[1]))
    testing.assert_close_to_reference(actual, *expected, torch.float16)
    assert (actual.grad_key[:, :, 2 * masks.TILE:3 * masks.TILE] == 0).all()


@pytest.mark.emulated_cuda
def test_emulated_decode_skips_key_blocks_empty_for_the_whole_group(emulated, generator):
    """Decode, GQA groups of 2 heads: key tile 1 is EMPTY for both (NaN keys and values there change nothing),
    key tile 0 for the first head of each group only (read for the second, hidden from the first by its
    state)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, len_q=3, len_k=400, dim_qk=32)
    inputs = testing.random_inputs(case, torch.bfloat16, 3, generator)

    def mask(b, h, q_idx, kv_idx):
        tile = kv_idx // masks.TILE
        return (tile != 1) & ((tile != 0) | (h % 2 == 1)) & ((kv_idx + q_idx) % 3 != h % 3)

    program = masks.mask_program(mask, None, case.heads_q, case.len_q, case.len_k)
    assert (program.tiles[0, :, 0, 1] == masks.EMPTY).all() and (program.tiles[0, ::2, 0, 0] == masks.EMPTY).all()
    assert (program.tiles[0, 1::2, 0, 0] >= 0).all()
    inputs = dataclasses.replace(inputs, program=program)
    assert emulated.decode_splits(inputs.query, inputs.key, inputs.value) > 0
    expected = testing.reference_for(inputs, torch.float64), testing.reference_for(inputs, torch.bfloat16)
    actual = run_emulated_forward(emulated, with_nan_outside_the_program(inputs, key_tiles=[1]))
    testing.assert_close_to_reference(actual, *expected, torch.bfloat16)


def program_tensors(heads=2, q_tiles=1, k_tiles=1, partial=1):
    """A valid (tiles, bits) pair for a (1, heads, ≤128·q_tiles, ≤128·k_tiles) call: every tile partial 0."""
    return (torch.zeros(1, heads, q_tiles, k_tiles, dtype=torch.int32),
            torch.zeros(partial, masks.TILE, masks.WORDS, dtype=torch.int32))


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("change, message", [
    (dict(block_bits=None), "flash_(for|back)ward: block_tiles, block_bits: expected both or neither"),
    (dict(block_tiles=torch.zeros(1, 2, 1, 1, dtype=torch.int64)), "flash_(for|back)ward: block_tiles: expected int32"),
    (dict(block_tiles=torch.zeros(1, 2, 2, 1, dtype=torch.int32)), "flash_(for|back)ward: block_tiles: expected shape"),
    (dict(block_bits=torch.zeros(1, masks.TILE, 8, dtype=torch.int32)), "flash_(for|back)ward: block_bits: expected a"),
    (dict(block_tiles=torch.ones(1, 2, 1, 1, dtype=torch.int32)), "flash_(for|back)ward: block_tiles: expected -1"),
])
def test_emulated_glue_rejects_bad_programs(emulated, change, message):
    q = torch.zeros(1, 2, 8, 16)
    tiles, bits = program_tensors()
    args = dict(block_tiles=tiles, block_bits=bits)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        emulated.forward(q, q, q, None, None, False, 0.25, torch.empty_like(q), **args)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        emulated.backward(q, q, q, None, None, False, 0.25, q, lse, q, None, 0.0, None, None, -1, -1, False, 0.0,
                          None, 0, args["block_tiles"], args["block_bits"])


@pytest.mark.emulated_cuda
def test_emulated_varlen_glue_refuses_programs(emulated):
    packed = torch.zeros(8, 2, 16)
    bounds = torch.tensor([0, 8], dtype=torch.int32)
    tiles, bits = program_tensors()
    args = (packed, packed, packed, bounds, bounds, 8, 8, False, 0.25)
    with pytest.raises(RuntimeError, match="flash_forward_varlen: block_tiles: a mask program is not taken"):
        emulated.forward_varlen(*args, torch.empty_like(packed), torch.empty(2, 8), 0.0, None, -1, -1, False, 0.0,
                                None, 0, tiles, bits)
    with pytest.raises(RuntimeError, match="flash_backward_varlen: block_tiles: a mask program is not taken"):
        emulated.backward_varlen(*args, packed, torch.zeros(2, 8), packed, None, 0.0, None, -1, -1, False, 0.0, None,
                                 0, tiles, bits)


def test_backend_runs_a_packed_batch_with_a_program_one_sequence_at_a_time(monkeypatch):
    """The varlen kernels do not take programs (the glue refuses them, above): the backend runs such a batch
    through the per-sequence path, each sequence with its row of the program."""
    from fused_attn.backends import packed
    from fused_attn.problem import Problem

    backend = registry.get("cuda")
    q = torch.empty(1, 2, 8, 16, dtype=torch.float16)
    program = Problem.of(q, q, q, None, None, False, 0.0)._replace(score_features=("mask_program",), varlen=True)
    assert not any("mask program" in reason for reason in backend.refusals(program))
    tiles, bits = program_tensors()
    variant = dataclasses.replace(PLAIN, block_tiles=tiles, block_bits=bits)
    calls = []
    monkeypatch.setattr(packed, "forward", lambda *args: calls.append(("forward", args[-1])))
    monkeypatch.setattr(packed, "backward", lambda *args: calls.append(("backward", args[-1])))
    tensor = torch.zeros(8, 2, 16)
    bounds = torch.tensor([0, 8], dtype=torch.int32)
    args = (tensor, tensor, tensor, bounds, bounds, 8, 8, False, 0.25)
    backend.forward_varlen(*args, torch.empty_like(tensor), torch.empty(2, 8), None, variant)
    backend.backward_varlen(*args, tensor, torch.zeros(2, 8), tensor, None, None, variant)
    assert [(name, given is variant) for name, given in calls] == [("forward", True), ("backward", True)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [*testing.PROGRAM_CASES, *PROGRAM_DECODE_CASES])
def test_cuda_mask_programs_match_reference(name, dtype, generator):
    """Through `attention(..., attn_mask=program)` (the program on the device, as a user passes it)."""
    cases = {**testing.PROGRAM_CASES, **PROGRAM_DECODE_CASES}
    inputs = testing.random_inputs(cases[name], dtype, 1, generator, "cuda")
    testing.check_inputs(testing.run_attention(inputs, "cuda"), inputs)


# ---- the backend's registration -------------------------------------------------------------------

def test_backend_is_registered_after_triton():
    names = registry.names()
    assert names.index("triton") < names.index("cuda") < names.index("cpu") < names.index("reference")
    assert registry.get("cuda").devices == ("cuda",)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without a GPU")
def test_backend_says_why_it_is_unavailable():
    reason = registry.get("cuda").unavailable()
    assert reason and ("CUDA" in reason or "extension" in reason)
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(registry.BackendError, match="cuda: "):
        fused_attn.attention(q, q, q, backend="cuda")


def test_backend_refusals_name_each_reason():
    from fused_attn.problem import Problem

    q = torch.empty(2, 4, 8, 300, dtype=torch.float64)
    v = torch.empty(2, 2, 8, 16, dtype=torch.float64)
    mask = torch.empty(8, 8, requires_grad=True)
    problem = Problem.of(q, v, v, mask, None, False, 0.1)
    reasons = " | ".join(registry.get("cuda").refusals(problem))
    for expected in ("CUDA tensors only", "dtype torch.float64", "head dims up to 256"):
        assert expected in reasons
    assert "dropout" not in reasons and "attn_mask" not in reasons
    fine = Problem.of(torch.empty(1, 2, 8, 64, dtype=torch.float16),
                      torch.empty(1, 1, 8, 64, dtype=torch.float16),
                      torch.empty(1, 1, 8, 64, dtype=torch.float16), None, None, True, 0.0)
    assert registry.get("cuda").refusals(fine) == ["runs on CUDA tensors only, got device cpu"]


DEFAULT_BUILD = "sm_80,sm_86,sm_90,sm_100,compute_120,sm_120"  # what setup.py records for its default arch list


@pytest.mark.parametrize("recorded, capability, refused", [
    (DEFAULT_BUILD, (8, 0), False), (DEFAULT_BUILD, (8, 9), False),  # Ada runs the sm_86 cubin
    (DEFAULT_BUILD, (9, 0), False), (DEFAULT_BUILD, (10, 3), False), (DEFAULT_BUILD, (12, 1), False),
    (DEFAULT_BUILD, (13, 0), False),  # the PTX, compiled by the driver
    (DEFAULT_BUILD, (11, 0), True),  # neither a cubin of its major nor PTX of an earlier one
    ("sm_80,sm_86,sm_90", (10, 0), True), ("sm_80,sm_86,sm_90", (12, 0), True),  # the earlier default on Blackwell
    ("sm_90a", (9, 0), False), ("sm_90a,sm_100a", (10, 3), True),  # architecture-specific cubins: their own alone
    ("sm_80,compute_80", (12, 0), False), ("sm_90", (8, 6), True),
    ("sm_100f", (10, 3), False), ("sm_100f", (12, 0), True),  # family-specific: its major's later minors
    ("sm_100x", (9, 0), False),  # a name it cannot read is left to the launch
])
def test_backend_refuses_a_device_its_kernels_were_not_built_for(recorded, capability, refused, monkeypatch):
    """A device that none of the extension's cubins or PTX (fused_attn._C.cuda_architectures, recorded at the build)
    runs on is refused, with its capability and what was built, rather than failing with "no kernel image"."""
    from types import SimpleNamespace

    from fused_attn import _extension
    from fused_attn.problem import Problem

    monkeypatch.setattr(_extension, "_C", SimpleNamespace(cuda_architectures=recorded))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    problem = Problem(torch.device("cuda", 0), torch.float16, 1, 2, 2, 64, 64, 64, 64, False, 0.0, None, False, False)
    reasons = registry.get("cuda").device_refusals(problem)
    name = f"{capability[0]}.{capability[1]}"
    expected = [f"fused_attn._C has no kernel image for compute capability {name}: it was built for "
                f"{recorded.replace(',', ', ')} (TORCH_CUDA_ARCH_LIST at install; reinstall with {name} in it)"]
    assert reasons == (expected if refused else [])


# ---- on a CUDA device -----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("rotation", range(len(LAYOUTS)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [*ALL_CASES])
def test_cuda_matches_reference(name, dtype, rotation, generator):
    """Every case of this file, training and score variants included, through `attention`."""
    inputs = testing.random_inputs(ALL_CASES[name], dtype, rotation, generator, "cuda")
    testing.check_inputs(testing.run_attention(inputs, "cuda"), inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(varlen_tests.CASES))
def test_cuda_varlen_matches_padded_definition(name, dtype, generator):
    inputs = varlen_tests.random_packed(varlen_tests.CASES[name], dtype, 1, generator)
    on_gpu = varlen_tests.Packed(inputs.case, *(None if t is None else t.cuda() for t in (
        inputs.query, inputs.key, inputs.value, inputs.grad_out, inputs.grad_lse, inputs.alibi_slopes, inputs.sinks)))
    actual = run_emulated_varlen(None, on_gpu, backend=registry.get("cuda"))
    testing.assert_close_to_reference(actual, varlen_tests.reference_of(inputs, torch.float64),
                                      varlen_tests.reference_of(inputs, dtype), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_backward_is_deterministic(dtype, generator):
    case = Case(heads_q=4, heads_kv=1, len_q=300, len_k=300, dim_qk=64, is_causal=True, lse_grad=True,
                scale=0.2)
    inputs = testing.random_inputs(case, dtype, 4, generator, "cuda")
    first, second = testing.run_attention(inputs, "cuda"), testing.run_attention(inputs, "cuda")
    for name in ("grad_query", "grad_key", "grad_value"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


# ---- the emulation itself -------------------------------------------------------------------------

@pytest.mark.emulated_cuda
@pytest.mark.parametrize("a_col", [False, True])
@pytest.mark.parametrize("b_col", [False, True])
def test_emulated_wmma_follows_the_fragment_layouts(emulated, a_col, b_col, generator):
    a = torch.randn(16, 16, generator=generator).half()
    b = torch.randn(16, 16, generator=generator).half()
    a_storage = a.t().contiguous() if a_col else a  # column-major: element (i, k) at k * 16 + i
    b_storage = b.t().contiguous() if b_col else b
    product = emulated.wmma_product(a_storage, b_storage, a_col, b_col)
    torch.testing.assert_close(product.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-5)


@pytest.mark.emulated_cuda
@pytest.mark.parametrize("lane_mask, width", [(1, 32), (16, 32), (5, 32), (4, 4)])
def test_emulated_shuffle_xor(emulated, lane_mask, width):
    values = torch.arange(64, dtype=torch.float32) * 3 + 1
    lanes = torch.arange(64)
    source = lanes ^ lane_mask
    source = torch.where(source // width == lanes // width, source, lanes)
    assert torch.equal(emulated.shuffle_xor(values, lane_mask, width), values[source])


@pytest.mark.emulated_cuda
def test_emulation_rejects_misaligned_fragments(emulated):
    with pytest.raises(RuntimeError, match="256-bit aligned"):
        emulated.misaligned_wmma()


@pytest.mark.emulated_cuda
def test_emulation_reports_a_divergent_barrier(emulated):
    with pytest.raises(RuntimeError, match="deadlock"):
        emulated.divergent_barrier(300)


@pytest.mark.emulated_cuda
def test_emulation_shows_a_missing_barrier(emulated):
    """The fibers of a block run in a random order: a read of what another warp writes with no __syncthreads
    between comes before the write in some threads, as it may on a GPU, not after it in all."""
    read = emulated.missing_barrier()
    assert torch.isnan(read).any() and (read == 1).any(), read


@pytest.mark.emulated_cuda
def test_emulated_shared_memory_starts_as_nan(emulated):
    assert torch.isnan(emulated.unwritten_shared()).all()


@pytest.mark.cuda
def test_cuda_ops_pass_opcheck(generator):
    from fused_attn import ops

    case = Case(heads_q=4, heads_kv=2, len_q=24, len_k=40, dim_qk=32, dim_v=16, is_causal=True, mask="bool",
                mask_shape="batch", mask_layout="transposed", key_padding=True)
    inputs = testing.random_inputs(case, torch.float16, 1, generator, "cuda")
    q, k, v = (t.requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    mask = inputs.mask_view()
    args = (q, k, v, mask, inputs.key_padding_mask, True, 0.2, 0.0, None, False, "cuda")
    torch.library.opcheck(ops.attention_fwd, args)
    out, lse = ops.attention_fwd(*args)
    torch.library.opcheck(ops.attention_bwd, (inputs.grad_out, None, q.detach(), k.detach(), v.detach(),
                                              out.detach(), lse.detach(), mask, inputs.key_padding_mask, True,
                                              0.2, 0.0, None, "cuda"))
