"""The torch.library ops: opcheck, and torch.compile(fullgraph=True) without graph breaks."""

import pytest
import torch

import fused_attn
from fused_attn import masks, ops, testing
from fused_attn.backends import registry
from fused_attn.problem import Problem


def cpu_backends():
    """Backends that run on CPU tensors here, as the registry judges them: the Triton one only under
    its interpreter, which conftest switches on only where there is no GPU."""
    x = torch.empty(1, 1, 2, 8)
    problem = Problem.of(x, x, x, None, None, False, 0.0)
    return [name for name in registry.names() if not registry.reasons(registry.get(name), problem)]


def sample_inputs(dtype=torch.float32, requires_grad=True):
    """(args, description) for attention_fwd: features and layouts that the ops must all carry."""
    generator = torch.Generator().manual_seed(7)

    def tensor(shape, layout):
        values = torch.randn(shape, generator=generator, dtype=dtype)
        return testing.strided(values, layout).requires_grad_(requires_grad)

    full = (2, 4, 5, 6)
    bool_mask = testing.random_mask((1, 1, 5, 6), "bool", dtype, generator=generator).expand(full)
    additive = testing.random_mask((2, 4, 5, 6), "additive", dtype, generator=generator)
    padding = torch.rand(2, 6, generator=generator) < 0.3
    q, k, v = tensor((2, 4, 5, 8), "packed"), tensor((2, 2, 6, 8), "seq_first"), tensor((2, 2, 6, 3), "reversed")
    rng = torch.tensor([0x1234_5678_9ABC_DEF0, 3, 5, 7])  # (seed, offset, query_start, key_start): fused_attn.dropout
    # (q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_rng, seq_first)
    return [
        ((q, k, v, None, None, False, 0.35, 0.0, None, False), "gqa, plain"),
        ((q, k, v, bool_mask, padding, True, 0.35, 0.0, None, True),
         "bool mask, padding, causal, seq-first output"),
        ((q, k, v, additive, None, False, 1.0, 0.0, None, False), "additive mask"),
        ((q, k, v, bool_mask, padding, True, 0.35, 0.3, rng, False), "dropout"),
    ]


@pytest.mark.parametrize("backend", cpu_backends())
def test_opcheck_forward_and_backward(backend):
    for args, description in sample_inputs():
        if args[7] > 0.0 and not registry.get(backend).takes_dropout:
            continue
        torch.library.opcheck(ops.attention_fwd, (*args, backend))
        query, key, value = args[:3]
        out, lse = ops.attention_fwd(*args, backend)
        grad_out = torch.randn_like(out)
        bwd_args = (grad_out, None, query.detach(), key.detach(), value.detach(), out.detach(), lse.detach(),
                    *args[3:9], backend)
        torch.library.opcheck(ops.attention_bwd, bwd_args)
        mask = args[3]
        if mask is not None and mask.is_floating_point() and registry.get(backend).takes_mask_gradient:
            torch.library.opcheck(ops.attention_bwd, (*bwd_args, True))  # with the mask's gradient


def test_compiled_function_has_no_graph_breaks():
    def layer(x, weight):
        q, k, v = torch.nn.functional.linear(x, weight).chunk(3, dim=-1)
        return fused_attn.split_heads_attention(q, k, v, num_heads=2, is_causal=True).sum(-1)

    x = torch.randn(2, 5, 8, requires_grad=True)
    weight = torch.randn(24, 8, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    expected = layer(x, weight)
    got = compiled(x, weight)
    torch.testing.assert_close(got, expected)
    grads = torch.autograd.grad(got.sum(), (x, weight))
    expected_grads = torch.autograd.grad(expected.sum(), (x, weight))
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)


