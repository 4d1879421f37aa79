"""fused_attn as PyTorch's flash-attention implementation (torch.nn.attention.activate_flash_attention_impl):
SDPA's CPU flash operator runs on fused_attn's kernels, forward and backward, eager and compiled; what
they do not serve runs on PyTorch's own kernel; restoring gives PyTorch its kernels back. The CUDA
kernels are checked against this torch's schemas and dispatcher, and run on CPU tensors."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import (SDPBackend, activate_flash_attention_impl, current_flash_attention_impl,
                                restore_flash_attention_impl, sdpa_kernel)

import fused_attn
from fused_attn import testing
from fused_attn.integrations import sdpa_plugin
from fused_attn.scores import ScoreVariant

CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
CUDA_OPS = [name for name, key, _ in sdpa_plugin.KERNELS if key == "CUDA"]


@pytest.fixture
def pytorch_calls(monkeypatch):
    """The operators whose calls ran on PyTorch's own kernel while the plug-in was active (its one route
    there: while active, the dispatcher's CPU entry of these operators is ours)."""
    calls = []
    original = sdpa_plugin.call_pytorch

    def counted(name, *args):
        calls.append(name)
        return original(name, *args)

    monkeypatch.setattr(sdpa_plugin, "call_pytorch", counted)
    return calls


@pytest.fixture
def plugin():
    activate_flash_attention_impl("fused_attn")
    try:
        yield
    finally:
        restore_flash_attention_impl()


def cpu_kernel_origin() -> str:
    """Where the dispatcher's CPU kernel of the CPU flash operator was registered."""
    return next(line for line in torch._C._dispatch_dump_table(CPU_OP).splitlines() if line.startswith("CPU:"))


def laid_out(shape, layout, dtype, generator):
    return testing.strided(torch.randn(shape, generator=generator).to(dtype), layout).requires_grad_()


def sdpa_results(q, k, v, grad_out, dtype=None, **options):
    """Output and gradients of F.scaled_dot_product_attention at these inputs (converted to `dtype`)."""
    inputs = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    if isinstance(options.get("attn_mask"), torch.Tensor) and options["attn_mask"].is_floating_point():
        options = {**options, "attn_mask": options["attn_mask"].to(dtype or options["attn_mask"].dtype)}
    out = F.scaled_dot_product_attention(*inputs, **options)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return dict(zip(("out", "grad_query", "grad_key", "grad_value"), (out.detach(), *grads)))


def check_by_criterion(actual, q, k, v, grad_out, **options):
    """The project's criterion (fused_attn.testing), against SDPA's math backend in float64 and in the
    inputs' dtype."""
    with sdpa_kernel(SDPBackend.MATH):
        exact = sdpa_results(q, k, v, grad_out, torch.float64, **options)
        same_dtype = sdpa_results(q, k, v, grad_out, **options)
    for name, value in actual.items():
        assert value.shape == exact[name].shape and not value.isnan().any(), name
        error = testing.max_error(value, exact[name])
        allowed = testing.allowed_error(name, exact[name], same_dtype[name], q.dtype)
        assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def test_import_registers_the_name_and_nothing_else():
    script = (
        "import sys, torch, fused_attn\n"
        "from torch.nn.attention import list_flash_attention_impls, current_flash_attention_impl\n"
        "assert 'fused_attn' in list_flash_attention_impls(), list_flash_attention_impls()\n"
        "assert current_flash_attention_impl() is None\n"
        f"table = torch._C._dispatch_dump_table({CPU_OP!r})\n"
        "assert 'RegisterCPU' in table.splitlines()[0], table\n"
        "assert 'transformers' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", script], check=True)


