"""redirect_sdpa: code written against F.scaled_dot_product_attention runs on fused_attn, eager and
compiled; what fused_attn cannot serve runs as PyTorch runs it."""

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask
# Bound at import, before any redirect is entered, as library code binds it.
from torch.nn.functional import scaled_dot_product_attention

import fused_attn
from fused_attn import testing
from fused_attn.backends import registry

EMBED, HEADS, LENGTH = 16, 2, 7


class Projected(torch.nn.Module):
    """One packed (E -> 3E) in-projection and an out-projection, as both attention styles below have."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(EMBED, 3 * EMBED)
        self.proj = torch.nn.Linear(EMBED, EMBED)


class CausalSelfAttention(Projected):
    """A hand-written GPT block's attention: the projection split into heads by views."""

    def forward(self, x):
        batch, length, embed = x.shape
        q, k, v = (t.view(batch, length, HEADS, embed // HEADS).transpose(1, 2)
                   for t in self.qkv(x).split(embed, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, embed))


class TimmAttention(Projected):
    """timm's ViT attention: qkv reshaped and permuted, scale as a keyword, the early-bound name."""

    def forward(self, x):
        batch, length, embed = x.shape
        qkv = self.qkv(x).reshape(batch, length, 3, HEADS, embed // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = scaled_dot_product_attention(q, k, v, scale=0.3)
        return self.proj(y.transpose(1, 2).reshape(batch, length, embed))


MODULES = {"gpt": CausalSelfAttention, "timm": TimmAttention}


@pytest.fixture
def fresh_dynamo():
    """Every compiled test traces afresh: no cache entry of another test (or a recompile limit) in the way."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def random_module(name, generator, dtype):
    module = MODULES[name]()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return module.to(dtype)


def run(module, x, forward=None):
    """Output and gradients (of the input and every parameter) of `module` at `x`, by name; `forward`
    calls it (a compiled module, say)."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    out = (module if forward is None else forward)(x)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    results = {"out": out.detach(), "grad_x": x.grad}
    results.update({f"grad_{name}": p.grad for name, p in module.named_parameters()})
    return results


def check_module(module, x, redirected):
    """The project's criterion (fused_attn.testing): against the module in float64 and in its own dtype,
    both on PyTorch's SDPA, for the output and every gradient. `redirected(module, x)` runs it."""
    dtype = x.dtype
    exact = run(copy.deepcopy(module).double(), x.double())
    same_dtype = run(module, x)
    actual = redirected(module, x)
    for name, value in actual.items():
        error = testing.max_error(value, exact[name])
        allowed = testing.allowed_error(name, exact[name], same_dtype[name], dtype)
        assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def redirected_run(module, x):
    with fused_attn.redirect_sdpa():
        return run(module, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODULES))
def test_modules_run_on_the_fused_kernels_and_match_sdpa(generator, fused_calls, name, dtype):
    module = random_module(name, generator, dtype)
    x = torch.randn(2, LENGTH, EMBED, generator=generator).to(dtype)
    check_module(module, x, redirected_run)
    assert fused_calls["cpu"] == [1, 1]
    assert sum(forwards for forwards, _ in fused_calls.values()) == 1


def test_calls_outside_the_block_run_on_pytorch(generator, fused_calls):
    q, k, v = (torch.randn(2, 2, 5, 4, generator=generator) for _ in range(3))
    with fused_attn.redirect_sdpa():
        inside = F.scaled_dot_product_attention(q, k, v)
    outside = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(inside, outside)
    assert fused_calls["cpu"] == [1, 0]


def test_decorator_form(generator, fused_calls):
    @fused_attn.redirect_sdpa()
    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(1, 2, 5, 4, generator=generator) for _ in range(3))
    torch.testing.assert_close(attend(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    attend(q, k, v)
    assert fused_calls["cpu"] == [2, 0]


@pytest.mark.parametrize("shape_q,shape_kv,options", [
    ((9, 8), (11, 8), {}),  # (L, D)
    ((4, 9, 8), (4, 11, 6), {"is_causal": True}),  # (H, L, D)
    ((4, 9, 8), (2, 11, 8), {"enable_gqa": True}),  # grouping along dim -3, as SDPA's
    ((2, 3, 2, 9, 8), (2, 3, 2, 11, 8), {"attn_mask": (2, 3, 1, 9, 11)}),  # batch dims merged
], ids=["2d", "3d", "3d_gqa", "5d_mask"])
def test_leading_dims_are_merged_into_batch_and_heads(generator, fused_calls, shape_q, shape_kv, options):
    q = torch.randn(shape_q, generator=generator, requires_grad=True)
    k = torch.randn(shape_kv[:-1] + (shape_q[-1],), generator=generator, requires_grad=True)
    v = torch.randn(shape_kv, generator=generator, requires_grad=True)
    if "attn_mask" in options:
        options = {**options, "attn_mask": testing.random_mask(options["attn_mask"], "additive", torch.float32,
                                                               generator=generator)}
        options["attn_mask"][..., 0] = 0.0  # no row entirely hidden: SDPA gives NaN there
    grad = torch.randn(shape_q[:-1] + shape_kv[-1:], generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, **options)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    with fused_attn.redirect_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, **options)
    grads = torch.autograd.grad(got, (q, k, v), grad)
    assert fused_calls["cpu"] == [1, 1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_float16_on_cpu_is_served(generator, fused_calls):
    """fused_attn's cpu backend takes float16, so the redirect serves it (it is no pass-through case)."""
    q, k, v = (torch.randn(2, 2, 9, 8, generator=generator).half() for _ in range(3))
    with fused_attn.redirect_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert fused_calls["cpu"] == [1, 0]
    testing.check_against_reference(testing.Results(out, None), q, k, v, is_causal=True)


def passes_through(q, k, v, **options):
    """Same result as PyTorch's SDPA, to the bit (the fused_calls fixture counts the kernels)."""
    expected = F.scaled_dot_product_attention(q, k, v, **options)
    with fused_attn.redirect_sdpa():
        got = F.scaled_dot_product_attention(q, k, v, **options)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_what_fused_attn_cannot_serve_runs_on_pytorch(generator, fused_calls):
    randn = lambda *shape: torch.randn(shape, generator=generator)  # noqa: E731
    q, k, v = randn(2, 2, 5, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 4)
    # Batch dims that merge only by a copy (the first two transposed).
    tangled = randn(3, 2, 2, 5, 4).transpose(0, 1)
    passes_through(tangled, tangled, tangled)
    # A mask that varies along the inner of two batch dims and broadcasts along the outer: a copy too.
    five = randn(2, 3, 2, 5, 4)
    passes_through(five, five, five, attn_mask=randn(3, 1, 5, 5))
    # Batch dims that broadcast, which fused_attn does not take.
    passes_through(q, k[:1], v[:1])
    # A float32 mask on bfloat16 inputs: fused_attn takes masks of the query's dtype only.
    passes_through(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=randn(5, 5))
    # Meta tensors: no backend runs on them.
    meta = q.to("meta")
    with fused_attn.redirect_sdpa():
        assert F.scaled_dot_product_attention(meta, meta, meta).shape == q.shape
    assert fused_calls["cpu"] == [0, 0] and fused_calls["reference"] == [0, 0]


def test_arguments_pytorch_refuses_get_pytorch_errors(generator, fused_calls):
    q = torch.randn(1, 2, 5, 4, generator=generator)
    for call in (lambda: F.scaled_dot_product_attention(q, q, q, window=3),
                 lambda: F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)):
        with pytest.raises(TypeError) as plain:
            call()
        with fused_attn.redirect_sdpa(), pytest.raises(TypeError) as redirected:
            call()
        assert str(redirected.value) == str(plain.value)
    assert fused_calls["cpu"] == [0, 0]


def test_keyword_arguments_and_causal_bias(generator, fused_calls):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = (torch.randn(1, 2, length, 4, generator=generator) for length in (5, 8, 8))
    expected = F.scaled_dot_product_attention(q, k, v, causal_lower_right(5, 8))
    with fused_attn.redirect_sdpa():
        by_name = F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=causal_lower_right(5, 8))
    torch.testing.assert_close(by_name, expected)
    assert fused_calls["cpu"] == [1, 0]


