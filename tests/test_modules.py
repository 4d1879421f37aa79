"""fused_attn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights."""

import itertools

import pytest
import torch
from torch import nn

import fused_attn

EMBED, HEADS, BATCH, LEN_Q, LEN_K = 12, 3, 2, 5, 7


def make_pair(generator, **options):
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=generator)))
    theirs = nn.MultiheadAttention(EMBED, HEADS, dtype=torch.float64, **options)
    ours = fused_attn.MultiheadAttention(EMBED, HEADS, dtype=torch.float64, **options)
    ours.load_state_dict(theirs.state_dict())
    # Non-zero biases (nn initialises some to zero), so that every parameter is exercised.
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def sequence(generator, length, dim, batch_first, batched=True):
    shape = ((BATCH, length, dim) if batch_first else (length, BATCH, dim)) if batched else (length, dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_()


def nn_mask(generator, kind, shape):
    """A mask in nn.MultiheadAttention's convention (bool True = hidden), key 0 always visible."""
    hidden = torch.rand(shape, generator=generator) < 0.3
    hidden[..., 0] = False
    if kind == "bool":
        return hidden
    return torch.randn(shape, generator=generator, dtype=torch.float64).masked_fill(hidden, float("-inf"))


def run_both(theirs, ours, inputs, **kwargs):
    results = []
    for module in (theirs, ours):
        leaves = [t for t in inputs if t.requires_grad]
        out, weights = module(*inputs, **kwargs)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
        if weights is not None:
            loss = loss + (weights * torch.linspace(0, 1, weights.numel(), dtype=weights.dtype)
                           .view_as(weights)).sum()
        grads = torch.autograd.grad(loss, leaves + list(module.parameters()), allow_unused=True)
        results.append((out, weights, grads))
    return results


def assert_same(results):
    (out_a, weights_a, grads_a), (out_b, weights_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-9, atol=1e-10)
    assert (weights_a is None) == (weights_b is None)
    if weights_a is not None:
        torch.testing.assert_close(weights_b, weights_a, rtol=1e-9, atol=1e-10)
    for grad_a, grad_b in zip(grads_a, grads_b):
        assert (grad_a is None) == (grad_b is None)
        if grad_a is not None:
            torch.testing.assert_close(grad_b, grad_a, rtol=1e-8, atol=1e-9)


CASES = list(itertools.product(
    [True, False],                      # batch_first
    ["self", "cross", "kv_shared"],     # which inputs are the same tensor
    [True, False],                      # bias
    [False, True],                      # add_bias_kv
    [False, True],                      # add_zero_attn
))


@pytest.mark.parametrize("batch_first,attention,bias,add_bias_kv,add_zero_attn", CASES)
def test_matches_torch_across_constructor_arguments(generator, batch_first, attention, bias, add_bias_kv,
                                                    add_zero_attn):
    theirs, ours = make_pair(generator, batch_first=batch_first, bias=bias, add_bias_kv=add_bias_kv,
                             add_zero_attn=add_zero_attn)
    query = sequence(generator, LEN_Q, EMBED, batch_first)
    if attention == "self":
        inputs = (query, query, query)
    else:
        key = sequence(generator, LEN_K, EMBED, batch_first)
        inputs = (query, key, key) if attention == "kv_shared" else (
            query, key, sequence(generator, LEN_K, EMBED, batch_first))
    assert_same(run_both(theirs, ours, inputs))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim,vdim", [(5, 7), (EMBED, 4)])
def test_matches_torch_with_kdim_vdim(generator, batch_first, kdim, vdim):
    theirs, ours = make_pair(generator, batch_first=batch_first, kdim=kdim, vdim=vdim)
    inputs = (sequence(generator, LEN_Q, EMBED, batch_first), sequence(generator, LEN_K, kdim, batch_first),
              sequence(generator, LEN_K, vdim, batch_first))
    assert_same(run_both(theirs, ours, inputs, need_weights=False))


# Mixed bool and float masks are deprecated by nn.MultiheadAttention, so each case uses one kind.
MASK_CASES = [(None, None, padding) for padding in (None, "bool", "float")] + [
    (kind, rank, padding) for kind, rank in itertools.product(["bool", "float"], ["2d", "3d"])
    for padding in (None, kind)]


@pytest.mark.parametrize("mask_kind,mask_rank,padding_kind", MASK_CASES)
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_matches_torch_with_masks_and_weights(generator, mask_kind, mask_rank, padding_kind, need_weights,
                                              average):
    theirs, ours = make_pair(generator, batch_first=True, add_bias_kv=True)
    query, key = sequence(generator, LEN_Q, EMBED, True), sequence(generator, LEN_K, EMBED, True)
    mask_shape = (LEN_Q, LEN_K) if mask_rank == "2d" else (BATCH * HEADS, LEN_Q, LEN_K)
    attn_mask = None if mask_kind is None else nn_mask(generator, mask_kind, mask_shape)
    padding = None if padding_kind is None else nn_mask(generator, padding_kind, (BATCH, LEN_K))
    assert_same(run_both(theirs, ours, (query, key, key), attn_mask=attn_mask, key_padding_mask=padding,
                         need_weights=need_weights, average_attn_weights=average))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("with_padding", [False, True])
def test_matches_torch_when_causal(generator, batch_first, with_padding):
    theirs, ours = make_pair(generator, batch_first=batch_first)
    query = sequence(generator, LEN_Q, EMBED, batch_first)
    causal = torch.ones(LEN_Q, LEN_Q, dtype=torch.bool).triu(1)
    padding = nn_mask(generator, "bool", (BATCH, LEN_Q)) if with_padding else None
    assert_same(run_both(theirs, ours, (query, query, query), attn_mask=causal, is_causal=True,
                         key_padding_mask=padding, need_weights=False))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask_rank", [None, "2d", "3d"])
def test_matches_torch_unbatched(generator, batch_first, mask_rank):
    theirs, ours = make_pair(generator, batch_first=batch_first, add_zero_attn=True)
    query = sequence(generator, LEN_Q, EMBED, batch_first, batched=False)
    key = sequence(generator, LEN_K, EMBED, batch_first, batched=False)
    shape = {None: None, "2d": (LEN_Q, LEN_K), "3d": (HEADS, LEN_Q, LEN_K)}[mask_rank]
    attn_mask = None if shape is None else nn_mask(generator, "bool", shape)
    padding = nn_mask(generator, "bool", (LEN_K,))
    assert_same(run_both(theirs, ours, (query, key, key), attn_mask=attn_mask, key_padding_mask=padding,
                         average_attn_weights=False))


def test_self_attention_projects_once_and_reads_slices_in_place(generator, monkeypatch):
    _, ours = make_pair(generator, batch_first=True)
    query = sequence(generator, LEN_Q, EMBED, True)
    seen = {}
    original = fused_attn.modules.split_heads_attention

    def spy(q, k, v, *args, **kwargs):
        seen["storages"] = {t.untyped_storage().data_ptr() for t in (q, k, v)}
        seen["strides"] = q.stride()
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(fused_attn.modules, "split_heads_attention", spy)
    ours(query, query, query, need_weights=False)
    assert len(seen["storages"]) == 1, "q, k and v must be slices of one packed projection"
    assert seen["strides"] == (LEN_Q * 3 * EMBED, 3 * EMBED, 1)


def test_state_dicts_load_both_ways():
    theirs = nn.MultiheadAttention(EMBED, HEADS, kdim=5, vdim=6, add_bias_kv=True)
    ours = fused_attn.MultiheadAttention(EMBED, HEADS, kdim=5, vdim=6, add_bias_kv=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor)


def test_dropout_in_training_returns_the_weights_it_used(generator):
    torch.manual_seed(0)
    module = fused_attn.MultiheadAttention(EMBED, HEADS, dropout=0.5, batch_first=True, dtype=torch.float64)
    module.train()
    query = sequence(generator, LEN_Q, EMBED, True)
    out, weights = module(query, query, query, average_attn_weights=False)
    assert ((weights == 0) | (weights > 0)).all() and (weights == 0).any()
    values = torch.nn.functional.linear(query, module.in_proj_weight[2 * EMBED:], module.in_proj_bias[2 * EMBED:])
    heads = values.unflatten(-1, (HEADS, EMBED // HEADS)).transpose(1, 2)
    merged = (weights @ heads).transpose(1, 2).flatten(2)
    expected = module.out_proj(merged)
    torch.testing.assert_close(out, expected)
    module.eval()
    out_eval, _ = module(query, query, query)
    out_eval_again, _ = module(query, query, query)
    assert torch.equal(out_eval, out_eval_again)


@pytest.mark.parametrize("norm_first", [False, True])
def test_replace_attention_keeps_encoder_outputs_and_gradients(generator, norm_first):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=16, dropout=0.0, batch_first=True,
                                       norm_first=norm_first, dtype=torch.float64)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    src = torch.randn(BATCH, LEN_Q, EMBED, generator=generator, dtype=torch.float64)
    padding = nn_mask(generator, "bool", (BATCH, LEN_Q))
    causal = torch.ones(LEN_Q, LEN_Q, dtype=torch.bool).triu(1)

    def outputs_and_grads():
        out = model(src, mask=causal, src_key_padding_mask=padding, is_causal=True)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        return out, grads

    before = outputs_and_grads()
    parameters = list(model.parameters())
    assert fused_attn.replace_attention(model) is model
    attention_modules = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert len(attention_modules) == 2
    assert all(isinstance(m, fused_attn.MultiheadAttention) for m in attention_modules)
    assert all(a is b for a, b in zip(parameters, model.parameters()))
    after = outputs_and_grads()
    torch.testing.assert_close(after[0], before[0], rtol=1e-9, atol=1e-10)
    for grad_before, grad_after in zip(before[1], after[1]):
        torch.testing.assert_close(grad_after, grad_before, rtol=1e-8, atol=1e-9)


def test_fully_masked_query_gives_zero_not_nan(generator):
    _, ours = make_pair(generator, batch_first=True)
    query = sequence(generator, LEN_Q, EMBED, True)
    hidden = torch.zeros(LEN_Q, LEN_Q, dtype=torch.bool)
    hidden[2] = True
    out, weights = ours(query, query, query, attn_mask=hidden)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (weights[:, 2] == 0).all()
    expected_row = ours.out_proj.bias.expand(BATCH, EMBED)
    torch.testing.assert_close(out[:, 2], expected_row)


def test_default_encoder_trains_on_the_fused_kernels_with_dropout(generator, monkeypatch):
    """PyTorch's default encoder layer (dropout=0.1), swapped and trained: every attention call runs
    on a fused backend, and torch.manual_seed reproduces a step exactly."""
    from fused_attn.backends import registry

    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=16, batch_first=True)
    model = fused_attn.replace_attention(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False))
    model.train()
    src = torch.randn(BATCH, LEN_Q, EMBED, generator=generator)
    chosen = []
    original = registry.choose
    monkeypatch.setattr(registry, "choose", lambda *a, **k: chosen.append(original(*a, **k).name)
                        or original(*a, **k))

    def step(seed):
        torch.manual_seed(seed)
        out = model(src)
        return out, torch.autograd.grad(out.square().sum(), list(model.parameters()))

    first, second, other = step(5), step(5), step(6)
    fused = [name for name, why in fused_attn.available_backends().items()
             if why is None and name != "reference" and "cpu" in registry.get(name).devices]
    assert fused and set(chosen) <= set(fused), chosen
    assert len(chosen) == 6  # two layers, three steps
    torch.testing.assert_close(first[0], second[0], rtol=0, atol=0)
    for a, b in zip(first[1], second[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])


