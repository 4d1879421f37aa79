"""Every input that breaks the contract gets a ValueError/TypeError naming the argument (NotImplementedError
 for what no kernel does)."""

import pytest
import torch

import fused_attn

B, H, L, D = 2, 4, 5, 8


def qkv(**changes):
    tensors = dict(query=torch.randn(B, H, L, D), key=torch.randn(B, H, L, D), value=torch.randn(B, H, L, D))
    tensors.update(changes)
    return tensors


# (description, keyword arguments of fused_attn.attention, exception, text that must appear)
ATTENTION_ERRORS = [
    ("query not a tensor", qkv(query=[1.0]), TypeError, "query: expected a torch.Tensor"),
    ("query rank 3", qkv(query=torch.randn(B, L, D)), ValueError, "query: expected a 4-D"),
    ("key rank 5", qkv(key=torch.randn(B, H, L, D, 1)), ValueError, "key: expected a 4-D"),
    ("integer query", qkv(query=torch.ones(B, H, L, D, dtype=torch.int32)), TypeError, "query: expected a dtype"),
    ("key dtype differs", qkv(key=torch.randn(B, H, L, D, dtype=torch.float64)), TypeError,
     "key: expected dtype torch.float32"),
    ("value dtype differs", qkv(value=torch.randn(B, H, L, D).half()), TypeError, "value: expected dtype"),
    ("key device differs", qkv(key=torch.randn(B, H, L, D, device="meta")), ValueError,
     "key: expected device cpu"),
    ("batch mismatch", qkv(key=torch.randn(B + 1, H, L, D)), ValueError, "key: expected batch size 2"),
    ("value batch mismatch", qkv(value=torch.randn(1, H, L, D)), ValueError, "value: expected batch size 2"),
    ("head dim mismatch", qkv(key=torch.randn(B, H, L, D + 1)), ValueError, "key: expected head dim 8"),
    ("zero head dim", qkv(query=torch.randn(B, H, L, 0), key=torch.randn(B, H, L, 0)), ValueError,
     "query: expected a head dim of at least 1"),
    ("zero value head dim", qkv(value=torch.randn(B, H, L, 0)), ValueError,
     "value: expected a head dim of at least 1"),
    ("key/value length mismatch", qkv(value=torch.randn(B, H, L + 2, D)), ValueError, "value: expected length 5"),
    ("key/value heads mismatch", qkv(value=torch.randn(B, 2, L, D)), ValueError, "value: expected 4 heads"),
    ("heads differ without gqa", qkv(key=torch.randn(B, 2, L, D), value=torch.randn(B, 2, L, D)), ValueError,
     "enable_gqa=True"),
    ("H_q % H_kv != 0", dict(qkv(key=torch.randn(B, 3, L, D), value=torch.randn(B, 3, L, D)), enable_gqa=True),
     ValueError, "key: expected a number of heads dividing the query's 4, got 3"),
    ("dropout negative", dict(qkv(), dropout_p=-0.1), ValueError, "dropout_p: expected a number in [0, 1)"),
    ("dropout one", dict(qkv(), dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout string", dict(qkv(), dropout_p="0.1"), ValueError, "dropout_p"),
    ("scale string", dict(qkv(), scale="1"), TypeError, "scale: expected None or a number"),
    ("is_causal not bool", dict(qkv(), is_causal=1), TypeError, "is_causal: expected a bool"),
    ("mask not a tensor", dict(qkv(), attn_mask=[[True]]), TypeError, "attn_mask: expected None or a torch.Tensor"),
    ("mask int dtype", dict(qkv(), attn_mask=torch.ones(L, L, dtype=torch.int64)), TypeError,
     "attn_mask: expected dtype torch.bool or torch.float32"),
    ("mask float64 for float32", dict(qkv(), attn_mask=torch.zeros(L, L, dtype=torch.float64)), TypeError,
     "attn_mask: expected dtype"),
    ("mask bad shape", dict(qkv(), attn_mask=torch.ones(L, L + 1, dtype=torch.bool)), ValueError,
     "attn_mask: expected a shape broadcastable to (B, H_q, L_q, L_k) = (2, 4, 5, 5), got (5, 6)"),
    ("mask rank 5", dict(qkv(), attn_mask=torch.ones(1, B, H, L, L, dtype=torch.bool)), ValueError, "attn_mask"),
    ("mask device", dict(qkv(), attn_mask=torch.ones(L, L, dtype=torch.bool, device="meta")), ValueError,
     "attn_mask: expected device cpu"),
    ("padding not bool", dict(qkv(), key_padding_mask=torch.zeros(B, L)), TypeError,
     "key_padding_mask: expected dtype torch.bool"),
    ("padding bad shape", dict(qkv(), key_padding_mask=torch.zeros(B, L + 1, dtype=torch.bool)), ValueError,
     "key_padding_mask: expected shape (B, L_k) = (2, 5), got (2, 6)"),
    ("sinks not a tensor", dict(qkv(), sinks=[0.0] * H), TypeError, "sinks: expected None or a torch.Tensor"),
    ("sinks per batch row", dict(qkv(), sinks=torch.zeros(B, H)), ValueError,
     "sinks: expected shape (H_q,) = (4,), one logit per query head, got (2, 4)"),
    ("sinks per key head", dict(qkv(key=torch.randn(B, 2, L, D), value=torch.randn(B, 2, L, D)), enable_gqa=True,
                                sinks=torch.zeros(2)), ValueError, "sinks: expected shape (H_q,) = (4,)"),
    ("sinks float16 for float32", dict(qkv(), sinks=torch.zeros(H, dtype=torch.float16)), TypeError,
     "sinks: expected dtype torch.float32, got torch.float16"),
    ("sinks integer", dict(qkv(), sinks=torch.zeros(H, dtype=torch.int64)), TypeError, "sinks: expected dtype"),
    ("sinks device", dict(qkv(), sinks=torch.zeros(H, device="meta")), ValueError, "sinks: expected device cpu"),
    ("unknown backend", dict(qkv(), backend="fastest"), ValueError, "backend: expected one of"),
    ("backend not a string", dict(qkv(), backend=3), TypeError, "backend: expected None or a backend name"),
]


@pytest.mark.parametrize("arguments,error,text", [case[1:] for case in ATTENTION_ERRORS],
                         ids=[case[0] for case in ATTENTION_ERRORS])
def test_attention_rejects(arguments, error, text):
    with pytest.raises(error) as raised:
        fused_attn.attention(**arguments)
    assert text in str(raised.value)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch.func's import
def test_forward_mode_ad_is_refused_not_dropped():
    """The ops have no forward-mode derivative: a jvp must raise, not return a zero tangent."""
    import torch.autograd.forward_ad as forward_ad

    tensors = qkv()
    with forward_ad.dual_level():
        dual_key = forward_ad.make_dual(tensors["key"], torch.randn(B, H, L, D))
        with pytest.raises(NotImplementedError, match="key: forward-mode AD"):
            fused_attn.attention(**dict(tensors, key=dual_key))

    def of_query(query):
        return fused_attn.attention(**dict(tensors, query=query))

    with pytest.raises(NotImplementedError, match="query: forward-mode AD"):
        torch.func.jvp(of_query, (tensors["query"],), (torch.randn(B, H, L, D),))


SPLIT_ERRORS = [
    ("embedding not divisible", dict(query=torch.randn(B, L, 10), key=torch.randn(B, L, 10),
                                     value=torch.randn(B, L, 10), num_heads=4), ValueError,
     "query: expected an embedding size divisible by 4 heads, got 10"),
    ("num_heads zero", dict(query=torch.randn(B, L, 8), key=torch.randn(B, L, 8), value=torch.randn(B, L, 8),
                            num_heads=0), ValueError, "num_heads: expected a positive int, got 0"),
    ("num_kv_heads not int", dict(query=torch.randn(B, L, 8), key=torch.randn(B, L, 8),
                                  value=torch.randn(B, L, 8), num_heads=2, num_kv_heads=1.5), ValueError,
     "num_kv_heads: expected a positive int"),
    ("rank 4 input", dict(query=torch.randn(B, L, 2, 4), key=torch.randn(B, L, 8), value=torch.randn(B, L, 8),
                          num_heads=2), ValueError, "query: expected a 3-D tensor (B, L, E)"),
    ("seq-first rank", dict(query=torch.randn(L, B, 2, 4), key=torch.randn(L, B, 8), value=torch.randn(L, B, 8),
                            num_heads=2, batch_first=False), ValueError, "query: expected a 3-D tensor (L, B, E)"),
    # A 2-D query is unbatched (L, E), as nn.MultiheadAttention takes it: key and value must be too.
    ("unbatched query, batched key", dict(query=torch.randn(L, 8), key=torch.randn(L, B, 8),
                                          value=torch.randn(L, B, 8), num_heads=2, batch_first=False), ValueError,
     "key: expected a 2-D tensor (L, E), unbatched as query"),
]


@pytest.mark.parametrize("arguments,error,text", [case[1:] for case in SPLIT_ERRORS],
                         ids=[case[0] for case in SPLIT_ERRORS])
def test_split_heads_attention_rejects(arguments, error, text):
    with pytest.raises(error) as raised:
        fused_attn.split_heads_attention(**arguments)
    assert text in str(raised.value)


MODULE_ERRORS = [
    ("embed_dim % num_heads", lambda: fused_attn.MultiheadAttention(10, 4), ValueError,
     "embed_dim: expected a multiple of num_heads=4, got 10"),
    ("num_heads zero", lambda: fused_attn.MultiheadAttention(8, 0), ValueError, "num_heads: expected a positive"),
    ("query embedding", lambda: fused_attn.MultiheadAttention(8, 2)(torch.randn(3, 2, 6), torch.randn(3, 2, 6),
                                                                   torch.randn(3, 2, 6)), ValueError,
     "query: expected embedding size 8, got 6"),
    ("value embedding", lambda: fused_attn.MultiheadAttention(8, 2, vdim=5)(
        torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 4)), ValueError,
     "value: expected embedding size 5, got 4"),
    ("key batch", lambda: fused_attn.MultiheadAttention(8, 2)(torch.randn(3, 2, 8), torch.randn(3, 1, 8),
                                                             torch.randn(3, 1, 8)), ValueError,
     "key: expected batch size 2"),
    ("key rank", lambda: fused_attn.MultiheadAttention(8, 2)(torch.randn(3, 2, 8), torch.randn(3, 8),
                                                            torch.randn(3, 2, 8)), ValueError,
     "key: expected a 3-D tensor"),
    ("attn_mask 3-D shape", lambda: fused_attn.MultiheadAttention(8, 2)(
        torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
        attn_mask=torch.zeros(2, 3, 3, dtype=torch.bool)), ValueError, "attn_mask: expected shape (4, 3, 3)"),
    ("attn_mask rank", lambda: fused_attn.MultiheadAttention(8, 2)(
        torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
        attn_mask=torch.zeros(3, dtype=torch.bool)), ValueError, "attn_mask: expected a 2-D"),
    ("attn_mask int", lambda: fused_attn.MultiheadAttention(8, 2)(
        torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
        attn_mask=torch.zeros(3, 3, dtype=torch.int32)), TypeError, "attn_mask: expected a bool or floating"),
    ("padding int", lambda: fused_attn.MultiheadAttention(8, 2)(
        torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8),
        key_padding_mask=torch.zeros(2, 3, dtype=torch.int32)), TypeError, "key_padding_mask: expected a bool"),
]