def test_jagged_nested_tensors_run_as_packed_batches(generator, fused_calls):
    def nested(*lengths):
        parts = [torch.randn(length, 2, 4, generator=generator) for length in lengths]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    q = nested(3, 6)
    k = v = nested(4, 2)
    expected = F.scaled_dot_product_attention(q, k, v)
    with fused_attn.redirect_sdpa():
        got = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got.values(), expected.values())
    assert fused_calls["cpu"][0] >= 1


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_backend_selects_the_kernels(generator, fused_calls, backend):
    q, k, v = (torch.randn(1, 2, 5, 4, generator=generator) for _ in range(3))
    with fused_attn.redirect_sdpa(backend=backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert {name: c[0] for name, c in fused_calls.items() if c[0]} == {backend: 1}


def test_use_backend_inside_the_block_is_followed(generator, fused_calls):
    q = torch.randn(1, 2, 5, 4, generator=generator)
    with fused_attn.redirect_sdpa(), fused_attn.use_backend("reference"):
        F.scaled_dot_product_attention(q, q, q)
    assert fused_calls["reference"] == [1, 0] and fused_calls["cpu"] == [0, 0]


def test_backend_a_call_cannot_run_on_raises(generator):
    meta = torch.randn(1, 2, 5, 4, generator=generator).to("meta")
    with fused_attn.redirect_sdpa(backend="cpu"), pytest.raises(fused_attn.BackendError, match="'cpu' cannot run"):
        F.scaled_dot_product_attention(meta, meta, meta)


def test_bad_backend_names_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"backend: expected one of .*'cpu'.*got 'gpu'"):
        fused_attn.redirect_sdpa(backend="gpu")
    with pytest.raises(TypeError, match="backend: expected None or a backend name, got int"):
        fused_attn.redirect_sdpa(backend=1)


