"""fused_attn.attention and split_heads_attention: semantics, layouts, registry, against SDPA."""

import importlib.util
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import fused_attn
from fused_attn import ops, testing
from fused_attn.backends import registry


def randn(generator, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=generator, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", ["plain", "causal", "bool_mask", "additive_mask", "gqa", "scale",
                                     "lengths", "head_dims"])
def test_matches_sdpa(generator, dtype, feature):
    len_q, len_k, dim_v = (7, 11, 5) if feature in ("lengths", "head_dims") else (6, 6, 8)
    heads_kv = 2 if feature == "gqa" else 4
    q = randn(generator, 2, 4, len_q, 8, dtype=dtype).requires_grad_()
    k = randn(generator, 2, heads_kv, len_k, 8, dtype=dtype).requires_grad_()
    v = randn(generator, 2, heads_kv, len_k, dim_v if feature == "head_dims" else 8,
              dtype=dtype).requires_grad_()
    mask = None
    if feature in ("bool_mask", "additive_mask"):
        mask = testing.random_mask((2, 1, len_q, len_k), feature.split("_")[0], dtype, generator=generator)
        mask[..., 0] = True if mask.dtype == torch.bool else 0.0  # no row entirely hidden: SDPA gives NaN
    kwargs = dict(attn_mask=mask, is_causal=feature == "causal", scale=0.3 if feature == "scale" else None,
                  enable_gqa=feature == "gqa")
    ours = fused_attn.attention(q, k, v, **kwargs)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    grad = randn(generator, *theirs.shape, dtype=dtype)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    theirs_grads = torch.autograd.grad(theirs, (q, k, v), grad)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(ours, theirs, **tolerance)
    for a, b in zip(ours_grads, theirs_grads):
        torch.testing.assert_close(a, b, **tolerance)


@pytest.mark.parametrize("layouts", [("contiguous", "heads_inner", "seq_first", "packed", "reversed"),
                                     ("packed", "reversed", "contiguous", "seq_first", "heads_inner"),
                                     ("reversed", "packed", "heads_inner", "contiguous", "seq_first")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_backend_meets_criterion_with_independent_layouts(generator, layouts, dtype):
    q_layout, k_layout, v_layout, grad_layout, mask_layout = layouts
    q, k, v = (testing.strided(randn(generator, *shape).to(dtype), layout).requires_grad_()
               for shape, layout in (((2, 4, 9, 8), q_layout), ((2, 2, 13, 8), k_layout),
                                     ((2, 2, 13, 6), v_layout)))
    mask = testing.strided(testing.random_mask((2, 4, 9, 13), "additive", dtype, generator=generator),
                           mask_layout)[:, :1]
    padding = torch.rand(2, 13, generator=generator) < 0.2
    options = dict(attn_mask=mask, key_padding_mask=padding, is_causal=True)
    out, lse = fused_attn.attention(q, k, v, enable_gqa=True, return_lse=True, backend="reference", **options)
    grad_out = testing.strided(randn(generator, *out.shape).to(dtype), grad_layout)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out, **options)


def test_gradient_through_lse_matches_eager_autograd(generator):
    q, k, v = (randn(generator, 1, 2, 5, 4, dtype=torch.float64).requires_grad_() for _ in range(3))
    out, lse = fused_attn.attention(q, k, v, is_causal=True, return_lse=True, backend="reference")
    loss = out.sum() + (lse * torch.arange(10, dtype=lse.dtype).view(lse.shape)).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    from fused_attn.backends.reference import attention as eager
    out_e, lse_e = eager(q, k, v, is_causal=True)
    loss_e = out_e.sum() + (lse_e * torch.arange(10, dtype=lse.dtype).view(lse.shape)).sum()
    for a, b in zip(grads, torch.autograd.grad(loss_e, (q, k, v))):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda *t: fused_attn.attention(*t, is_causal=True, return_lse=True, backend="reference"), (q, k, v))


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_gradients(generator):
    q, k, v = (randn(generator, 1, 2, 4, 8).requires_grad_() for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    out, lse = fused_attn.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (out[:, :, 1] == 0).all() and (lse[:, :, 1] == float("-inf")).all()
    grad_q, _, _ = torch.autograd.grad(out.sum(), (q, k, v))
    assert (grad_q[:, :, 1] == 0).all() and torch.isfinite(grad_q).all()


def test_mask_gradient_matches_sdpa_and_dropout_reproduces(generator):
    q, k, v = (randn(generator, 1, 2, 4, 8, dtype=torch.float64).requires_grad_() for _ in range(3))
    bias = randn(generator, 1, 2, 4, 4, dtype=torch.float64).requires_grad_()
    ours = torch.autograd.grad(fused_attn.attention(q, k, v, attn_mask=bias).sum(), bias)[0]
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum(), bias)[0]
    torch.testing.assert_close(ours, theirs)
    torch.manual_seed(3)
    dropped = fused_attn.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(dropped, fused_attn.attention(q, k, v, dropout_p=0.5))
    assert not torch.allclose(dropped, fused_attn.attention(q, k, v))


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_heads_reads_a_packed_projection_in_place(generator, batch_first, monkeypatch):
    batch, length, heads, dim = 2, 5, 3, 4
    shape = (batch, length, 3 * heads * dim) if batch_first else (length, batch, 3 * heads * dim)
    packed = randn(generator, *shape)
    q, k, v = packed.chunk(3, dim=-1)
    seen = []
    original = ops.attention

    def spy(query, key, value, *args):
        seen.extend(t.untyped_storage().data_ptr() for t in (query, key, value))
        return original(query, key, value, *args)

    monkeypatch.setattr(ops, "attention", spy)
    merged = fused_attn.split_heads_attention(q, k, v, heads, is_causal=True, batch_first=batch_first)
    assert set(seen) == {packed.untyped_storage().data_ptr()}
    assert merged.is_contiguous() and merged.shape == q.shape

    def heads_of(t):
        t = t if batch_first else t.transpose(0, 1)
        return t.reshape(batch, length, heads, dim).transpose(1, 2)

    expected = F.scaled_dot_product_attention(heads_of(q), heads_of(k), heads_of(v), is_causal=True)
    expected = expected.transpose(1, 2).reshape(batch, length, heads * dim)
    torch.testing.assert_close(merged if batch_first else merged.transpose(0, 1), expected)


