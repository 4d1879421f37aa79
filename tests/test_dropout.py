"""Dropout's random stream (fused_attn.dropout): the generator itself, the statistics of the masks,
and that every backend drops exactly the elements the formula says. The per-backend comparisons with
the float64 reference under dropout live with each backend's tests (the `dropout*` cases)."""

from __future__ import annotations

import math

import pytest
import torch

import fused_attn
from fused_attn import dropout, testing
from fused_attn.backends import registry

# Known-answer vectors of Philox4x32-10 (Random123's kat_vectors): counter, key, output.
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    counters = [torch.tensor(c, dtype=torch.int64) for c in counter]
    assert tuple(int(x) for x in dropout.philox4x32_10(*counters, *key)) == expected


@pytest.mark.parametrize("query_start, key_start", [(0, 0), (7, 6), (3, 8)])
def test_bits_are_the_formula_element_by_element(query_start, key_start):
    # A seed with the top bit set, as CUDA's can be; positions as a block of a longer sequence has them.
    rng = torch.tensor([-0x0123_4567_89AB_CDEF, 5, query_start, key_start])
    bits = dropout.bits(rng, 2, 3, 5, 11)
    seed = int(rng[0]) % 2 ** 64
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 10), (0, 1, 3, 7), (1, 0, 2, 5)]:
        row, key = query_start + i, key_start + j
        block = dropout.philox4x32_10(*(torch.tensor(c) for c in (key // 4, row, b * 3 + h, 5)),
                                      seed % 2 ** 32, seed >> 32)
        assert int(bits[b, h, i, j]) == int(block[key % 4])


def test_threshold_is_exact_at_the_ends():
    assert dropout.threshold(0.0) == 0
    assert dropout.threshold(0.5) == 2 ** 31
    assert dropout.threshold(1 - 2 ** -40) == 2 ** 32 - 1


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_within_binomial_bounds_overall_and_per_row(p):
    rng = dropout.next_rng(torch.device("cpu"), torch.Generator().manual_seed(3))
    batch, heads, len_q, len_k = 2, 4, 64, 512
    keep = dropout.keep_mask(dropout.Dropout(p, rng), batch, heads, len_q, len_k)
    n = keep.numel()
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(keep.sum().item() - n * (1 - p)) < 5 * sigma
    # Per row: 512 draws each; with 512 rows, 5.5 sigma bounds the whole family at ~1e-5.
    per_row = keep.sum(-1).double()
    row_sigma = math.sqrt(len_k * p * (1 - p))
    assert (per_row - len_k * (1 - p)).abs().max() < 5.5 * row_sigma


def test_heads_batches_calls_and_the_four_lanes_are_independent():
    """Correlation of the keep decisions between heads, batch elements, query rows, consecutive calls
    and the four keys that share one Philox block: near 0 (|r| < 5/sqrt(n))."""
    generator = torch.Generator().manual_seed(11)
    first = dropout.keep_mask(dropout.Dropout(0.5, dropout.next_rng(torch.device("cpu"), generator)),
                              2, 2, 64, 256).double()
    second = dropout.keep_mask(dropout.Dropout(0.5, dropout.next_rng(torch.device("cpu"), generator)),
                               2, 2, 64, 256).double()

    def correlation(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return (a @ b / (a.norm() * b.norm())).item(), a.numel()

    pairs = {"heads": (first[:, 0], first[:, 1]), "batch": (first[0], first[1]),
             "rows": (first[..., 0::2, :], first[..., 1::2, :]), "calls": (first, second),
             "lanes 0/1": (first[..., 0::4], first[..., 1::4]), "lanes 2/3": (first[..., 2::4], first[..., 3::4])}
    for name, (a, b) in pairs.items():
        r, n = correlation(a, b)
        assert abs(r) < 5 / math.sqrt(n), name
    assert not torch.equal(first, second)


def test_cpu_generator_reproduces_and_advances():
    torch.manual_seed(5)
    a = testing.dropout_mask(0.3, 1, 2, 8, 8)
    b = testing.dropout_mask(0.3, 1, 2, 8, 8)
    assert torch.equal(a, b)  # peeking leaves the generator alone
    torch.manual_seed(5)
    first = dropout.next_rng(torch.device("cpu"))
    second = dropout.next_rng(torch.device("cpu"))
    assert not torch.equal(first, second)
    torch.manual_seed(5)
    assert torch.equal(dropout.next_rng(torch.device("cpu")), first)
    torch.manual_seed(5)
    assert torch.equal(dropout.keep_mask(dropout.Dropout(0.3, first), 1, 2, 8, 8), a)


def dropout_backends() -> list[str]:
    """Backends that take dropout and run on CPU tensors here."""
    x = torch.empty(1, 1, 2, 8)
    problem = fused_attn.problem.Problem.of(x, x, x, None, None, False, 0.1)
    return [name for name in registry.names() if not registry.reasons(registry.get(name), problem)]


@pytest.mark.usefixtures("interpreter_remedies")
@pytest.mark.parametrize("backend", dropout_backends())
def test_backends_drop_the_same_elements_through_the_public_call(backend, generator):
    """The output with dropout, against softmax(S) * mask / (1 - p) V with the mask of
    `testing.dropout_mask`, for every backend that takes dropout: the same bits on each."""
    q, k, v = (torch.randn(2, 4, 19, 8, generator=generator, dtype=torch.float64 if backend == "reference"
                           else torch.float32) for _ in range(3))
    state = torch.Generator().manual_seed(123)
    keep = testing.dropout_mask(0.25, 2, 4, 19, 19, generator=state)
    out = fused_attn.attention(q, k, v, dropout_p=0.25, backend=backend, generator=state)
    expected = (torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, dim=-1) * keep / 0.75) @ v
    torch.testing.assert_close(out, expected.to(out.dtype), atol=3e-5, rtol=3e-5)


def test_weights_returned_by_the_module_are_the_dropped_ones(generator):
    attention = fused_attn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 9, 16, generator=generator)
    torch.manual_seed(9)
    keep = testing.dropout_mask(0.5, 2, 4, 9, 9)
    torch.manual_seed(9)
    _, weights = attention(x, x, x, need_weights=True, average_attn_weights=False)
    assert torch.equal(weights == 0, ~keep)


@pytest.mark.parametrize("bad, error, message", [
    (object(), TypeError, "generator: expected None or a torch.Generator"),
])
def test_generator_argument_is_checked(bad, error, message):
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(error, match=message):
        fused_attn.attention(q, q, q, dropout_p=0.1, generator=bad)


@pytest.mark.usefixtures("interpreter_remedies")
@pytest.mark.parametrize("backend", dropout_backends())
def test_kernels_take_seeds_with_the_top_bit_set(backend, generator):
    """A seed of 2^63 or more (as a CUDA generator's can be) travels as a negative int64: the kernels
    split it into the same two 32-bit key words as the formula."""
    q, k, v = (torch.randn(1, 2, 13, 8, generator=generator) for _ in range(3))
    drop = dropout.Dropout(0.4, torch.tensor([-0x0123_4567_89AB_CDEF, 5, 0, 0]))
    out = torch.empty_like(q)
    registry.get(backend).forward(q, k, v, None, None, False, 8 ** -0.5, out, drop)
    keep = dropout.keep_mask(drop, 1, 2, 13, 13)
    expected = (torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, dim=-1) * keep / 0.6) @ v
    torch.testing.assert_close(out, expected, atol=3e-5, rtol=3e-5)