CASES = {
    "plain": dict(heads_kv=4, options={}),
    "causal": dict(heads_kv=4, options={"is_causal": True}),
    "gqa_causal": dict(heads_kv=2, options={"is_causal": True, "enable_gqa": True}),
    "gqa_scale": dict(heads_kv=1, options={"enable_gqa": True, "scale": 0.3}),
    "mask_scale": dict(heads_kv=4, options={"attn_mask": "bool", "scale": 0.2}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_runs_on_fused_attn_forward_and_backward(generator, plugin, fused_calls, pytorch_calls, case, dtype):
    heads_kv, options = CASES[case]["heads_kv"], dict(CASES[case]["options"])
    # Each tensor in its own layout (unit stride along D, which SDPA's flash path asks).
    q = laid_out((2, 4, 24, 16), "heads_inner", dtype, generator)
    k = laid_out((2, heads_kv, 32, 16), "contiguous", dtype, generator)
    v = laid_out((2, heads_kv, 32, 16), "packed", dtype, generator)
    if options.get("attn_mask") == "bool":
        options["attn_mask"] = testing.random_mask((2, 1, 24, 32), "bool", dtype, generator=generator)
        options["attn_mask"][..., 0] = True  # no row entirely hidden: SDPA's math backend gives NaN there
    grad_out = testing.strided(torch.randn(2, 4, 24, 16, generator=generator).to(dtype), "seq_first")
    actual = sdpa_results(q, k, v, grad_out, **options)
    assert fused_calls["cpu"] == [1, 1] and pytorch_calls == []
    check_by_criterion(actual, q, k, v, grad_out, **options)


def test_the_flash_operator_is_the_route(generator, plugin):
    """SDPA chose its flash operator, and our kernel ran inside it (the profiler's call tree)."""
    q = torch.randn(1, 2, 16, 8, generator=generator)
    with torch.profiler.profile() as profile:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    flash = [e for e in profile.events() if e.name == CPU_OP]
    assert len(flash) == 1
    assert "fused_attn::flash_forward" in [child.name for child in flash[0].cpu_children]
    assert "sdpa_plugin.py" in cpu_kernel_origin()


def test_what_fused_attn_does_not_serve_runs_on_pytorch(generator, fused_calls, pytorch_calls):
    # A float32 mask on bfloat16 inputs: PyTorch's flash kernel takes it, fused_attn's kernels do not.
    q, k, v = (torch.randn(2, 2, 12, 8, generator=generator).bfloat16().requires_grad_() for _ in range(3))
    options = {"attn_mask": torch.randn(12, 12, generator=generator), "is_causal": False}
    grad_out = torch.randn(2, 2, 12, 8, generator=generator).bfloat16()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        expected = sdpa_results(q, k, v, grad_out, **options)
        activate_flash_attention_impl("fused_attn")
        try:
            got = sdpa_results(q, k, v, grad_out, **options)
        finally:
            restore_flash_attention_impl()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert pytorch_calls == ["_scaled_dot_product_flash_attention_for_cpu",
                             "_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert sum(forwards + backwards for forwards, backwards in fused_calls.values()) == 0


def test_pytorch_errors_stay_pytorch_errors(generator, plugin, pytorch_calls):
    q = torch.randn(1, 2, 5, 4, generator=generator)
    with pytest.raises(RuntimeError, match="Currently do not support dropout > 0"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.1)
    assert pytorch_calls == ["_scaled_dot_product_flash_attention_for_cpu"]


def test_use_backend_is_followed(generator, plugin, fused_calls):
    q = torch.randn(1, 2, 5, 4, generator=generator)
    with fused_attn.use_backend("reference"):
        F.scaled_dot_product_attention(q, q, q)
    assert fused_calls["reference"] == [1, 0] and fused_calls["cpu"] == [0, 0]


def test_restore_gives_pytorch_its_kernels_back(generator, fused_calls):
    had_cuda = {name: torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CUDA") for name in CUDA_OPS}
    pytorch_origin = cpu_kernel_origin()
    q = torch.randn(1, 2, 5, 4, generator=generator)
    for _ in range(2):  # activating again (torch removes the active implementation first) works the same
        activate_flash_attention_impl("fused_attn")
        assert current_flash_attention_impl() == "fused_attn"
        assert "sdpa_plugin.py" in cpu_kernel_origin()
        assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CUDA") for name in CUDA_OPS)
    F.scaled_dot_product_attention(q, q, q)
    restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    assert cpu_kernel_origin() == pytorch_origin
    assert {name: torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CUDA")
            for name in CUDA_OPS} == had_cuda
    F.scaled_dot_product_attention(q, q, q)
    assert fused_calls["cpu"] == [1, 0]


# torch.compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled(generator, fused_calls, pytorch_calls, compiler):
    """A graph compiled before activation (forward and backward) calls our kernels while active: the
    operators are dispatched when the graph runs."""
    torch._dynamo.reset()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    compiled = torch.compile(attend, backend=compiler, fullgraph=True)
    q = laid_out((2, 4, 20, 8), "heads_inner", torch.float32, generator)
    k, v = (laid_out((2, 2, 20, 8), "contiguous", torch.float32, generator) for _ in range(2))
    grad_out = torch.randn(2, 4, 20, 8, generator=generator)

    def run():
        out = compiled(q, k, v)
        return out, torch.autograd.grad(out, (q, k, v), grad_out)

    before = run()
    assert fused_calls["cpu"] == [0, 0]
    activate_flash_attention_impl("fused_attn")
    try:
        out, grads = run()
    finally:
        restore_flash_attention_impl()
    assert fused_calls["cpu"] == [1, 1] and pytorch_calls == []
    actual = dict(zip(("out", "grad_query", "grad_key", "grad_value"), (out.detach() / 2, *(g / 2 for g in grads))))
    check_by_criterion(actual, q, k, v, grad_out, is_causal=True, enable_gqa=True)
    after = run()
    assert fused_calls["cpu"] == [1, 1]
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    torch._dynamo.reset()


def test_sdpa_inside_torch_functions_is_seen(generator, plugin, fused_calls):
    """Unlike redirect_sdpa (a TorchFunctionMode, off while torch's own functions run), the plug-in
    serves SDPA called by nn.MultiheadAttention."""
    attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16, generator=generator)
    attention(x, x, x, need_weights=False)
    assert fused_calls["cpu"] == [1, 0]


# The CUDA kernels, as far as a machine without a GPU goes -------------------------------------------


def test_every_kernel_matches_its_schema():
    for name, key, kernel in sdpa_plugin.KERNELS:
        op = getattr(torch.ops.aten, name).default
        sdpa_plugin.check_signature(op, kernel)
        assert key in ("CPU", "CUDA")
    with pytest.raises(RuntimeError, match="does not match this torch's schema"):
        sdpa_plugin.check_signature(torch.ops.aten._flash_attention_backward.default, lambda grad_out, query: None)


def meta_of(op, *args, **kwargs):
    """`op`'s meta kernel on meta copies (same shapes and strides) of the tensor arguments."""
    def as_meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    return op(*(as_meta(a) for a in args), **{name: as_meta(a) for name, a in kwargs.items()})


def assert_like_meta(results, meta):
    for got, promised in zip(results, meta):
        if isinstance(promised, torch.Tensor):
            assert (got.shape, got.dtype) == (promised.shape, promised.dtype)
            if got.numel() > 1:
                assert got.stride() == promised.stride()
        else:
            assert got == promised


@pytest.mark.parametrize("window", [None, (5, 0), (3, 4)], ids=["causal", "causal_window", "window"])
def test_flash_kernels_on_cpu_tensors(generator, fused_calls, window):
    """flash-attn's (B, L, H, D) operators, bottom-right causal and windows, GQA, as their meta kernels
    shape the results (the same Python runs for CUDA tensors)."""
    is_causal = window != (3, 4)
    left, right = window or (None, None)
    q = torch.randn(2, 7, 4, 16, generator=generator)
    k, v = (torch.randn(2, 11, 2, 16, generator=generator) for _ in range(2))
    grad_out = torch.randn(2, 7, 4, 16, generator=generator)
    args = (q, k, v, None, None, 7, 11, 0.0, is_causal, False)
    keywords = dict(scale=0.3, window_size_left=left, window_size_right=right)
    forward = sdpa_plugin._flash_forward(*args, **keywords)
    assert_like_meta(forward, meta_of(torch.ops.aten._flash_attention_forward.default, *args, **keywords))
    out, lse = forward[:2]
    inplace_out = torch.empty_like(q)
    inplace_lse = sdpa_plugin._flash_forward_inplace(inplace_out, *args, **keywords)
    torch.testing.assert_close((inplace_out, inplace_lse), (out, lse), rtol=0, atol=0)
    bwd_args = (grad_out, q, k, v, out, lse, None, None, 7, 11, 0.0, is_causal, forward[2], forward[3])
    bwd_keywords = dict(scale=0.3, window_size_left=left, window_size_right=right)
    grads = sdpa_plugin._flash_backward(*bwd_args, **bwd_keywords)
    assert_like_meta(grads, meta_of(torch.ops.aten._flash_attention_backward.default, *bwd_args, **bwd_keywords))
    assert fused_calls["cpu"] == [2, 1]
    variant = ScoreVariant(bottom_right=True, window_left=-1 if left is None else left,
                           window_right=-1 if right is None else right)
    heads_first = [t.transpose(1, 2) for t in (out, *grads)]
    testing.check_against_reference(testing.Results(heads_first[0], lse, *heads_first[1:]),
                                     *(t.transpose(1, 2) for t in (q, k, v, grad_out)), is_causal=is_causal,
                                     scale=0.3, variant=variant)


def test_flash_kernels_on_packed_sequences(generator):
    """varlen_attn's call: packed (total, H, D) sequences, each its own bottom-right causal problem."""
    lengths_q, lengths_k = [3, 6, 1], [5, 6, 4]
    cu_q = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11, 15], dtype=torch.int32)
    q = torch.randn(10, 4, 8, generator=generator)
    k, v = (torch.randn(15, 2, 8, generator=generator) for _ in range(2))
    grad_out = torch.randn(10, 4, 8, generator=generator)
    args = (q, k, v, cu_q, cu_k, 6, 6, 0.0, True, False)
    forward = sdpa_plugin._flash_forward(*args)
    assert_like_meta(forward, meta_of(torch.ops.aten._flash_attention_forward.default, *args))
    out, lse = forward[:2]
    grads = sdpa_plugin._flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, 6, 6, 0.0, True, forward[2],
                                        forward[3])
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(3):
        rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        assert rows.stop - rows.start == lengths_q[b] and keys.stop - keys.start == lengths_k[b]

        def heads_first(t):
            return t.transpose(0, 1).unsqueeze(0)

        actual = testing.Results(heads_first(out[rows]), lse[:, rows].unsqueeze(0), heads_first(grads[0][rows]),
                                 heads_first(grads[1][keys]), heads_first(grads[2][keys]))
        testing.check_against_reference(actual, heads_first(q[rows]), heads_first(k[keys]), heads_first(v[keys]),
                                        heads_first(grad_out[rows]), is_causal=True,
                                        variant=ScoreVariant(bottom_right=True))