def unfused_with_variant(module, query, key, value, key_padding_mask, is_causal, batch_first, **variant):
    """The module's computation written out: projections, the reference attention with `variant`,
    merged heads, out-projection; and the weights (B, H, L_q, L_k)."""
    embed = module.embed_dim
    weights = module.in_proj_weight.chunk(3)
    biases = module.in_proj_bias.chunk(3)
    projected = [torch.nn.functional.linear(t, w, b) for t, w, b in zip((query, key, value), weights, biases)]
    heads = [fused_attn.functional._split_heads(n, t, HEADS, batch_first)
             for n, t in zip(("query", "key", "value"), projected)]
    scores = fused_attn.backends.reference.masked_scores(
        *heads[:2], None, key_padding_mask, is_causal, variant=fused_attn.scores.variant_of(heads[0], **variant))
    probs = fused_attn.backends.reference.probabilities(scores)
    out = probs @ heads[2]
    out = out.permute(0, 2, 1, 3) if batch_first else out.permute(2, 0, 1, 3)
    return module.out_proj(out.flatten(2)), probs


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("draw", range(4))
def test_score_variants_of_the_module(generator, batch_first, draw):
    """The module's own causal_alignment, window, softcap and ALiBi, drawn together, in its output,
    weights and gradients, against the module's computation written out with the reference."""
    choice = torch.Generator().manual_seed(draw)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=choice))]

    variant = dict(causal_alignment=pick(["top_left", "bottom_right"]),
                   window_size=pick([None, (2, 1), (3, 0), (0, -1)]), softcap=pick([None, 1.5, 20.0]),
                   alibi_slopes=pick([None, torch.rand(HEADS, generator=generator, dtype=torch.float32)]))
    is_causal = bool(pick([False, True]))
    torch.manual_seed(draw)
    module = fused_attn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first, dtype=torch.float64,
                                           backend="cpu", **variant)
    query = sequence(generator, LEN_Q, EMBED, batch_first)
    memory = sequence(generator, LEN_K, EMBED, batch_first)
    padding = torch.zeros(BATCH, LEN_K, dtype=torch.bool)
    padding[1, LEN_K - 2:] = True
    out, weights = module(query, memory, memory, key_padding_mask=padding, is_causal=is_causal,
                          average_attn_weights=False)
    expected, expected_weights = unfused_with_variant(module, query, memory, memory, padding, is_causal,
                                                      batch_first, **variant)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-9, atol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), [query, memory, module.in_proj_weight])
    expected_grads = torch.autograd.grad(expected.square().sum(), [query, memory, module.in_proj_weight])
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-8, atol=1e-9)


def test_module_variant_arguments_are_checked_at_construction():
    with pytest.raises(ValueError, match="alibi_slopes"):
        fused_attn.MultiheadAttention(EMBED, HEADS, alibi_slopes=torch.ones(2, HEADS))
    with pytest.raises(TypeError, match="window_size"):
        fused_attn.MultiheadAttention(EMBED, HEADS, window_size=(1, 2, 3))
    with pytest.raises(ValueError, match="softcap"):
        fused_attn.MultiheadAttention(EMBED, HEADS, softcap=-1.0)
    module = fused_attn.MultiheadAttention(EMBED, HEADS, alibi_slopes=torch.ones(HEADS))
    assert "alibi_slopes" not in module.state_dict()