@pytest.mark.usefixtures("interpreter_remedies")
@pytest.mark.parametrize("backend", dropout_backends())
@pytest.mark.parametrize("rows, keys", [((3, 11), (8, 40)), ((0, 17), (5, 38)), ((9, 10), (33, 34)), ((2, 15), (6, 31)),
                                        ((4, 16), (11, 40))])
def test_a_block_with_its_positions_drops_what_the_whole_call_drops(backend, rows, keys, generator):
    """A call on rows q0:q1 and keys k0:k1 of a longer sequence, given (query_start, key_start) =
    (q0, k0), drops exactly the whole call's elements of that block, forward and backward; key starts
    that are not a multiple of 4 straddle Philox blocks. Ring attention's steps rely on it."""
    dtype = torch.float64 if backend == "reference" else torch.float32
    testing.check_dropout_at_positions(registry.get(backend), rows, keys, dtype, generator)


@pytest.mark.parametrize("rng, message", [
    (None, "got NoneType"),
    (torch.tensor([1, 2, 3]), r"got \(3,\) torch.int64"),
    (torch.tensor([1.0, 2.0]), "torch.float32"),
])
def test_op_checks_the_dropout_rng(rng, message):
    from fused_attn import ops

    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=rf"dropout_rng: expected an int64 tensor \(4,\).*{message}"):
        ops.attention_fwd(q, q, q, None, None, False, 0.3, 0.2, rng, False, "reference")


def test_compiled_call_with_dropout_matches_eager():
    """The seed is drawn by a traced torch.randint: fullgraph compile, the same elements as eager
    for the same torch.manual_seed, and a backward."""
    def layer(q):
        return fused_attn.attention(q, q, q, dropout_p=0.3, is_causal=True)

    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.manual_seed(4)
    got = compiled(q)
    torch.manual_seed(4)
    expected = layer(q)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.isfinite(torch.autograd.grad(got.sum(), q)[0]).all()

