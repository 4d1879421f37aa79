"""The score variants (fused_attn.scores): the public keywords, the reference that is their oracle,
PyTorch's CausalBias objects, the registry's refusals and the ops. Each kernel's correctness on drawn
combinations is in its own test file (test_cpu.py, test_triton.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import fused_attn
from fused_attn import ops, testing
from fused_attn.backends import registry
from fused_attn.backends.base import SCORE_FEATURE_NAMES, Backend
from fused_attn.problem import Problem
from fused_attn.scores import ScoreVariant


def qkv(generator, len_q=13, len_k=29, heads=3, dim=8, dtype=torch.float64):
    return (torch.randn(2, heads, length, dim, generator=generator, dtype=dtype)
            for length in (len_q, len_k, len_k))


def explicit_window_mask(len_q, len_k, left, right, offset):
    """Query i sees key j iff -left <= j - (i + offset) <= right, element by element."""
    mask = torch.zeros(len_q, len_k, dtype=torch.bool)
    for i in range(len_q):
        for j in range(len_k):
            distance = j - (i + offset)
            mask[i, j] = (left < 0 or distance >= -left) and (right < 0 or distance <= right)
    return mask


# ---- the reference against independent formulations ------------------------------------------------

@pytest.mark.parametrize("alignment", ["top_left", "bottom_right", 7, -5])
@pytest.mark.parametrize("window", [(4, 2), (0, -1), (-1, 3), (2, 0)])
@pytest.mark.parametrize("lengths", [(13, 29), (29, 13)])
def test_reference_window_is_the_explicit_mask(generator, alignment, window, lengths):
    q, k, v = qkv(generator, *lengths)
    offset = {"top_left": 0, "bottom_right": lengths[1] - lengths[0]}.get(alignment, alignment)
    mask = explicit_window_mask(*lengths, *window, offset)
    got = fused_attn.attention(q, k, v, window_size=window, causal_alignment=alignment, backend="reference")
    torch.testing.assert_close(got, fused_attn.attention(q, k, v, mask, backend="reference"))


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("lengths", [(13, 29), (29, 13), (16, 16)])
def test_causal_alignment_matches_sdpa_causal_bias(generator, lengths):
    """SDPA's own CausalBias objects are the oracle of both alignments."""
    q, k, v = qkv(generator, *lengths)
    for bias, alignment in ((causal_upper_left(*lengths), "top_left"),
                            (causal_lower_right(*lengths), "bottom_right")):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, bias)
        for backend in ("reference", "cpu"):
            as_keyword = fused_attn.attention(q, k, v, is_causal=True, causal_alignment=alignment, backend=backend)
            as_bias = fused_attn.attention(q, k, v, bias, backend=backend)
            # SDPA gives NaN for rows that see no key (bottom-right, L_q > L_k); fused_attn gives 0.
            seen = ~torch.isnan(expected)
            torch.testing.assert_close(as_keyword[seen], expected[seen])
            assert torch.equal(as_keyword, as_bias)
            assert (as_keyword[~seen] == 0).all()


def test_integer_alignment_places_alibi_and_the_band(generator):
    """An integer alignment is the offset itself: the same call as bottom-right alignment when it equals
    L_k - L_q, and ALiBi's distances measured from the shifted diagonal."""
    q, k, v = qkv(generator, 13, 29)
    slopes = torch.rand(3) + 0.1
    for backend in ("reference", "cpu"):
        as_offset = fused_attn.attention(q, k, v, is_causal=True, causal_alignment=16, alibi_slopes=slopes,
                                         backend=backend)
        aligned = fused_attn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right", alibi_slopes=slopes,
                                       backend=backend)
        torch.testing.assert_close(as_offset, aligned)
    distance = (torch.arange(29)[None, :] - torch.arange(13)[:, None] - 4).double()
    bias = -slopes.double()[:, None, None] * distance.abs() + torch.where(distance <= 0, 0.0, float("-inf"))
    got = fused_attn.attention(q, k, v, is_causal=True, causal_alignment=4, alibi_slopes=slopes, backend="cpu")
    torch.testing.assert_close(got, fused_attn.attention(q, k, v, bias.expand(2, 3, 13, 29), backend="reference"))


def test_softcap_and_alibi_are_the_explicit_terms(generator):
    q, k, v = qkv(generator)
    slopes = torch.tensor([0.5, 0.25, 0.125])
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * 8 ** -0.5
    capped = 2.0 * torch.tanh(scores / 2.0)
    offset = 29 - 13
    distance = (torch.arange(29)[None, :] - torch.arange(13)[:, None] - offset).abs().double()
    expected = torch.softmax(capped - slopes.double()[:, None, None] * distance, dim=-1) @ v
    got = fused_attn.attention(q, k, v, softcap=2.0, alibi_slopes=slopes, causal_alignment="bottom_right",
                               backend="reference")
    torch.testing.assert_close(got, expected)


def test_plain_keywords_change_nothing(generator):
    q, k, v = qkv(generator)
    plain = fused_attn.attention(q, k, v, is_causal=True, backend="cpu")
    same = fused_attn.attention(q, k, v, is_causal=True, backend="cpu", window_size=(-1, None), softcap=0,
                                causal_alignment="top_left", alibi_slopes=torch.zeros(3))
    torch.testing.assert_close(plain, same)
    assert torch.equal(plain, fused_attn.attention(q, k, v, window_size=(-1, 0), backend="cpu"))