def test_compiled_function_follows_use_backend_blocks(monkeypatch):
    """A `use_backend` block is seen by torch.compile (no graph break), and leaving it recompiles."""
    chosen = []
    original = registry.choose
    monkeypatch.setattr(registry, "choose", lambda *a, **k: chosen.append(original(*a, **k).name) or
                        original(*a, **k))

    def layer(q):
        return fused_attn.attention(q, q, q, is_causal=True)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 2, 5, 8)
    with fused_attn.use_backend("reference"):
        inside = compiled(q)
    outside = compiled(q)
    torch.testing.assert_close(inside, outside)
    assert chosen[0] == "reference" and chosen[-1] != "reference", chosen


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_module_has_no_graph_breaks(compiler):
    torch.manual_seed(0)
    module = fused_attn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    mask = torch.rand(2, 5) < 0.2
    mask[:, 0] = False
    expected, _ = module(x, x, x, key_padding_mask=mask, need_weights=False)
    compiled = torch.compile(module, fullgraph=True, backend=compiler)
    got, _ = compiled(x, x, x, key_padding_mask=mask, need_weights=False)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    assert module.in_proj_weight.grad is not None


def test_the_op_is_skipped_only_where_it_has_nothing_to_do(monkeypatch):
    """Plain eager calls without a gradient to record run the op's body directly, with the same
    result; calls that record autograd, and calls on tensor subclasses, go through the op."""
    entered = []
    original = ops.attention_fwd

    def counting(*args):
        entered.append(args[10])  # the backend
        return original(*args)

    monkeypatch.setattr(ops, "attention_fwd", counting)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=generator) for _ in range(3))
    direct = fused_attn.attention(q, k, v, is_causal=True, backend="reference")
    with torch.no_grad():
        fused_attn.attention(q.requires_grad_(), k, v, backend="reference")
    assert entered == []

    recorded = fused_attn.attention(q, k, v, is_causal=True, backend="reference")
    assert entered == ["reference"] and recorded.grad_fn is not None
    torch.testing.assert_close(recorded, direct, rtol=0, atol=0)

    with torch.no_grad():
        fused_attn.attention(torch.nn.Parameter(k), k, v, backend="reference")
    assert entered == ["reference", "reference"]


@pytest.mark.parametrize("backend", cpu_backends())
def test_opcheck_with_sinks(backend):
    """Sinks (the op's last argument) through the op, its fake kernel and its autograd."""
    if "sinks" not in registry.get(backend).takes_score_variants:
        pytest.skip(f"{backend} does not take sinks")
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    for args, description in sample_inputs():
        if args[7] > 0.0 and not registry.get(backend).takes_dropout:
            continue
        torch.library.opcheck(ops.attention_fwd, (*args, backend, -1, -1, False, 0.0, None, 0, None, None, sinks))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_opcheck_with_a_mask_program(backend):
    """A mask program (block_tiles, block_bits) through the op, its fake kernel and its autograd."""
    for args, description in sample_inputs():
        if args[3] is not None or args[7] > 0.0 and not registry.get(backend).takes_dropout:
            continue  # (a program comes instead of a dense mask)
        query, key = args[0], args[1]
        program = masks.mask_program(masks.chunks(3) | masks.causal(), len_q=query.shape[2], len_k=key.shape[2])
        tiles, bits = program.for_call(query.shape[0], query.shape[1], query.shape[2], key.shape[2], query.device)
        torch.library.opcheck(ops.attention_fwd, (*args, backend, -1, -1, False, 0.0, None, 0, tiles, bits, None))


def test_compiled_split_heads_with_sinks_has_no_graph_breaks():
    """A gpt-oss-like layer, the sinks a learned parameter: compiled, the same values and gradients."""
    def layer(x, weight, sinks):
        q, k, v = torch.nn.functional.linear(x, weight).chunk(3, dim=-1)
        return fused_attn.split_heads_attention(q, k, v, num_heads=2, is_causal=True, sinks=sinks).sum(-1)

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 8, generator=generator, requires_grad=True)
    weight = torch.randn(24, 8, generator=generator, requires_grad=True)
    sinks = torch.randn(2, generator=generator, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    expected = layer(x, weight, sinks)
    got = compiled(x, weight, sinks)
    torch.testing.assert_close(got, expected)
    grads = torch.autograd.grad(got.sum(), (x, weight, sinks))
    expected_grads = torch.autograd.grad(expected.sum(), (x, weight, sinks))
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)
    reference = fused_attn.split_heads_attention(*torch.nn.functional.linear(x, weight).chunk(3, dim=-1),
                                                 num_heads=2, is_causal=True, sinks=sinks, backend="reference")
    torch.testing.assert_close(got, reference.sum(-1))
