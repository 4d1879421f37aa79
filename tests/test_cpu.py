"""The cpu backend (csrc/cpu): the DESIGN.md criterion over features × dtypes × layouts, gradcheck,
determinism across runs and thread counts, fully hidden rows, errors, and every instruction set."""

import contextlib
import dataclasses
import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fused_attn
from fused_attn import masks, testing
from fused_attn.backends import registry
from fused_attn.problem import lse_dtype

pytestmark = pytest.mark.skipif(registry.get("cpu").unavailable() is not None,
                                reason=str(registry.get("cpu").unavailable()))

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
LAYOUTS = testing.LAYOUTS


def flash_forward(q, k, v, mask=None, padding=None, causal=False, scale=None, out=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lse = torch.ops.fused_attn.flash_forward(q, k, v, mask, padding, causal, scale, out)
    return out, lse


def flash_backward(q, k, v, mask, padding, causal, scale, out, lse, grad_out, grad_lse=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.fused_attn.flash_backward(q, k, v, mask, padding, causal, scale, out, lse,
                                               grad_out, grad_lse)


def make_problem(generator, dtype, feature, layouts, batch=2, heads=4):
    """Inputs of one case, each tensor in its own layout; masks viewed as (B, H_q, L_q, L_k)."""
    len_q, len_k = {"lengths": (37, 21), "lengths_long_keys": (13, 45), "blocks": (70, 83)}.get(feature, (24, 24))
    dim, dim_v = {"head_dims": (17, 9), "odd_dims": (3, 5)}.get(feature, (16, 16))
    heads_kv = 2 if feature == "gqa" else (1 if feature == "mqa" else heads)
    shapes = [(batch, heads, len_q, dim), (batch, heads_kv, len_k, dim), (batch, heads_kv, len_k, dim_v)]
    q, k, v = (testing.strided(torch.randn(shape, generator=generator).to(dtype), layouts[i % len(layouts)])
               for i, shape in enumerate(shapes))
    mask = padding = None
    if feature in ("bool_mask", "additive_mask", "blocks"):
        kind = "additive" if feature != "bool_mask" else "bool"
        # Broadcast over heads: the kernel must read it through a stride-0 dimension.
        mask = testing.random_mask((batch, 1, len_q, len_k), kind, dtype, generator=generator)
        mask = testing.strided(mask, layouts[3 % len(layouts)]).expand(batch, heads, len_q, len_k)
    if feature in ("key_padding", "blocks"):
        padding = torch.rand(batch, len_k, generator=generator) < 0.3
    causal = feature in ("causal", "blocks", "lengths", "lengths_long_keys", "gqa")
    scale = 0.37 if feature == "scale" else None
    return q, k, v, mask, padding, causal, scale


FEATURES = ["plain", "causal", "bool_mask", "additive_mask", "key_padding", "gqa", "mqa", "lengths",
            "lengths_long_keys", "head_dims", "odd_dims", "scale", "blocks"]
LAYOUT_ROTATIONS = [LAYOUTS, LAYOUTS[2:] + LAYOUTS[:2]]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 queries × 24 keys, so that small problems cross several blocks and partial ones."""
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_Q", "16")
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_K", "24")


def run_and_check(generator, dtype, feature, layouts):
    q, k, v, mask, padding, causal, scale = make_problem(generator, dtype, feature, layouts)
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    out = testing.nan_filled_like(testing.strided(torch.zeros(out_shape, dtype=dtype), layouts[4]))
    out, lse = flash_forward(q, k, v, mask, padding, causal, scale, out)
    assert lse.dtype == lse_dtype(dtype)
    grad_out = testing.strided(torch.randn(out_shape, generator=generator).to(dtype), layouts[1])
    grads = flash_backward(q, k, v, mask, padding, causal, scale, out, lse, grad_out)
    for grad, tensor in zip(grads, (q, k, v)):
        assert grad.shape == tensor.shape and grad.dtype == tensor.dtype
        # The fake kernel promises empty_like's layout (torch.compile relies on it).
        assert grad.stride() == torch.empty_like(tensor).stride()
    testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out,
                                    attn_mask=mask, key_padding_mask=padding, is_causal=causal,
                                    scale=scale)


@pytest.mark.parametrize("layouts", LAYOUT_ROTATIONS, ids=["rot0", "rot2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
def test_meets_criterion(generator, small_blocks, feature, dtype, layouts):
    run_and_check(generator, dtype, feature, layouts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", ["plain", "blocks", "gqa"])
def test_meets_criterion_with_default_blocks(generator, feature, dtype):
    run_and_check(generator, dtype, feature, LAYOUTS[::-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_own_micro_kernel_meets_criterion(generator, small_blocks, monkeypatch, dtype):
    """FUSED_ATTN_CPU_BRGEMM=0: the register-blocked product instead of oneDNN's (bf16/fp16 via float)."""
    monkeypatch.setenv("FUSED_ATTN_CPU_BRGEMM", "0")
    run_and_check(generator, dtype, "blocks", LAYOUTS)


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


ISA_FLAGS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
             "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}}


def run_on_instruction_set(isa, script):
    """`script` in a fresh process whose kernels are the copy compiled for `isa` (FUSED_ATTN_CPU_ISA), with
    small blocks; skips where the CPU or ATen does not run that copy."""
    if not ISA_FLAGS[isa] <= cpu_flags():
        pytest.skip(f"this CPU cannot run {isa}")
    if isa.startswith("avx512") and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("ATen does not choose AVX512 here")
    env = dict(os.environ, FUSED_ATTN_CPU_ISA=isa, FUSED_ATTN_CPU_BLOCK_Q="16", FUSED_ATTN_CPU_BLOCK_K="24")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("isa", list(ISA_FLAGS))
def test_every_instruction_set_meets_criterion(isa):
    """Each compiled copy of the kernels, forced with FUSED_ATTN_CPU_ISA in a fresh process; dropout
    and the score variants included (each copy has its own Philox rounds and tanh), and the decode cases
    (each copy reads bf16, float and 8-bit cache rows with its own vector loads)."""
    run_on_instruction_set(isa, (
        "import torch, tests.test_cpu as t\n"
        "g = torch.Generator().manual_seed(1)\n"
        "for dtype in t.DTYPES:\n"
        "    for feature in ('blocks', 'head_dims', 'gqa', 'plain'):\n"
        "        t.run_and_check(g, dtype, feature, t.LAYOUTS)\n"
        "    t.check_extreme_maxima(g, dtype)\n"
        "    for case in t.testing.NAN_CASES.values() if dtype in (torch.float32, torch.bfloat16) else ():\n"
        "        inputs = t.testing.nan_poisoned(t.testing.random_inputs(case, dtype, 1, g))\n"
        "        t.testing.check_nan_inputs(t.testing.run_attention(inputs, 'cpu'), inputs)\n"
        "    for case in (t.TRAINING_CASES['plain'], t.TRAINING_CASES['bias_heads_causal_dropout'],\n"
        "                 t.VARIANT_CASES['everything'], t.VARIANT_CASES['softcap_alibi_additive'],\n"
        "                 *t.DECODE_CASES.values()):\n"
        "        inputs = t.testing.random_inputs(case, dtype, 1, g)\n"
        "        t.testing.check_inputs(t.testing.run_attention(inputs, 'cpu'), inputs)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    t.check_plain_paged_decode(g, dtype)\n"))


def test_aten_cpu_capability_is_honoured(monkeypatch):
    """ATEN_CPU_CAPABILITY=default caps the kernels too: forcing avx2 above it is refused."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import torch, fused_attn\n"
              "q = torch.randn(1, 1, 4, 8)\n"
              "torch.ops.fused_attn.flash_forward(q, q, q, None, None, False, 1.0, torch.empty_like(q))\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", FUSED_ATTN_CPU_ISA="avx2")
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0 and "FUSED_ATTN_CPU_ISA" in result.stderr


def kernels_in_fresh_process(dtype, **env) -> str:
    """cpu_kernels in a process whose kernel switches are `env` alone (unset: the defaults)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = f"import torch, fused_attn\nprint(torch.ops.fused_attn.cpu_kernels(torch.{dtype}))\n"
    inherited = {name: value for name, value in os.environ.items()
                 if name not in ("FUSED_ATTN_CPU_ISA", "FUSED_ATTN_CPU_BRGEMM")}
    result = subprocess.run([sys.executable, "-c", script], env=dict(inherited, **env), cwd=root,
                            capture_output=True, text=True, timeout=300, check=True)
    return result.stdout.strip()


def test_cpu_kernels_names_what_runs():
    """What the benchmark records: the instruction-set copy, and bf16 products kept in bf16 wherever
    the copy built for AVX512-BF16 runs (oneDNN's bf16 brgemm, with or without AMX)."""
    for dtype in DTYPES:
        copy, products = torch.ops.fused_attn.cpu_kernels(dtype).split("; ")
        assert copy in ("DEFAULT", "AVX2", "AVX512", "AVX512_BF16") and products
    if not ISA_FLAGS["avx512_bf16"] <= cpu_flags() or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU has no AVX512-BF16 copy")
    native = kernels_in_fresh_process("bfloat16")
    assert native.startswith("AVX512_BF16; oneDNN brgemm on ") and "float" not in native
    assert "converted to float, micro-kernel" in kernels_in_fresh_process("bfloat16", FUSED_ATTN_CPU_BRGEMM="0")
    if "amx_bf16" not in cpu_flags():  # AVX512 alone has no bf16 products: they run in float
        assert "converted to float" in kernels_in_fresh_process("bfloat16", FUSED_ATTN_CPU_ISA="avx512")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_through_attention_and_autograd(generator, dtype):
    q, k, v = (torch.randn(2, 4, 19, 16, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    mask = testing.random_mask((19, 19), "bool", dtype, generator=generator)
    out, lse = fused_attn.attention(q, k, v, attn_mask=mask, is_causal=True, return_lse=True, backend="cpu")
    grad_out = torch.randn(out.shape, generator=generator).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out,
                                    attn_mask=mask.expand(2, 4, 19, 19), is_causal=True)


def test_split_heads_packed_projection(generator):
    """The three slices of one packed (L, B, 3E) projection, read in place; output merged (L, B, E)."""
    packed = torch.randn(23, 2, 3 * 32, generator=generator, requires_grad=True)
    q, k, v = packed.chunk(3, dim=-1)
    out = fused_attn.split_heads_attention(q, k, v, num_heads=4, batch_first=False, is_causal=True,
                                           backend="cpu")
    expected = fused_attn.split_heads_attention(q, k, v, num_heads=4, batch_first=False,
                                                is_causal=True, backend="reference")
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape, generator=generator)
    torch.testing.assert_close(torch.autograd.grad(out, packed, grad)[0],
                               torch.autograd.grad(expected, packed, grad)[0])


def test_gradcheck_float64(generator, small_blocks):
    q = torch.randn(1, 4, 20, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 27, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 27, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = testing.random_mask((1, 1, 20, 27), "additive", torch.float64, generator=generator)
    padding = torch.rand(1, 27, generator=generator) < 0.2
    # Every row sees key 0: a hidden row's lse is -inf, where finite differences are NaN.
    mask[..., 0], padding[:, 0] = 0.0, False

    def both_outputs(q, k, v):  # lse is an output too: its gradient enters the backward as grad_lse
        return fused_attn.attention(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True,
                                    key_padding_mask=padding, return_lse=True, backend="cpu")

    assert torch.autograd.gradcheck(both_outputs, (q, k, v))


def test_grad_lse_matches_reference(generator):
    q, k, v = (torch.randn(2, 3, 33, 8, generator=generator, requires_grad=True) for _ in range(3))
    weights = torch.randn(2, 3, 33, generator=generator)
    grad_out = torch.randn(2, 3, 33, 8, generator=generator)
    results = []
    for backend in ("cpu", "reference"):
        out, lse = fused_attn.attention(q, k, v, is_causal=True, return_lse=True, backend=backend)
        loss = (out * grad_out).sum() + (lse * weights).sum()
        results.append(torch.autograd.grad(loss, (q, k, v)))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_fully_hidden_rows_give_zero_output_minus_inf_lse_zero_gradients(generator, small_blocks):
    q, k, v = (torch.randn(1, 2, 30, 8, generator=generator) for _ in range(3))
    mask = torch.rand(1, 2, 30, 30, generator=generator) < 0.7
    mask[:, :, 3] = False                        # a row hidden by the mask
    padding = torch.zeros(1, 30, dtype=torch.bool)
    out = testing.nan_filled_like(q)
    out, lse = flash_forward(q, k, v, mask, padding, False, None, out)
    assert torch.all(out[:, :, 3] == 0) and torch.all(lse[:, :, 3] == float("-inf"))
    grads = flash_backward(q, k, v, mask, padding, False, None, out, lse, torch.randn_like(out))
    assert torch.all(grads[0][:, :, 3] == 0)
    for grad in grads:
        assert torch.isfinite(grad).all()
    # Every key padded: every row hidden.
    padding = torch.ones(1, 30, dtype=torch.bool)
    out, lse = flash_forward(q, k, v, None, padding, True, None, testing.nan_filled_like(q))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    grads = flash_backward(q, k, v, None, padding, True, None, out, lse, torch.randn_like(out))
    assert all(torch.all(grad == 0) for grad in grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(testing.NAN_CASES))
def test_nan_inputs_give_nan_rows(generator, small_blocks, name, dtype):
    """A NaN query element and a NaN key element on the long-query (rows over several key blocks), decode (split
    keys) and program paths."""
    inputs = testing.nan_poisoned(testing.random_inputs(testing.NAN_CASES[name], dtype, 1, generator))
    testing.check_nan_inputs(testing.run_backend(registry.get("cpu"), inputs), inputs)


def test_bf16_gradients_of_nearly_one_hot_rows_beyond_the_criterion_less_often_than_sdpas(small_blocks):
    """Where a row's softmax is nearly one-hot (logits of standard deviation 10 over documents of a few keys), dQ in
    bf16 can exceed the criterion: like every FlashAttention backward, the kernels take Σ dO·O from the output
    rounded to bf16, whose rounding survives the cancellation in dP - Σ dO·O, while the bf16 reference's autograd
    cancels exactly. PyTorch's SDPA, flash and math, on the same inputs (those whose rows all see a key): measured
    ours beyond it in 5 of 36 problems, SDPA's in 23 and 22; here: ours in at most a quarter, and in fewer than
    either of SDPA's, whose median error ours does not exceed."""
    case = testing.Case(batch=1, heads_q=1, heads_kv=1, len_q=9, len_k=11, dim_qk=40, scale=1.7,
                        program="documents_causal")
    beyond = {"ours": 0, "flash": 0, "math": 0}
    errors = {name: [] for name in beyond}
    problems = 0
    for seed in range(100):
        inputs = testing.random_inputs(case, torch.bfloat16, 0, torch.Generator().manual_seed(seed))
        visible = masks.dense_of(inputs.variant().block_tiles, inputs.variant().block_bits, case.len_q, case.len_k)
        if not visible.any(-1).all():  # SDPA gives NaN where a row sees no key
            continue
        problems += 1
        exact, same_dtype = (testing.reference_for(inputs, dtype) for dtype in (torch.float64, torch.bfloat16))
        allowed = testing.allowed_error("grad_query", exact.grad_query, same_dtype.grad_query, torch.bfloat16)
        grads = {"ours": testing.run_attention(inputs, "cpu").grad_query}
        for name, kernel in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
            q, k, v = (t.detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
            with sdpa_kernel(kernel):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=case.scale)
            grads[name] = torch.autograd.grad(out, q, inputs.grad_out)[0]
        for name, grad in grads.items():
            errors[name].append(testing.max_error(grad, exact.grad_query))
            beyond[name] += errors[name][-1] > allowed
    assert problems >= 20
    assert beyond["ours"] <= problems // 4 and beyond["ours"] < min(beyond["flash"], beyond["math"]), beyond
    median = {name: sorted(values)[len(values) // 2] for name, values in errors.items()}
    assert median["ours"] <= min(median["flash"], median["math"]), median


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_with_extreme_maxima_meet_criterion(generator, small_blocks, dtype):
    check_extreme_maxima(generator, dtype)


def check_extreme_maxima(generator, dtype):
    """Row maxima far from 0: an additive mask at the dtype's lowest value (as many models build
    their masks) and logits in the hundreds. bf16/fp16 P are then computed with x·scale − max formed
    before the change of base, not folded into one product. The backward is checked where the
    lse can hold log(row sum) next to the max: not for rows whose every score is at the lowest value
    (there the lse rounds to the max itself; see the README)."""
    q, k, v = (torch.randn(2, 2, 30, 16, generator=generator).to(dtype) for _ in range(3))
    lowest = torch.finfo(dtype).min
    partly = torch.zeros(2, 1, 30, 30, dtype=dtype)
    partly[..., 7, 5:] = lowest
    wholly = partly.clone()
    wholly[..., 4, :] = lowest
    sharp_q = (q.double() * 60).to(dtype)  # scores of a few hundred after scaling
    for query, attn_mask, backward in ((q, wholly, False), (q, partly, True), (sharp_q, None, True)):
        attn_mask = None if attn_mask is None else attn_mask.expand(2, 2, 30, 30)
        out, lse = flash_forward(query, k, v, attn_mask, None, False, None, testing.nan_filled_like(query))
        results, grad_out = testing.Results(out, lse), None
        if backward:
            grad_out = torch.randn(out.shape, generator=generator).to(dtype)
            results = testing.Results(out, lse, *flash_backward(query, k, v, attn_mask, None, False, None,
                                                                out, lse, grad_out))
        testing.check_against_reference(results, query, k, v, grad_out, attn_mask=attn_mask)


JUMP_CASES = {
    "plain": testing.Case(batch=1, len_q=96, len_k=96),
    "causal": testing.Case(batch=1, len_q=96, len_k=96, is_causal=True),
    "documents": testing.Case(batch=1, len_q=96, len_k=96, program="documents"),
    # The cap as the one variant, and a cap of 5, which keeps every score within (-5, 5).
    "softcap": testing.Case(batch=1, len_q=96, len_k=96, softcap=30.0),
    "softcap_5_causal": testing.Case(batch=1, len_q=96, len_k=96, softcap=5.0, is_causal=True),
    "softcap_padding": testing.Case(batch=1, len_q=96, len_k=96, softcap=30.0, key_padding=True),
    "softcap_alibi_causal": testing.Case(batch=1, len_q=96, len_k=96, softcap=30.0, alibi="heads", is_causal=True),
    "alibi": testing.Case(batch=1, len_q=96, len_k=96, alibi="batch"),
    "decode_gqa": testing.Case(batch=1, heads_q=4, heads_kv=1, len_q=3, len_k=96),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(JUMP_CASES))
def test_rows_whose_maxima_jump_meet_criterion(generator, monkeypatch, dtype, name):
    """Row maxima from about 1 to 25, and keys whose scores rise threefold from key 48 on, inside the first key
    block of 80: a row's shift (csrc/cpu/flash_kernel.h, kShiftSlack) is kept, rises inside a pass over the scores
    (the weights before rescaled) and rises from one key block to the next (the accumulator rescaled), each on some
    rows, forward and backward."""
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_Q", "16")
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_K", "80")
    inputs = testing.random_inputs(JUMP_CASES[name], dtype, 1, generator)
    with torch.no_grad():
        rows = torch.arange(inputs.query.shape[2], dtype=torch.float64)
        inputs.query.copy_((inputs.query.double() * ((rows * 7) % 5 * 2.5 + 0.3)[:, None]).to(dtype))
        inputs.key[:, :, 48:] = (inputs.key[:, :, 48:].double() * 3).to(dtype)
    exact, same_dtype = testing.reference_for(inputs, torch.float64), testing.reference_for(inputs, dtype)
    testing.assert_close_to_reference(testing.run_backend(registry.get("cpu"), inputs), exact, same_dtype, dtype)


def test_no_keys_and_empty_batch(generator):
    q = torch.randn(2, 2, 5, 4, generator=generator)
    k = torch.randn(2, 2, 0, 4)
    out, lse = flash_forward(q, k, k, out=testing.nan_filled_like(q))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    dq, dk, dv = flash_backward(q, k, k, None, None, False, None, out, lse, torch.randn_like(out))
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == k.shape
    empty = torch.randn(0, 2, 5, 4)
    out, lse = flash_forward(empty, empty, empty, out=torch.empty_like(empty))
    assert lse.shape == (0, 2, 5)


def deterministic_case(generator, dtype):
    q = torch.randn(2, 4, 150, 32, generator=generator).to(dtype)
    k = torch.randn(2, 2, 170, 32, generator=generator).to(dtype)
    v = torch.randn(2, 2, 170, 32, generator=generator).to(dtype)
    grad_out = torch.randn(2, 4, 150, 32, generator=generator).to(dtype)
    return q, k, v, grad_out


def gradients(q, k, v, grad_out, causal):
    out, lse = flash_forward(q, k, v, None, None, causal, None, torch.empty_like(grad_out))
    return (out, lse) + tuple(flash_backward(q, k, v, None, None, causal, None, out, lse, grad_out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_deterministic_across_runs_and_thread_counts(generator, small_blocks, dtype, causal):
    case = deterministic_case(generator, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first, second = gradients(*case, causal), gradients(*case, causal)
        torch.set_num_threads(1)
        single = gradients(*case, causal)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


TRAINING_CASES = {
    "plain": testing.Case(dropout_p=0.3, len_q=37, len_k=70),
    "causal_additive": testing.Case(dropout_p=0.2, is_causal=True, mask="additive", mask_shape="heads_keys",
                                    len_q=33, len_k=75),
    "gqa_padding_lse_grad": testing.Case(dropout_p=0.5, heads_q=4, heads_kv=2, key_padding=True, lse_grad=True,
                                         dim_qk=24, dim_v=8),
    "hidden_rows_bool": testing.Case(dropout_p=0.9, hidden_rows=True, mask="bool", mask_shape="batch",
                                     is_causal=True),
    "bias_full": testing.Case(mask="additive", mask_grad=True, mask_layout="transposed", len_q=29, len_k=37),
    "bias_heads_causal_dropout": testing.Case(mask="additive", mask_shape="heads_keys", mask_grad=True,
                                              is_causal=True, dropout_p=0.2, heads_q=4, heads_kv=2),
    "bias_2d_padding_lse_grad": testing.Case(mask="additive", mask_shape="2d", mask_grad=True,
                                             key_padding=True, lse_grad=True, mask_layout="sliced"),
    "bias_hidden_rows": testing.Case(mask="additive", mask_shape="batch", mask_grad=True, hidden_rows=True),
}


@pytest.mark.parametrize("rotation", range(len(testing.LAYOUTS)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(TRAINING_CASES))
def test_dropout_and_bias_gradient_meet_criterion(generator, small_blocks, name, dtype, rotation):
    """Dropout and a learned additive mask, with other features, through `attention` and autograd,
    against the float64 reference that drops the very same elements (fused_attn.dropout); the mask's
    gradient in its own broadcast shape."""
    inputs = testing.random_inputs(TRAINING_CASES[name], dtype, rotation, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("block_k", ["10", "512"])
def test_dropout_with_key_blocks_not_multiple_of_four(generator, monkeypatch, block_k):
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_K", block_k)
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_Q", "16")
    inputs = testing.random_inputs(TRAINING_CASES["plain"], torch.float32, 1, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("name", ["gqa_padding_lse_grad", "bias_heads_causal_dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_gradients_deterministic_across_thread_counts(generator, small_blocks, dtype, name):
    inputs = testing.random_inputs(TRAINING_CASES[name], dtype, 2, generator)
    threads = torch.get_num_threads()
    try:
        first = testing.run_attention(inputs, "cpu")
        torch.set_num_threads(1)
        single = testing.run_attention(inputs, "cpu")
    finally:
        torch.set_num_threads(threads)
    for name, value in first.named().items():
        assert torch.equal(value, single.named()[name]), name


# The score variants (fused_attn.scores), drawn together with each other and with the other features.
VARIANT_CASES = {
    "window_causal_bottom_right_gqa": testing.Case(len_q=45, len_k=100, heads_q=4, heads_kv=2, is_causal=True,
                                                   causal_alignment="bottom_right", window=(30, -1)),
    "window_both_sides_dropout_padding": testing.Case(len_q=70, len_k=70, window=(9, 13), dropout_p=0.3,
                                                      key_padding=True, lse_grad=True),
    "bottom_right_more_queries_than_keys": testing.Case(len_q=60, len_k=25, is_causal=True,
                                                        causal_alignment="bottom_right", dim_qk=24, dim_v=8),
    "softcap_alibi_additive": testing.Case(softcap=2.5, alibi="heads", mask="additive", mask_shape="heads_keys",
                                           mask_layout="transposed", len_q=33, len_k=57),
    "softcap_learned_bias_window": testing.Case(softcap=4.0, mask="additive", mask_grad=True, window=(5, 20),
                                                len_q=37, len_k=41),
    "alibi_batch_bottom_right_bool_mask": testing.Case(alibi="batch", causal_alignment="bottom_right",
                                                       mask="bool", mask_shape="batch", is_causal=True,
                                                       len_q=29, len_k=64, lse_grad=True),
    "everything": testing.Case(heads_q=4, heads_kv=1, len_q=50, len_k=90, is_causal=True,
                               causal_alignment="bottom_right", window=(40, 3), softcap=3.0, alibi="batch",
                               mask="additive", mask_grad=True, mask_shape="2d", key_padding=True,
                               dropout_p=0.2, lse_grad=True, dim_qk=20),
    "window_hides_rows": testing.Case(len_q=40, len_k=30, window=(0, 0), causal_alignment="top_left",
                                      hidden_rows=True, mask="bool", key_padding=True),
    **testing.INTEGER_ALIGNMENT_CASES,
}


@pytest.mark.parametrize("rotation", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_score_variants_meet_criterion(generator, small_blocks, name, dtype, rotation):
    """Windows, bottom-right alignment, softcap and ALiBi with masks, dropout, GQA and learned biases,
    through `attention` and autograd, against the float64 reference that materialises each of them."""
    inputs = testing.random_inputs(VARIANT_CASES[name], dtype, rotation, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("rotation", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(testing.SINK_CASES))
def test_sinks_meet_criterion(generator, small_blocks, name, dtype, rotation):
    """Attention sinks with the other features, forward and backward (the sinks' gradient included),
    on the long-query and decode kernels."""
    inputs = testing.random_inputs(testing.SINK_CASES[name], dtype, rotation, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("name", ["sinks_gqa_causal_window_lse_grad", "sinks_decode_gqa_padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sink_gradient_deterministic_across_runs_and_thread_counts(generator, dtype, name):
    inputs = testing.random_inputs(testing.SINK_CASES[name], dtype, 0, generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first, second = testing.run_attention(inputs, "cpu"), testing.run_attention(inputs, "cpu")
        torch.set_num_threads(1)
        single = testing.run_attention(inputs, "cpu")
    finally:
        torch.set_num_threads(threads)
    for key, value in first.named().items():
        assert torch.equal(value, second.named()[key]) and torch.equal(value, single.named()[key]), key


# Few query rows (L_q <= 16) take the decode path: a key/value head's whole query group in one item
# (test_no_keys_and_empty_batch covers it without keys).
DECODE_CASES = {
    "one_token_gqa": testing.Case(len_q=1, len_k=77, heads_q=8, heads_kv=2, key_padding=True),
    "three_tokens_bottom_right": testing.Case(len_q=3, len_k=90, heads_q=4, heads_kv=1, is_causal=True,
                                              causal_alignment="bottom_right", window=(40, -1), alibi="batch"),
    "sixteen_tokens_everything": testing.Case(len_q=16, len_k=61, heads_q=6, heads_kv=3, is_causal=True,
                                              causal_alignment="bottom_right", softcap=3.0, mask="additive",
                                              mask_shape="2d", key_padding=True, dropout_p=0.25, lse_grad=True,
                                              dim_qk=20, dim_v=12),
    "top_left_hidden_rows": testing.Case(len_q=5, len_k=40, is_causal=True, mask="bool", mask_shape="batch",
                                         hidden_rows=True),
}


@pytest.mark.parametrize("rotation", [0, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_path_meets_criterion(generator, small_blocks, name, dtype, rotation):
    inputs = testing.random_inputs(DECODE_CASES[name], dtype, rotation, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@contextlib.contextmanager
def torch_threads(count):
    """torch's intra-op threads set to `count` for the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("len_k", [1100, 2100])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_splits_the_keys_of_a_lone_head(generator, dtype, len_k, sinks):
    """One batch row and one key/value head on two threads: the keys are split (two or four ways) and
    the partial results merged (the sinks joining once, in the merge); with dropout, padding at both
    ends and a window."""
    case = testing.Case(batch=1, heads_q=3, heads_kv=1, len_q=2, len_k=len_k, dim_qk=32, key_padding=True,
                        dropout_p=0.1, window=(len_k // 2, -1), causal_alignment="bottom_right", lse_grad=True,
                        sinks=sinks)
    inputs = testing.random_inputs(case, dtype, 1, generator)
    with torch_threads(2):
        testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["heads_inner", "seq_first", "packed"])
@pytest.mark.parametrize("len_k", [300, 1100])
def test_decode_over_rows_holding_every_head(generator, dtype, layout, len_k):
    """K and V whose rows hold the heads side by side (a (B, L, H, D) cache), each head's keys read at the rows'
    stride (with 1100 keys on two threads, the keys split too, merged per head); GQA, padding, dropout, a window
    and sinks along."""
    case = testing.Case(batch=2, heads_q=8, heads_kv=4, len_q=1, len_k=len_k, dim_qk=32, key_padding=True,
                        dropout_p=0.1, window=(len_k // 2, -1), causal_alignment="bottom_right", lse_grad=True,
                        sinks=True)
    inputs = testing.random_inputs(case, dtype, 0, generator)
    inputs = dataclasses.replace(inputs, key=testing.strided(inputs.key, layout),
                                 value=testing.strided(inputs.value, layout))
    assert inputs.key.stride(1) < inputs.key.stride(2)
    with torch_threads(2):
        testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("block_k", ["7", "64", "512"])
def test_windows_across_block_sizes(generator, monkeypatch, block_k):
    """Windows narrower and wider than a key block, and bottom-right rows that start mid-block."""
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_K", block_k)
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_Q", "8")
    for window in ((3, 0), (70, 70), (0, 45)):
        case = testing.Case(len_q=90, len_k=150, window=window, causal_alignment="bottom_right", alibi="heads")
        inputs = testing.random_inputs(case, torch.float32, 2, generator)
        testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [(60, 0), (20, 20), (0, 100), (200, -1)], ids=str)
def test_narrow_windows_start_each_block_at_its_first_key(generator, dtype, window):
    """Windows narrower than the default blocks (128 query rows, 512 keys forward, 64 × 256 backward): each
    query block, and each half of one, computes from its first row's first key (rounded down to 16), forward and
    backward, with dropout's bits at their keys and padding at both ends."""
    case = testing.Case(batch=1, heads_q=2, heads_kv=1, len_q=300, len_k=360, dim_qk=32, window=window,
                        causal_alignment="bottom_right", dropout_p=0.2, key_padding=True, lse_grad=True)
    inputs = testing.random_inputs(case, dtype, 1, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_keys_outside_the_padding_span_are_never_read(generator, small_blocks, dtype):
    """Left and right padding narrow the keys visited, to the key: NaN keys and values beyond a row's
    first and last unpadded key change nothing, forward and backward."""
    testing.check_padding_is_not_read(registry.get("cpu"), dtype, generator)


def test_refusals():
    backend = registry.get("cpu")
    q = torch.empty(1, 1, 2, 4, device="meta")
    problem = fused_attn.problem.Problem.of(q, q, q, None, None, False, 0.1)
    assert backend.refusals(problem) == ["runs on CPU tensors only, got device meta"]
    assert backend.devices == ("cpu",) and backend.takes_dropout and backend.takes_mask_gradient
    assert backend.takes_score_variants == {"bottom_right", "window", "softcap", "alibi", "sinks", "mask_program"}


SHARED = torch.randn(2, 4, 6, 8)


def bad_call(**changes):
    """A forward call with one argument replaced."""
    args = dict(query=torch.randn(2, 4, 6, 8), key=torch.randn(2, 2, 7, 8), value=torch.randn(2, 2, 7, 5),
                attn_mask=None, key_padding_mask=None, is_causal=False, scale=0.5,
                out=torch.empty(2, 4, 6, 5))
    args.update(changes)
    return lambda: torch.ops.fused_attn.flash_forward(*args.values())


@pytest.mark.parametrize("changes, message", [
    (dict(query=torch.randn(2, 4, 6)), "query: expected a 4-D"),
    (dict(key=torch.randn(2, 2, 7)), "key: expected a 4-D"),
    (dict(value=torch.randn(2, 2, 7, 5, 1)), "value: expected a 4-D"),
    (dict(query=torch.randn(2, 4, 6, 8, dtype=torch.float64)), "key: expected dtype"),
    (dict(query=torch.randint(0, 3, (2, 4, 6, 8))), "query: expected dtype"),
    (dict(key=torch.randn(3, 2, 7, 8)), "key: expected shape"),
    (dict(key=torch.randn(2, 2, 7, 9)), "key: expected shape"),
    (dict(value=torch.randn(2, 2, 6, 5)), "value: expected shape"),
    (dict(key=torch.randn(2, 3, 7, 8), value=torch.randn(2, 3, 7, 5)), "key: expected a number of heads"),
    (dict(attn_mask=torch.ones(2, 4, 6, 7, dtype=torch.int32)), "attn_mask: expected dtype"),
    (dict(attn_mask=torch.ones(2, 4, 6, 6, dtype=torch.bool)), "attn_mask: expected shape"),
    (dict(attn_mask=torch.ones(6, 7, dtype=torch.bool)), "attn_mask: expected a 4-D"),
    (dict(key_padding_mask=torch.ones(2, 7)), "key_padding_mask: expected dtype"),
    (dict(key_padding_mask=torch.ones(2, 6, dtype=torch.bool)), "key_padding_mask: expected shape"),
    (dict(out=torch.empty(2, 4, 6, 8)), "out: expected shape"),
    (dict(out=torch.empty(2, 4, 6, 5, dtype=torch.float64)), "out: expected dtype"),
    (dict(out=torch.empty(1, 1, 1, 5).expand(2, 4, 6, 5)), "out: expected a tensor whose elements"),
    (dict(scale=float("nan")), "scale: expected a finite"),
    (dict(query=SHARED, out=SHARED[..., :5]), "out: expected memory apart from query"),
])
def test_bad_forward_arguments_raise(changes, message):
    with pytest.raises(RuntimeError, match=message):
        bad_call(**changes)()


def test_bad_backward_arguments_raise():
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    out = torch.empty(1, 2, 5, 4)
    lse = torch.ops.fused_attn.flash_forward(q, k, v, None, None, False, 0.5, out)
    good = dict(out=out, lse=lse, grad_out=torch.randn_like(out), grad_lse=None)
    for changes, message in [
        (dict(lse=lse.double()), "lse: expected dtype"),
        (dict(lse=lse[..., :4]), "lse: expected shape"),
        (dict(grad_out=torch.randn(1, 2, 5, 3)), "grad_out: expected shape"),
        (dict(out=out.half()), "out: expected dtype"),
        (dict(grad_lse=torch.randn(1, 2, 4)), "grad_lse: expected shape"),
    ]:
        args = dict(good, **changes)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.fused_attn.flash_backward(q, k, v, None, None, False, 0.5, args["out"], args["lse"],
                                                args["grad_out"], args["grad_lse"])


def test_bad_block_environment_raises(monkeypatch):
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_Q", "zero")
    with pytest.raises(RuntimeError, match="FUSED_ATTN_CPU_BLOCK_Q"):
        bad_call()()


@pytest.mark.parametrize("name", ["FUSED_ATTN_CPU_DECODE", "FUSED_ATTN_CPU_BRGEMM"])
def test_bad_switch_environment_raises(monkeypatch, name):
    monkeypatch.setenv(name, "yes")
    with pytest.raises(RuntimeError, match=name):
        bad_call()()


def test_decode_switch_chooses_the_kernels_and_not_the_result(generator, monkeypatch):
    """FUSED_ATTN_CPU_DECODE=0 runs the long-query forward on a decode call: the same result within
    float rounding (the products are grouped differently)."""
    case = testing.Case(len_q=1, len_k=300, heads_q=8, heads_kv=2, key_padding=True)
    inputs = testing.random_inputs(case, torch.float32, 0, generator)
    decoded = testing.run_attention(inputs, "cpu")
    monkeypatch.setenv("FUSED_ATTN_CPU_DECODE", "0")
    long_query = testing.run_attention(inputs, "cpu")
    torch.testing.assert_close(decoded.out, long_query.out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decoded.lse, long_query.lse, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequences_meet_criterion(generator, dtype, causal):
    """Default blocks over many key blocks, lengths not multiples of them."""
    q = torch.randn(1, 2, 700, 64, generator=generator).to(dtype)
    k = torch.randn(1, 2, 900, 64, generator=generator).to(dtype)
    v = torch.randn(1, 2, 900, 64, generator=generator).to(dtype)
    out, lse = flash_forward(q, k, v, None, None, causal, None, testing.nan_filled_like(q))
    grad_out = torch.randn(q.shape, generator=generator).to(dtype)
    grads = flash_backward(q, k, v, None, None, causal, None, out, lse, grad_out)
    testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_dots_of_any_layout(generator, dtype):
    """The sinks' per-row term: rowsum(a * b) for rows laid out differently (a transposed, b broadcast
    along a leading dimension, c with a last dimension of stride 2), against float64."""
    a = torch.randn(3, 37, 4, 70, generator=generator).to(dtype).transpose(1, 2)
    b = torch.randn(3, 1, 37, 70, generator=generator).to(dtype).expand(3, 4, 37, 70)
    c = torch.randn(3, 4, 37, 140, generator=generator).to(dtype)[..., ::2]
    for x, y in ((a, b), (b, c), (c, a)):
        got = torch.ops.fused_attn.row_dots(x, y)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        exact = (x.double() * y.double()).sum(-1)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5 if dtype != torch.float64 else 1e-12, atol=1e-4)
    with pytest.raises(RuntimeError, match="row_dots: b: expected the shape of a"):
        torch.ops.fused_attn.row_dots(a, b[..., :3])


@pytest.mark.parametrize("rotation", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(testing.PROGRAM_CASES))
def test_programs_meet_criterion(generator, name, dtype, rotation):
    """Mask programs with the other features, forward and backward, through the public call (the program
    given as attn_mask)."""
    inputs = testing.random_inputs(testing.PROGRAM_CASES[name], dtype, rotation, generator)
    testing.check_inputs(testing.run_attention(inputs, "cpu"), inputs)


@pytest.mark.parametrize("heads, length", [(2, 384), (8, 1024)])  # (8, 1024): items of several query blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_program_tiles_left_empty_are_never_read(generator, dtype, heads, length):
    """Keys and queries of tiles the program leaves empty are not read: NaN there changes nothing elsewhere.
    Documents of 128 tokens: queries of document d see only keys of d (tiles off the diagonal are empty)."""
    case = testing.Case(batch=1, heads_q=heads, heads_kv=heads // 2, len_q=length, len_k=length)
    inputs = testing.random_inputs(case, dtype, 0, generator)
    ids = torch.arange(length) // 128
    program = masks.mask_program(masks.documents(ids) & masks.causal(), len_q=length)
    tiles = (length // 128) ** 2
    assert program.counts() == {"empty": tiles - length // 128, "full": length // 128, "partial": 0}  # band: diagonal
    inputs = dataclasses.replace(inputs, program=program)
    expected = testing.reference_for(inputs, torch.float64), testing.reference_for(inputs, dtype)
    with torch.no_grad():  # the second document's keys and values, which only its own queries see
        inputs.key[:, :, 128:256] = float("nan")
        inputs.value[:, :, 128:256] = float("nan")
    results = testing.run_backend(registry.get("cpu"), inputs)
    others = torch.cat([torch.arange(128), torch.arange(256, length)])
    for name, value in results.named().items():
        value, exact = value[:, :, others], getattr(expected[0], name)[:, :, others]  # rows or keys, all at dim 2
        assert torch.isfinite(value).all(), name
        allowed = testing.allowed_error(name, exact, getattr(expected[1], name)[:, :, others], dtype)
        assert testing.max_error(value, exact) <= allowed, name


@pytest.mark.parametrize("block_k", [256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_program_runs_with_empty_tiles_inside(generator, monkeypatch, dtype, block_k):
    """Key blocks of several tiles, each query block computing the keys from the first to the last tile it sees:
    empty tiles inside that run (key tiles 1 and 3 for query tiles 0, 2 and 4 at 512-key blocks), runs that start
    past a block's first tile (query tile 3 at 256), partial tiles, rows that see nothing, and dropout's bits at
    their keys, forward and backward, per head with GQA. Key tile 5, which no query sees, is never read: NaN there
    changes nothing, and its keys' gradients are 0."""
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_K", str(block_k))
    case = testing.Case(batch=1, heads_q=4, heads_kv=2, len_q=640, len_k=768, dim_qk=32, dropout_p=0.2,
                        lse_grad=True)
    inputs = testing.random_inputs(case, dtype, 2, generator)

    def mask_mod(b, h, q_idx, kv_idx):
        q_tile, kv_tile = q_idx // 128, kv_idx // 128
        scattered = ((q_idx + 3 * kv_idx + h) % 7 < 4) & (q_idx % 11 != 0)
        return (((q_tile == 1) & (kv_tile == 1)) | ((q_tile == 3) & (kv_tile == 3) & (kv_idx <= q_idx + h))
                | ((q_tile % 2 == 0) & (kv_tile % 2 == 0) & (kv_tile < 5) & scattered))

    program = masks.mask_program(mask_mod, heads=4, len_q=640, len_k=768)
    inputs = dataclasses.replace(inputs, program=program)
    exact, same_dtype = testing.reference_for(inputs, torch.float64), testing.reference_for(inputs, dtype)
    with torch.no_grad():
        inputs.key[:, :, 640:] = float("nan")
        inputs.value[:, :, 640:] = float("nan")
    results = testing.run_backend(registry.get("cpu"), inputs)
    testing.assert_close_to_reference(results, exact, same_dtype, dtype)
    hidden = exact.lse == float("-inf")
    assert hidden.any()
    assert (results.out[hidden] == 0).all() and (results.grad_query[hidden] == 0).all()
    assert (results.grad_key[:, :, 640:] == 0).all() and (results.grad_value[:, :, 640:] == 0).all()


def test_program_of_full_tiles_equals_no_program(generator, monkeypatch):
    """A program that hides nothing changes nothing: bit for bit, at the key blocks a program runs with."""
    monkeypatch.setenv("FUSED_ATTN_CPU_BLOCK_K", str(masks.TILE))
    case = testing.Case(batch=2, heads_q=2, heads_kv=2, len_q=200, len_k=260, is_causal=True, dropout_p=0.1)
    inputs = testing.random_inputs(case, torch.float32, 1, generator)
    program = masks.mask_program(lambda b, h, q_idx, kv_idx: q_idx >= 0, len_q=200, len_k=260)
    assert program.counts()["full"] == program.tiles.numel()
    plain = testing.run_attention(inputs, "cpu")
    with_program = testing.run_attention(dataclasses.replace(inputs, program=program), "cpu")
    for name, value in plain.named().items():
        assert torch.equal(value, with_program.named()[name]), name


def check_plain_paged_decode(generator, dtype):
    """A float or bf16 paged cache read in place by the decode kernels (few rows an item): each key block's rows listed
    across cache blocks of 7 keys, the keys split between two items (the second split starts inside a cache block),
    a window, head dims with vector tails in both products; unused blocks and the last block's tail hold NaN."""
    from fused_attn.scores import variant_of

    heads_q, heads_kv, block_size, dim, dim_v, length = 4, 2, 7, 20, 12, 1100
    max_blocks = -(-length // block_size) + 1
    len_k, num_blocks = max_blocks * block_size, max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=generator)[:max_blocks].view(1, max_blocks).int()
    k_blocks, v_blocks = (torch.randn(num_blocks, block_size, heads_kv, d, generator=generator).to(dtype)
                          for d in (dim, dim_v))
    keys_past_end = block_table.long().repeat_interleave(block_size)[length:], torch.arange(length, len_k) % block_size
    unused = torch.ones(num_blocks, dtype=torch.bool)
    unused[block_table.long()] = False
    for blocks in (k_blocks, v_blocks):
        blocks[unused] = float("nan")
        blocks[keys_past_end] = float("nan")
    padding = torch.arange(len_k)[None, :] >= length
    query = testing.strided(torch.randn(1, heads_q, 1, dim, generator=generator).to(dtype), "heads_inner")
    variant = variant_of(query, "bottom_right", (600, -1), None, None)

    def forward_paged(backend, q, k, v):
        out = torch.full((1, 1, heads_q, dim_v), float("nan"), dtype=q.dtype).transpose(1, 2)
        lse = registry.get(backend).forward_paged(q, k, v, block_table, None, padding, False, dim ** -0.5, out, variant)
        return testing.Results(out, lse)

    with torch_threads(2):  # two items of keys per head: the split
        actual = forward_paged("cpu", query, k_blocks, v_blocks)
    exact = forward_paged("reference", query.double(), k_blocks.double(), v_blocks.double())
    same_dtype = forward_paged("reference", query, k_blocks, v_blocks)
    testing.assert_close_to_reference(actual, exact, same_dtype, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plain_paged_decode_meets_criterion(generator, small_blocks, dtype):
    check_plain_paged_decode(generator, dtype)


# 8-bit key/value caches (fused_attn.quantization) read by paged_forward in place, against the reference backend's
# forward_paged, which dequantizes a gathered copy (in float64 for the exact result, in the query's dtype for the
# same-dtype one). Each sequence's blocks lie shuffled among spare ones; what lies past a sequence's end (its last
# block's tail, blocks the table does not name, table entries that are no block) is poison: NaN scales per token,
# and bytes 0x7f (e4m3fn's NaN, int8's largest) in the blocks.
QUANTIZED_CASES = {
    "decode_gqa_blocks_of_16": dict(len_q=1, heads_q=8, heads_kv=2, block_size=16, lengths=(70, 33, 0)),
    "decode_window_alibi_sinks_blocks_of_1": dict(len_q=3, heads_q=4, heads_kv=1, block_size=1, lengths=(40, 17),
                                                  is_causal=True, window=(20, -1), alibi=True, sinks=True),
    "decode_softcap_odd_blocks_dims": dict(len_q=16, heads_q=6, heads_kv=3, block_size=7, lengths=(50, 1, 33),
                                           softcap=3.0, dim=20, dim_v=12),
    "decode_gqa_strided_dims": dict(len_q=1, heads_q=4, heads_kv=2, block_size=5, lengths=(23, 40), dim_stride=2),
    "decode_one_block_per_sequence": dict(len_q=2, heads_q=2, heads_kv=2, block_size=64, lengths=(64, 40),
                                          is_causal=True),
    "decode_split_keys": dict(len_q=1, heads_q=2, heads_kv=1, block_size=16, lengths=(1100,), alibi=True),
    # bf16 queries take the 8-bit keys' scores in bf16 pairs where an item has two rows or more (the AVX512_BF16
    # copy), the rest of D (here 88 = 64 in pairs, 16 in one vector, 8 one by one) and a single row as float. Four
    # rows an item; then 9, in groups of 8 and 1.
    "decode_gqa_pairs_and_tail": dict(len_q=1, heads_q=8, heads_kv=2, block_size=16, lengths=(70, 33, 0), dim=88,
                                      dim_v=40),
    "decode_rows_of_pairs_causal_softcap": dict(len_q=3, heads_q=6, heads_kv=2, block_size=5, lengths=(45, 64),
                                                is_causal=True, softcap=2.0, dim=64),
    "long_queries_causal_odd_blocks": dict(len_q=37, heads_q=4, heads_kv=2, block_size=7, lengths=(60, 45),
                                           is_causal=True, alibi=True),
    "long_queries_window_softcap_sinks": dict(len_q=20, heads_q=2, heads_kv=2, block_size=16, lengths=(90, 0),
                                              window=(30, 5), softcap=2.0, sinks=True, dim=24),
}
CACHE_DTYPES = [torch.float8_e4m3fn, torch.int8]


def quantized_cache(generator, dense, lengths, block_size, cache_dtype, per_token, block_table, num_blocks,
                    dim_stride=1):
    """`dense` (B, H_kv, L_k, D) in 8-bit blocks (num_blocks, block_size, H_kv, D) at `block_table`, D at
    `dim_stride`, with its float32 scales, per token (num_blocks, block_size, H_kv) or per sequence (B, H_kv),
    neither of them contiguous; past each sequence's length and in the blocks nobody owns, poison."""
    from fused_attn import quantization

    batch, heads_kv, len_k, dim = dense.shape
    # Some keys far larger than the others, so that per-sequence scales leave most values well below full range.
    dense = dense * torch.where(torch.rand(batch, heads_kv, len_k, 1, generator=generator) < 0.1, 4.0, 1.0)
    if per_token:
        dense_scales = quantization.token_scales(dense, cache_dtype)
        scales = torch.full((heads_kv, num_blocks, 2 * block_size), float("nan")).permute(1, 2, 0)[:, ::2]
    else:
        largest = dense.abs().amax(dim=(2, 3)).float() / quantization.LARGEST[cache_dtype]
        scales = (largest * (1 + torch.rand(batch, heads_kv, generator=generator))).t().contiguous().t()
        dense_scales = scales[:, :, None].expand(batch, heads_kv, len_k)
    stored = quantization.quantize(dense, dense_scales, cache_dtype).view(torch.int8)
    # (num_blocks, H_kv, block_size, D) storage: the rows of a block are not adjacent in memory.
    raw = torch.full((num_blocks, heads_kv, block_size, dim * dim_stride), 0x7F, dtype=torch.int8)
    raw = raw[..., ::dim_stride].transpose(1, 2)
    for b in range(batch):  # only the sequence's keys: the rest keeps its poison
        keys = slice(0, int(lengths[b]))
        block, row = block_table[b].long().repeat_interleave(block_size)[keys], torch.arange(len_k)[keys] % block_size
        raw[block, row] = stored[b, :, keys].transpose(0, 1)
        if per_token:
            scales[block, row] = dense_scales[b, :, keys].t()
    return raw.view(cache_dtype), scales


def run_quantized_case(generator, name, dtype, cache_dtype, per_token):
    """QUANTIZED_CASES[name] through the cpu backend's forward_paged against the reference's, by the criterion."""
    from fused_attn.scores import variant_of

    case = QUANTIZED_CASES[name]
    lengths = torch.tensor(case["lengths"])
    batch, block_size = len(lengths), case["block_size"]
    heads_q, heads_kv, len_q = case["heads_q"], case["heads_kv"], case["len_q"]
    dim, dim_v = case.get("dim", 16), case.get("dim_v", case.get("dim", 16))
    max_blocks = -(-int(lengths.max()) // block_size) + 1  # a last block past every sequence's end
    len_k = max_blocks * block_size
    num_blocks = batch * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks].view(batch, max_blocks).int()
    keys, values = (torch.randn(batch, heads_kv, len_k, d, generator=generator) for d in (dim, dim_v))
    k_blocks, k_scale = quantized_cache(generator, keys, lengths, block_size, cache_dtype, per_token, block_table,
                                        num_blocks, case.get("dim_stride", 1))
    v_blocks, v_scale = quantized_cache(generator, values, lengths, block_size, cache_dtype, per_token, block_table,
                                        num_blocks, case.get("dim_stride", 1))
    for b in range(batch):  # entries past a sequence's last block need not be blocks at all
        block_table[b, -(-int(lengths[b]) // block_size) + 1:] = -1 if b % 2 else num_blocks + 7
    padding = torch.arange(len_k)[None, :] >= lengths[:, None]
    query = testing.strided(torch.randn(batch, heads_q, len_q, dim, generator=generator).to(dtype), "heads_inner")
    alibi = torch.rand(heads_q, batch, generator=generator).t() * 0.5 if case.get("alibi") else None
    sinks = torch.randn(heads_q, generator=generator) * 2.0 if case.get("sinks") else None
    variant = variant_of(query, "bottom_right", case.get("window"), case.get("softcap"), alibi, sinks)
    scale = dim ** -0.5

    def forward_paged(backend, q, call_variant):
        out = torch.full((batch, len_q, heads_q, dim_v), float("nan"), dtype=q.dtype).transpose(1, 2)
        lse = registry.get(backend).forward_paged(q, k_blocks, v_blocks, block_table, None, padding,
                                                  case.get("is_causal", False), scale, out, call_variant,
                                                  k_scale=k_scale, v_scale=v_scale)
        return testing.Results(out, lse)

    exact_variant = variant if sinks is None else dataclasses.replace(variant, sinks=sinks.double())
    exact = forward_paged("reference", query.double(), exact_variant)
    same_dtype = forward_paged("reference", query, variant)
    actual = forward_paged("cpu", query, variant)
    testing.assert_close_to_reference(actual, exact, same_dtype, dtype)
    hidden = lengths == 0  # a sequence with no key: output 0 and lse -inf (or the sink)
    assert (actual.out[hidden] == 0).all()
    if sinks is None:
        assert (actual.lse[hidden] == float("-inf")).all()


@pytest.mark.parametrize("decode", ["1", "0"], ids=["decode_kernels", "long_query_kernels"])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sequence", "per_token"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(QUANTIZED_CASES))
def test_quantized_cache_meets_criterion(generator, small_blocks, monkeypatch, name, dtype, cache_dtype, per_token,
                                         decode):
    """FUSED_ATTN_CPU_DECODE=0 runs the long-query kernels on the decode cases too."""
    monkeypatch.setenv("FUSED_ATTN_CPU_DECODE", decode)
    run_quantized_case(generator, name, dtype, cache_dtype, per_token)


def dequantized_by_the_kernels(stored, scale):
    """The float32 output of one query over one key whose values are `stored` (1-D, 8-bit) under `scale`: that
    key's dequantized values, through the kernels' loads."""
    k_blocks = torch.zeros(1, 1, 1, 4, dtype=stored.dtype)
    v_blocks = stored.view(1, 1, 1, -1)
    out = torch.empty(1, 1, 1, stored.numel())
    scales = torch.tensor([[scale]])
    torch.ops.fused_attn.paged_forward(torch.randn(1, 1, 1, 4), k_blocks, v_blocks, torch.zeros(1, 1, dtype=torch.int32),
                                       None, None, False, 1.0, out, k_scale=scales, v_scale=scales)
    return out.flatten()


def scores_by_the_kernels(stored, scale, dtype):
    """The float32 scores, through the lse, of two query rows (of `dtype`) per sequence against a sequence's one key,
    whose 32 values are 0 but stored[i] at i % 32 for sequence i: each query is 1 there. Two rows an item and D = 32:
    the bf16 pairs of the decode kernels' scores (row_dots) take a bf16 query's."""
    count, dim = stored.numel(), 32
    sequence, position = torch.arange(count), torch.arange(count) % dim
    k_blocks = torch.zeros(count, 1, 1, dim, dtype=torch.int8)
    k_blocks[sequence, 0, 0, position] = stored.view(torch.int8)
    query = torch.zeros(count, 2, 1, dim, dtype=dtype)
    query[sequence, :, 0, position] = 1
    out = torch.empty(count, 2, 1, dim, dtype=dtype)
    scales = torch.full((count, 1), scale)
    lse = torch.ops.fused_attn.paged_forward(query, k_blocks.view(stored.dtype), k_blocks.view(stored.dtype),
                                             sequence.int()[:, None], None, None, False, 1.0, out, k_scale=scales,
                                             v_scale=scales)
    return lse[:, :, 0]


def check_every_8bit_value():
    """Every byte of both formats but e4m3fn's NaN, e4m3fn's subnormals included, dequantized exactly by the decode
    and the long-query kernels, as values and as keys (fp32 and bf16 queries), also with denormals flushed
    (torch.set_flush_denormal)."""
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    decode = os.environ.get("FUSED_ATTN_CPU_DECODE")
    try:
        for cache_dtype, kernels, flush in itertools.product(CACHE_DTYPES, ("1", "0"), (False, True)):
            stored = codes.view(cache_dtype)
            if cache_dtype == torch.float8_e4m3fn:
                stored = stored[~stored.float().isnan()]
            os.environ["FUSED_ATTN_CPU_DECODE"] = kernels
            torch.set_flush_denormal(flush)
            for scale in (1.0, 0.37):
                expected = stored.float() * scale
                torch.testing.assert_close(dequantized_by_the_kernels(stored, scale), expected, rtol=4e-7, atol=0)
                for dtype in (torch.float32, torch.bfloat16):
                    scores = scores_by_the_kernels(stored, scale, dtype)
                    torch.testing.assert_close(scores, expected[:, None].expand(-1, 2), rtol=4e-7, atol=0)
    finally:
        torch.set_flush_denormal(False)
        if decode is None:
            os.environ.pop("FUSED_ATTN_CPU_DECODE", None)
        else:
            os.environ["FUSED_ATTN_CPU_DECODE"] = decode


def test_every_8bit_value_is_dequantized_exactly():
    check_every_8bit_value()


@pytest.mark.parametrize("isa", list(ISA_FLAGS))
def test_quantized_cache_on_every_instruction_set(isa):
    """Each compiled copy of the kernels on 8-bit caches (each has its own vector conversions), in a fresh process."""
    run_on_instruction_set(isa, (
        "import torch, tests.test_cpu as t\n"
        "t.check_every_8bit_value()\n"
        "g = torch.Generator().manual_seed(2)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for cache_dtype in t.CACHE_DTYPES:\n"
        "        for name in ('decode_gqa_blocks_of_16', 'decode_softcap_odd_blocks_dims',\n"
        "                     'decode_gqa_pairs_and_tail', 'long_queries_causal_odd_blocks'):\n"
        "            for per_token in (False, True):\n"
        "                t.run_quantized_case(g, name, dtype, cache_dtype, per_token)\n"))


def bad_paged_call(**changes):
    """A paged_forward call over an int8 cache (4 blocks of 3 keys, per-sequence scales) with arguments replaced."""
    args = dict(query=torch.randn(2, 4, 1, 8), k_blocks=torch.zeros(4, 3, 2, 8, dtype=torch.int8),
                v_blocks=torch.zeros(4, 3, 2, 5, dtype=torch.int8), block_table=torch.tensor([[0, 1], [2, 3]]).int(),
                attn_mask=None, key_padding_mask=None, is_causal=False, scale=0.5, out=torch.empty(2, 4, 1, 5),
                k_scale=torch.ones(2, 2), v_scale=torch.ones(2, 2))
    args.update(changes)
    scales = {name: args.pop(name) for name in ("k_scale", "v_scale")}
    return lambda: torch.ops.fused_attn.paged_forward(*args.values(), **scales)


@pytest.mark.parametrize("changes, message", [
    (dict(k_scale=torch.ones(2, 2, dtype=torch.float64)), "k_scale: expected dtype float32"),
    (dict(v_scale=torch.ones(2, 3)), "v_scale: expected shape"),
    (dict(k_scale=torch.ones(4, 3)), "k_scale: expected shape"),
    (dict(v_scale=torch.ones(4, 3, 2)), "v_scale: expected k_scale's layout"),
    (dict(v_scale=None), "v_scale: expected scales for key and value alike"),
    (dict(k_scale=None, v_scale=None), "k_scale: expected the float32 scales"),
    (dict(k_blocks=torch.zeros(4, 3, 2, 8), v_blocks=torch.zeros(4, 3, 2, 5)), "k_blocks: expected dtype float8_e4m3fn"),
    (dict(v_blocks=torch.zeros(4, 3, 2, 5, dtype=torch.float8_e4m3fn)), "v_blocks: expected k_blocks' dtype"),
    (dict(query=torch.randn(2, 4, 1, 8, dtype=torch.float64), out=torch.empty(2, 4, 1, 5, dtype=torch.float64)),
     "query: expected dtype float32, bfloat16 or float16"),
])
def test_bad_quantized_cache_arguments_raise(changes, message):
    with pytest.raises(RuntimeError, match=message):
        bad_paged_call(**changes)()
    bad_paged_call()()  # the unchanged call runs


def test_reads_quantized_cache_in_place():
    """The registry reports no dequantized copy for the cpu backend."""
    q = torch.empty(1, 1, 1, 4)
    problem = fused_attn.problem.Problem.of(q, q, q, None, None, False, 0.0)._replace(cache_dtype=torch.int8)
    assert registry.get("cpu").reads_quantized_cache and registry.get("cpu").notes(problem) == []