def test_split_heads_attention_takes_the_keywords(generator):
    x = torch.randn(2, 21, 24, generator=generator)
    memory = torch.randn(2, 35, 24, generator=generator)
    keywords = dict(window_size=(6, 2), causal_alignment="bottom_right", softcap=3.0,
                    alibi_slopes=torch.rand(2, 4, generator=generator))
    got = fused_attn.split_heads_attention(x, memory, memory, 4, backend="cpu", **keywords)
    expected = fused_attn.split_heads_attention(x, memory, memory, 4, backend="reference", **keywords)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# ---- arguments -------------------------------------------------------------------------------------

@pytest.mark.parametrize("keywords, error, message", [
    (dict(window_size=(3,)), TypeError, "window_size: expected None or a pair"),
    (dict(window_size=(3, -2)), ValueError, "window_size: expected each bound"),
    (dict(window_size=(1.5, 0)), ValueError, "window_size: expected each bound"),
    (dict(softcap=-1.0), ValueError, "softcap: expected"),
    (dict(softcap=float("inf")), ValueError, "softcap: expected"),
    (dict(causal_alignment="lower_right"), ValueError, "causal_alignment: expected one of"),
    (dict(causal_alignment=True), ValueError, "causal_alignment: expected one of"),
    (dict(causal_alignment=2.0), ValueError, "causal_alignment: expected one of"),
    (dict(alibi_slopes=torch.ones(4)), ValueError, r"alibi_slopes: expected shape \(H_q,\)"),
    (dict(alibi_slopes=torch.ones(3, dtype=torch.float64)), TypeError, "alibi_slopes: expected dtype torch.float32"),
    (dict(alibi_slopes=torch.ones(3, requires_grad=True)), ValueError, "alibi_slopes: expected a tensor that does not"),
    (dict(alibi_slopes=[1.0, 1.0, 1.0]), TypeError, "alibi_slopes: expected None or a torch.Tensor"),
    (dict(attn_mask=causal_lower_right(13, 30)), ValueError, "attn_mask: a CausalBias for"),
    (dict(attn_mask=causal_upper_left(13, 29), is_causal=True), ValueError, "already makes the call causal"),
])
def test_bad_keywords_are_named(generator, keywords, error, message):
    q, k, v = qkv(generator)
    with pytest.raises(error, match=message):
        fused_attn.attention(q, k, v, **keywords)


# ---- the registry ------------------------------------------------------------------------------------

class WindowOnly(Backend):
    """A backend that declares one score variant, the window."""

    name = "window_only"
    devices = ("cpu",)
    takes_score_variants = frozenset({"window"})


def test_registry_learns_each_variant_from_the_backends_declaration():
    q = torch.empty(1, 2, 8, 16)
    features = {"bottom_right": ScoreVariant(bottom_right=True), "window": ScoreVariant(window_left=4),
                "softcap": ScoreVariant(softcap=1.0), "alibi": ScoreVariant(alibi_slopes=torch.ones(1, 2))}
    for name, variant in features.items():
        problem = Problem.of(q, q, q, None, None, True, 0.0, variant)
        assert problem.score_features == (name,)
        for backend in ("cpu", "triton", "cuda", "reference"):
            assert not [r for r in registry.get(backend).refusals(problem) if "supported" in r], backend
        refused = [r for r in WindowOnly().refusals(problem) if "supported" in r]
        assert refused == ([] if name == "window" else [f"{SCORE_FEATURE_NAMES[name]} is not supported yet"])
    # Bottom-right alignment alone changes nothing, so it asks nothing of a backend.
    assert Problem.of(q, q, q, None, None, False, 0.0, ScoreVariant(bottom_right=True)).score_features == ()


def test_a_backend_called_with_a_variant_it_does_not_declare_says_so():
    with pytest.raises(ValueError, match="window_only: softcap, ALiBi slopes not supported"):
        WindowOnly().check_variant(ScoreVariant(softcap=2.0, alibi_slopes=torch.ones(1, 1)), False)
    WindowOnly().check_variant(ScoreVariant(window_left=3), True)


# ---- the ops -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_opcheck_with_score_variants(backend, generator):
    q, k, v = (t.float().requires_grad_() for t in qkv(generator, 11, 19))
    slopes = torch.rand(2, 3, generator=generator)
    padding = torch.rand(2, 19, generator=generator) < 0.2
    variant = (5, 0, True, 2.0, slopes)  # window_left, window_right, bottom_right, softcap, alibi_slopes
    args = (q, k, v, None, padding, True, 0.3, 0.0, None, False, backend, *variant)
    torch.library.opcheck(ops.attention_fwd, args)
    out, lse = ops.attention_fwd(*args)
    torch.library.opcheck(ops.attention_bwd, (torch.randn_like(out), None, q.detach(), k.detach(), v.detach(),
                                              out.detach(), lse.detach(), None, padding, True, 0.3, 0.0, None,
                                              backend, False, *variant))


def test_compiled_call_with_score_variants(generator):
    q, k, v = qkv(generator, dtype=torch.float32)
    slopes = torch.rand(3, generator=generator)

    def call(q, k, v):
        return fused_attn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right", window_size=(7, -1),
                                    softcap=5.0, alibi_slopes=slopes, backend="cpu")

    compiled = torch.compile(call, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), call(q, k, v))


def test_random_inputs_draw_the_variant_together(generator):
    case = testing.Case(window=(3, 2), softcap=1.5, alibi="batch", causal_alignment="bottom_right")
    inputs = testing.random_inputs(case, torch.float32, 0, generator)
    variant = inputs.variant()
    assert variant.features(False) == ("bottom_right", "window", "softcap", "alibi")
    assert variant.alibi_slopes.shape == (2, 2) and variant.alibi_slopes.stride(1) != 1