def test_kernel_errors_surface(generator, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel failure")

    monkeypatch.setattr(registry.get("cpu"), "forward", broken)
    q = torch.randn(1, 2, 5, 4, generator=generator)
    with fused_attn.redirect_sdpa(), pytest.raises(RuntimeError, match="kernel failure"):
        F.scaled_dot_product_attention(q, q, q)


def test_nesting_and_reentry(generator, fused_calls):
    q = torch.randn(1, 2, 5, 4, generator=generator)
    outer = fused_attn.redirect_sdpa(backend="cpu")
    with outer:
        with fused_attn.redirect_sdpa(backend="reference"):
            F.scaled_dot_product_attention(q, q, q)  # the innermost block decides
        with outer:
            F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    assert torch._C._len_torch_function_stack() == 0
    assert fused_calls["reference"] == [1, 0] and fused_calls["cpu"] == [2, 0]

    @fused_attn.redirect_sdpa()
    def deep(x, depth):
        y = F.scaled_dot_product_attention(x, x, x)
        return y if depth == 0 else deep(y, depth - 1)

    deep(q, 3)
    assert fused_calls["cpu"] == [6, 0]


# torch.compile ------------------------------------------------------------------------------------


def compiled_run(compiler):
    def redirected(module, x):
        compiled = torch.compile(module, backend=compiler, fullgraph=True)
        with fused_attn.redirect_sdpa():
            return run(module, x, compiled)

    return redirected


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compiled_module_called_inside_the_block(generator, fused_calls, fresh_dynamo, compiler):
    module = random_module("gpt", generator, torch.float32)
    x = torch.randn(2, LENGTH, EMBED, generator=generator)
    check_module(module, x, compiled_run(compiler))
    assert fused_calls["cpu"] == [1, 1]


@pytest.mark.parametrize("form", ["with", "decorator", "graph_break"])
def test_block_entered_inside_the_compiled_function(generator, fused_calls, fresh_dynamo, form):
    def attend(q, k, v):
        with fused_attn.redirect_sdpa(backend="reference"):
            if form == "graph_break":  # the rest of the block resumes in a new frame, the mode still on
                torch._dynamo.graph_break()
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if form == "decorator":
        attend = fused_attn.redirect_sdpa(backend="reference")(
            lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = (torch.randn(1, 2, 5, 4, generator=generator) for _ in range(3))
    got = torch.compile(attend, backend="eager", fullgraph=form != "graph_break")(q, k, v)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert fused_calls["reference"] == [1, 0]
    assert torch._C._len_torch_function_stack() == 0


def test_compiled_function_recompiles_when_the_block_changes(generator, fused_calls, fresh_dynamo):
    compiled = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q) * 2, backend="eager", fullgraph=True)
    q = torch.randn(1, 2, 5, 4, generator=generator)
    before = compiled(q)
    with fused_attn.redirect_sdpa():
        inside = compiled(q)
    with fused_attn.redirect_sdpa(backend="reference"):  # the graph is guarded on the backend too
        compiled(q)
    after = compiled(q)
    assert fused_calls["cpu"] == [1, 0] and fused_calls["reference"] == [1, 0]
    torch.testing.assert_close(inside, before)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_compiled_pass_through(generator, fused_calls, fresh_dynamo):
    q = torch.randn(1, 2, 5, 4, generator=generator).bfloat16()
    mask = torch.randn(5, 5, generator=generator)

    def attend(q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    with fused_attn.redirect_sdpa():
        got = torch.compile(attend, backend="eager", fullgraph=True)(q)
    torch.testing.assert_close(got, attend(q), rtol=0, atol=0)
    assert fused_calls["cpu"] == [0, 0]


# FlexAttention ------------------------------------------------------------------------------------


@pytest.fixture
def flex_call(generator):
    """q, k, v (B=2, H=2, L=300) and a BlockMask of causal documents, different in each batch row; torch's
    eager flex_attention's warning that it materialises the scores is silenced."""
    docs = torch.randint(0, 4, (2, 300), generator=generator).sort(dim=1).values

    def documents_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(documents_causal, 2, None, 300, 300, device="cpu")
    q, k, v = (torch.randn(2, 2, 300, 16, generator=generator) for _ in range(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield q, k, v, block_mask


def test_flex_attention_through_its_module_runs_on_fused_attn(flex_call, fused_calls):
    """Forward and backward (which torch's flex_attention does not run on the CPU) on the fused kernels."""
    q, k, v, block_mask = flex_call
    expected, expected_aux = flex_module.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        flex_module.flex_attention(q, k, v, block_mask=block_mask)
    with fused_attn.redirect_sdpa():
        out, aux = flex_module.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        unmasked = flex_module.flex_attention(q, k, v, None, None, 0.5)  # positional, no BlockMask
    out.sum().backward()
    assert fused_calls["cpu"] == [2, 1] and q.grad is not None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse, expected_aux.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unmasked, F.scaled_dot_product_attention(q, k, v, scale=0.5), rtol=1e-5, atol=1e-5)


def test_flex_calls_fused_attn_cannot_serve_run_on_torch(flex_call, fused_calls):
    q, k, v, block_mask = flex_call

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - (q_idx - kv_idx).abs() * 0.01

    expected = flex_module.flex_attention(q, k, v, score_mod, block_mask)
    with fused_attn.redirect_sdpa():
        got = flex_module.flex_attention(q, k, v, score_mod, block_mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # What torch refuses, it refuses inside the block too, with its own error: max_scores (not on the CPU),
    # a BlockMask of other lengths.
    with fused_attn.redirect_sdpa(), pytest.raises(NotImplementedError, match="Returning max scores"):
        flex_module.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True, max_scores=True))
    with fused_attn.redirect_sdpa(), pytest.raises(ValueError, match="block_mask was created for"):
        flex_module.flex_attention(q[:, :, :200], k, v, block_mask=block_mask)
    flex_module.flex_attention(q, k, v, block_mask=block_mask)  # after the block: torch's
    assert all(counts == [0, 0] for counts in fused_calls.values())


def test_what_the_flex_redirect_sees(flex_call, fused_calls):
    """torch's function itself (a name bound before the first redirect was made) is not seen; the module
    attribute, and names imported from it after the first redirect, are."""
    q, k, v, block_mask = flex_call
    fused_attn.redirect_sdpa()  # the first redirect made puts the router in place
    torch_own = inspect.unwrap(flex_module.flex_attention)
    assert flex_module.flex_attention is not torch_own
    assert inspect.signature(flex_module.flex_attention) == inspect.signature(torch_own)
    from torch.nn.attention.flex_attention import flex_attention as imported_late

    with fused_attn.redirect_sdpa(backend="reference"):
        torch_own(q, k, v, block_mask=block_mask)
        imported_late(q, k, v, block_mask=block_mask)
    assert fused_calls["reference"] == [1, 0] and fused_calls["cpu"] == [0, 0]


def test_compiled_flex_attention_stays_torchs(flex_call, fused_calls, fresh_dynamo):
    q, k, v, block_mask = flex_call

    def attend(q):
        return flex_module.flex_attention(q, k, v, block_mask=block_mask)

    with fused_attn.redirect_sdpa():
        got = torch.compile(attend, backend="eager", fullgraph=True)(q)
    torch.testing.assert_close(got, attend(q))
    assert all(counts == [0, 0] for counts in fused_calls.values())