def test_split_heads_with_grouped_query_heads(generator):
    q, k, v = randn(generator, 2, 5, 12), randn(generator, 2, 7, 4), randn(generator, 2, 7, 6)
    merged = fused_attn.split_heads_attention(q, k, v, 6, num_kv_heads=2)
    heads = [t.unflatten(-1, (h, -1)).transpose(1, 2) for t, h in ((q, 6), (k, 2), (v, 2))]
    expected = F.scaled_dot_product_attention(*heads, enable_gqa=True).transpose(1, 2).flatten(2)
    torch.testing.assert_close(merged, expected)


def test_registry_choice_explicit_context_and_environment(generator, monkeypatch):
    q = randn(generator, 1, 1, 2, 4)
    backends = fused_attn.available_backends()
    assert backends["reference"] is None
    problem = fused_attn.problem.Problem.of(q, q, q, None, None, False, 0.0)
    assert registry.choose(problem).name in {name for name, why in backends.items() if why is None}
    assert registry.choose(problem, "reference").name == "reference"
    monkeypatch.setenv("FUSED_ATTN_BACKEND", "reference")
    assert registry.choose(problem).name == "reference"
    monkeypatch.setenv("FUSED_ATTN_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="backend: expected one of"):
        fused_attn.attention(q, q, q)
    with fused_attn.use_backend("reference"):
        assert registry.choose(problem).name == "reference"
    with pytest.raises(ValueError, match="backend: expected one of"):
        with fused_attn.use_backend("no-such-backend"):
            pass


def test_use_backend_holds_for_its_own_thread_only(generator):
    q = randn(generator, 1, 1, 2, 4)
    problem = fused_attn.problem.Problem.of(q, q, q, None, None, False, 0.0)
    automatic = registry.choose(problem).name
    if automatic == "reference":
        pytest.skip("the reference is the automatic choice here: a block could not be seen")
    inside, entered, leave = [], threading.Event(), threading.Event()

    def worker():
        with fused_attn.use_backend("reference"):
            inside.append(registry.choose(problem).name)
            entered.set()
            leave.wait(timeout=30)
            inside.append(registry.choose(problem).name)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        # The other thread is inside its block: this one keeps the automatic choice, and its own
        # block leaves the other thread's request alone.
        assert registry.choose(problem).name == automatic
        with fused_attn.use_backend(automatic):
            assert registry.choose(problem).name == automatic
    finally:
        leave.set()
        thread.join(timeout=30)
    assert inside == ["reference", "reference"]
    assert registry.choose(problem).name == automatic


def test_available_backends_say_why_gpu_backends_are_missing():
    reasons = fused_attn.available_backends()
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    if fused_attn._extension.missing_reason:
        expected = "fused_attn._C"
    elif torch.version.cuda is None:
        expected = "built without CUDA kernels"  # a CPU build of torch cannot compile them
    else:
        expected = "no CUDA device"  # a CUDA build of torch, with nvcc, compiled them
    assert expected in reasons["cuda"], reasons
    script = ("import fused_attn; print(fused_attn.available_backends()['triton'])")
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr
    if importlib.util.find_spec("triton") is not None:
        assert result.stdout.startswith("no CUDA device"), result.stdout
        assert "TRITON_INTERPRET=1" in result.stdout
    else:
        assert "not installed" in result.stdout


def test_explicit_backend_that_cannot_run_lists_every_backend(generator):
    q = randn(generator, 1, 1, 2, 4)
    refusing = [name for name in registry.names() if name != "reference"]
    if not refusing:
        pytest.skip("only the reference backend is registered")
    q = torch.empty(1, 1, 2, 4, device="meta")  # a device no backend runs on
    for name in refusing:
        with pytest.raises(fused_attn.BackendError) as error:
            fused_attn.attention(q, q, q, backend=name)
        for other in registry.names():
            assert f"{other}:" in str(error.value)


def test_package_imports_and_runs_without_the_extension():
    script = (
        "import sys; sys.modules['fused_attn._C'] = None\n"
        "import torch, fused_attn\n"
        "from fused_attn import _extension\n"
        "assert _extension.missing_reason and 'fused_attn._C' in _extension.missing_reason\n"
        "reasons = fused_attn.available_backends()\n"
        "assert reasons['reference'] is None\n"
        "assert all(reasons[name] for name in ('cpu', 'cuda') if name in reasons), reasons\n"
        "q = torch.randn(1, 2, 3, 4)\n"
        "print(fused_attn.attention(q, q, q).shape)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr
    assert "torch.Size([1, 2, 3, 4])" in result.stdout


def test_gradient_through_lse_of_hidden_rows_is_zero_not_nan(generator):
    q, k, v = (randn(generator, 1, 2, 4, 8, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = torch.zeros(4, 4, dtype=torch.float64)
    mask[2] = float("-inf")
    for backend in ("reference", None):
        out, lse = fused_attn.attention(q, k, v, attn_mask=mask, return_lse=True, backend=backend)
        grads = torch.autograd.grad(out.sum() + lse[lse.isfinite()].sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][:, :, 2] == 0).all()
    from fused_attn.backends.reference import attention as eager
    out, lse = eager(q, k, v, mask)
    grads = torch.autograd.grad(out.sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_a_bool_mask_of_batch_and_keys_runs_as_key_padding(generator):
    """(B, 1, 1, L_k) bool masks, as libraries pass padding, run as key_padding_mask (bit-identical
    to it) and agree with the reference given the mask itself; merged with a key_padding_mask too."""
    q = torch.randn(2, 3, 9, 8, generator=generator)
    k, v = (torch.randn(2, 3, 13, 8, generator=generator) for _ in range(2))
    attend = torch.rand(2, 1, 1, 13, generator=generator) > 0.3
    padding = torch.rand(2, 13, generator=generator) < 0.2
    as_mask = fused_attn.attention(q, k, v, attend, is_causal=True, backend="cpu")
    as_padding = fused_attn.attention(q, k, v, key_padding_mask=~attend[:, 0, 0], is_causal=True, backend="cpu")
    assert torch.equal(as_mask, as_padding)
    torch.testing.assert_close(as_mask, fused_attn.attention(q, k, v, attend.expand(2, 3, 9, 13).clone(),
                                                             is_causal=True, backend="reference"))
    both = fused_attn.attention(q, k, v, attend, key_padding_mask=padding, backend="cpu")
    expected = fused_attn.attention(q, k, v, attend & ~padding[:, None, None, :], backend="reference")
    torch.testing.assert_close(both, expected)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_no_keys_give_zero_rows_on_every_cpu_backend(generator, backend):
    q = torch.randn(2, 3, 4, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, 3, 0, 8)
    out, lse = fused_attn.attention(q, k, k, return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros(2, 3, 4, 8)) and bool((lse == float("-inf")).all())
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(grad, torch.zeros_like(q))


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_heads_takes_unbatched_inputs_as_multihead_attention_does(generator, batch_first):
    """(L, E) inputs, masks of (H, L_q, L_k) and key padding of (L_k,): the batch of one, squeezed."""
    heads, dim = 4, 8
    x = torch.randn(11, heads * dim, generator=generator, requires_grad=True)
    memory = torch.randn(13, 2 * dim, generator=generator)
    mask = torch.randn(heads, 11, 13, generator=generator)
    padding = torch.zeros(13, dtype=torch.bool)
    padding[-3:] = True
    options = dict(num_kv_heads=2, batch_first=batch_first, return_lse=True, backend="cpu", softcap=5.0)
    out, lse = fused_attn.split_heads_attention(x, memory, memory, heads, mask, key_padding_mask=padding, **options)
    batch_dim = 0 if batch_first else 1
    expected, expected_lse = fused_attn.split_heads_attention(
        x.unsqueeze(batch_dim), memory.unsqueeze(batch_dim), memory.unsqueeze(batch_dim), heads, mask,
        key_padding_mask=padding[None], **options)
    assert out.shape == (11, heads * dim) and lse.shape == (heads, 11)
    torch.testing.assert_close(out, expected.squeeze(batch_dim), rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse[0], rtol=0, atol=0)
    grad, = torch.autograd.grad(out.sum(), x)
    assert grad.shape == x.shape and torch.isfinite(grad).all()
    with pytest.raises(ValueError, match="key: expected a 2-D tensor"):
        fused_attn.split_heads_attention(x, memory[None], memory, heads)