@pytest.mark.parametrize("call,error,text", [case[1:] for case in MODULE_ERRORS],
                         ids=[case[0] for case in MODULE_ERRORS])
def test_module_rejects(call, error, text):
    with pytest.raises(error) as raised:
        call()
    assert text in str(raised.value)


def _sink_calls(sinks):
    """Every entry point that takes sinks, called with `sinks` on otherwise valid inputs."""
    q = torch.randn(B, H, L, D)
    packed = torch.randn(2 * L, H, D)
    bounds = torch.tensor([0, L, 2 * L], dtype=torch.int32)
    cache = torch.zeros(B, H, 2 * L, D)
    lengths = torch.tensor([1, 3], dtype=torch.int32)
    return {
        "attention": lambda: fused_attn.attention(q, q, q, sinks=sinks),
        "split_heads_attention": lambda: fused_attn.split_heads_attention(
            q.flatten(2), q.flatten(2), q.flatten(2), num_heads=H, sinks=sinks),
        "attention_varlen": lambda: fused_attn.attention_varlen(packed, packed, packed, bounds, bounds, sinks=sinks),
        "attention_with_kvcache": lambda: fused_attn.attention_with_kvcache(q, cache, cache, cache_seqlens=lengths,
                                                                            sinks=sinks),
    }


@pytest.mark.parametrize("entry", list(_sink_calls(None)))
@pytest.mark.parametrize("sinks,error,text", [
    (torch.zeros(H + 1), ValueError, "sinks: expected shape (H_q,) = (4,)"),
    (torch.zeros(H, dtype=torch.bfloat16), TypeError, "sinks: expected dtype torch.float32, got torch.bfloat16"),
    (torch.zeros(H, device="meta"), ValueError, "sinks: expected device cpu"),
    ("0.5", TypeError, "sinks: expected None or a torch.Tensor"),
], ids=["shape", "dtype", "device", "not a tensor"])
def test_every_entry_point_names_bad_sinks(entry, sinks, error, text):
    with pytest.raises(error) as raised:
        _sink_calls(sinks)[entry]()
    assert text in str(raised.value)


def test_kvcache_with_bad_sinks_leaves_the_cache_as_it_was():
    q, new = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    cache = torch.zeros(B, H, 2 * L, D)
    lengths = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="sinks: expected shape"):
        fused_attn.attention_with_kvcache(q, cache, cache, new, new, cache_seqlens=lengths, sinks=torch.zeros(H + 1))
    assert (cache == 0).all()