def test_sdpa_flash_kernels_on_cpu_tensors(generator):
    """The CUDA flash operators of SDPA, (B, H, L, D), on CPU tensors, as their meta kernels shape the results."""
    q, k, v = (laid_out((2, 4, 9, 16), layout, torch.float32, generator).detach()
               for layout in ("contiguous", "heads_inner", "seq_first"))
    grad_out = torch.randn(2, 4, 9, 16, generator=generator)
    forward = sdpa_plugin._sdpa_flash_forward(q, k, v, 0.0, True)
    assert_like_meta(forward, meta_of(torch.ops.aten._scaled_dot_product_flash_attention.default, q, k, v, 0.0, True))
    out, lse = forward[:2]
    bwd_args = (grad_out, q, k, v, out, lse, None, None, 9, 9, 0.0, True, forward[6], forward[7])
    grads = sdpa_plugin._sdpa_flash_backward(*bwd_args)
    assert_like_meta(grads, meta_of(torch.ops.aten._scaled_dot_product_flash_attention_backward.default, *bwd_args))
    testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out, is_causal=True)


def test_flash_kernels_leave_what_they_cannot_match_to_pytorch(generator, fused_calls):
    q = torch.randn(1, 5, 2, 8, generator=generator)
    args = (q, q, q, None, None, 5, 5)
    assert sdpa_plugin._flash_forward(*args, 0.1, False, False) is None  # dropout: flash-attn's own elements
    assert sdpa_plugin._flash_forward(*args, 0.0, False, True) is None  # the debug mask
    assert sdpa_plugin._flash_forward(*args, 0.0, False, False, alibi_slopes=torch.ones(2)) is None
    assert sdpa_plugin._flash_forward(*(t.double() if isinstance(t, torch.Tensor) else t for t in args),
                                      0.0, False, False) is None
    assert fused_calls["cpu"] == [0, 0]
