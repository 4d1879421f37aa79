"""Mask programs (fused_attn.masks): each program stands for exactly its mask, its build never makes an
L_q × L_k tensor, its memory follows its partial tiles, and calls that use one check what they are given.
The kernels' results with programs are tested per backend (PROGRAM_CASES in test_cpu, test_triton,
test_cuda_emulated)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_attn
from fused_attn import masks, testing


def evaluated(mask, batch, heads, len_q, len_k):
    """The mask's (B, H, L_q, L_k) bool values, pair by pair (the definition the program must equal)."""
    mask = masks.mask_function(mask).resolved(len_q, len_k)
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    q = torch.arange(len_q).view(1, 1, -1, 1)
    kv = torch.arange(len_k).view(1, 1, 1, -1)
    return torch.as_tensor(mask(b, h, q, kv)).expand(batch, heads, len_q, len_k)


def random_ids(generator, batch, length, documents):
    cuts = torch.sort(torch.randint(0, length + 1, (batch, documents - 1), generator=generator), dim=1).values
    return torch.stack([torch.searchsorted(cuts[b], torch.arange(length), right=True) for b in range(batch)])


def drawn_masks(generator, batch, len_q, len_k):
    """Ready-made masks and combinations with random parameters, and plain mask_mods, for (B, L_q, L_k)."""
    ids = random_ids(generator, batch, len_q, 5)
    kv_ids = random_ids(generator, batch, len_k, 4)
    prefix = torch.randint(0, len_k + 1, (batch,), generator=generator)
    size, left, right = (int(v) for v in torch.randint(1, 300, (3,), generator=generator))
    return {
        "documents_causal": (masks.documents(ids, kv_ids) & masks.causal(), True),
        "documents_bottom_right": (masks.documents(ids, kv_ids) & masks.causal("bottom_right"), True),
        "documents_or_window": (masks.documents(ids, kv_ids) | masks.sliding_window(left, right), True),
        "prefix_lm": (masks.prefix_lm(prefix), True),
        "chunks_window": (masks.chunks(size) & masks.sliding_window(left, 0, "bottom_right"), False),
        "two_bands": (masks.causal() & masks.sliding_window(left, right) & masks.chunks(size), False),
        "band_alone": (masks.sliding_window(left, right, -17), False),
        "function": (lambda b, h, q, kv: ((q * 7 + kv * 3 + b + h) % 5 < 2) | (kv // 64 == q // 80), True),
        "function_and_causal": (masks.mask_function(lambda b, h, q, kv: (q // 50 + kv // 70 + h) % 3 == 0)
                                & masks.causal(), True),
        "prefix_or_function": (masks.prefix_lm(prefix) | (lambda b, h, q, kv: (q - kv) % 9 == h), True),
    }


@pytest.mark.parametrize("lengths", [(300, 300), (130, 517), (600, 257), (128, 256), (1, 400)])
def test_program_equals_its_mask(generator, lengths):
    len_q, len_k = lengths
    batch, heads = 2, 3
    for name, (mask, per_row) in drawn_masks(generator, batch, len_q, len_k).items():
        program = masks.mask_program(mask, batch if per_row else None, heads if per_row else None, len_q, len_k)
        expected = evaluated(mask, program.batch, program.heads, len_q, len_k)
        assert torch.equal(program.dense(), expected), name
        assert torch.equal(program.without_band().dense(), expected), name
        # Tile states agree with the pairs: empty tiles see nothing, full ones (as far as the bits go) everything.
        counts = program.counts()
        assert sum(counts.values()) == program.tiles.numel() and program.bits.shape[0] == counts["partial"], name


def test_band_is_left_to_the_kernels_and_whole_tiles_are_not_evaluated():
    ids = torch.arange(1024) // 256
    program = masks.mask_program(masks.documents(ids) & masks.causal(), len_q=1024)
    assert program.band == (-1, 0, 0)
    # Documents aligned to tiles: tiles are empty or full, the diagonal's causal cut is the kernels' band.
    assert program.counts() == {"empty": 52, "full": 12, "partial": 0}
    assert program.without_band().counts() == {"empty": 52, "full": 4, "partial": 8}


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


@pytest.mark.parametrize("kind", ["documents", "prefix_lm", "chunks", "function"])
def test_build_never_makes_a_scores_sized_tensor(generator, kind):
    length = 4096
    ids = random_ids(generator, 1, length, 8)[0]
    mask = {"documents": masks.documents(ids) & masks.causal(), "prefix_lm": masks.prefix_lm(1024),
            "chunks": masks.chunks(1024) & masks.causal(),
            "function": lambda b, h, q, kv: (ids[q] == ids[kv]) & (kv <= q)}[kind]
    with LargestTensor() as spy:
        program = masks.mask_program(mask, len_q=length)
    bound = max(masks.ROWS_PER_SLICE * length, masks.TILES_PER_BATCH * masks.TILE ** 2)
    assert spy.largest <= bound < length * length // 4
    assert torch.equal(program.dense()[0, 0], evaluated(mask, 1, 1, length, length)[0, 0])


def test_document_program_memory_is_a_small_fraction_of_a_dense_mask(generator):
    length = 8192
    program = masks.mask_program(masks.documents(random_ids(generator, 1, length, 8)[0]) & masks.causal(),
                                 len_q=length)
    # 4 bytes a tile state and 2 KiB a partial tile.
    assert program.nbytes == 4 * program.tiles.numel() + masks.TILE * masks.TILE // 8 * program.counts()["partial"]
    assert program.nbytes < length * length / 16


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_call_band_and_program_band_of_other_diagonals(generator, backend):
    """A program whose band (causal, top-left) and the call's (bottom-right causal, ALiBi) differ: the program
    then keeps its band in its bits, and the call is still exact."""
    case = testing.Case(batch=2, heads_q=2, heads_kv=1, len_q=150, len_k=300, is_causal=True,
                        causal_alignment="bottom_right", alibi="heads", lse_grad=True)
    inputs = testing.random_inputs(case, torch.float32, 2, generator)
    ids = random_ids(generator, 2, 150, 3)
    kv_ids = random_ids(generator, 2, 300, 3)
    program = masks.mask_program(masks.documents(ids, kv_ids) & masks.causal(), 2, None, 150, 300)
    assert program.band is not None
    inputs = dataclasses.replace(inputs, program=program)
    testing.check_inputs(testing.run_attention(inputs, backend), inputs)


def test_split_heads_and_module_take_programs(generator):
    batch, length, heads, dim = 2, 260, 4, 8
    x = torch.randn(batch, length, heads * dim, generator=generator)
    program = masks.mask_program(masks.chunks(100) & masks.causal(), len_q=length)
    dense = program.dense()[0, 0]
    out = fused_attn.split_heads_attention(x, x, x, heads, attn_mask=program)
    expected = fused_attn.split_heads_attention(x, x, x, heads, attn_mask=dense, backend="reference")
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_program_checks(generator):
    q = torch.randn(2, 4, 300, 16, generator=generator)
    program = masks.mask_program(masks.chunks(64), len_q=300)
    with pytest.raises(ValueError, match="attn_mask: a mask program for .L_q, L_k. = .300, 300."):
        fused_attn.attention(q[:, :, :200], q, q, attn_mask=program)
    per_row = masks.mask_program(masks.prefix_lm(torch.tensor([3, 5, 7])), 3, None, 300, 300)
    with pytest.raises(ValueError, match="attn_mask: a mask program for .B, H. = .3, 1. does not broadcast"):
        fused_attn.attention(q, q, q, attn_mask=per_row)
    with pytest.raises(ValueError, match="batch: the mask holds 3 rows"):
        masks.mask_program(masks.prefix_lm(torch.tensor([3, 5, 7])), None, None, 300)
    with pytest.raises(TypeError, match="doc_ids: expected an integer tensor"):
        masks.documents(torch.zeros(10))
    with pytest.raises(ValueError, match="chunk_size: expected an int >= 1"):
        masks.chunks(0)
    with pytest.raises(ValueError, match="prefix_lengths: expected lengths >= 0"):
        masks.prefix_lm(torch.tensor([-1]))
    with pytest.raises(ValueError, match="len_q: expected an int >= 0"):
        masks.mask_program(masks.chunks(4), len_q=-1)
    with pytest.raises(TypeError, match="mask: expected a mask_mod"):
        masks.mask_program(3, len_q=10)
    with pytest.raises(ValueError, match="left: expected None .unbounded. or an int >= 0"):
        masks.sliding_window(-2, 0)


def test_empty_lengths_and_fully_hidden_rows(generator):
    q = torch.randn(1, 2, 200, 8, generator=generator, requires_grad=True)
    program = masks.mask_program(lambda b, h, q_idx, kv_idx: q_idx >= 130, len_q=200)  # rows 0..129 see nothing
    out, lse = fused_attn.attention(q, q, q, attn_mask=program, return_lse=True)
    assert (out[:, :, :130] == 0).all() and (lse[:, :, :130] == float("-inf")).all()
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(grad).all()
    empty = masks.mask_program(masks.chunks(3), len_q=0, len_k=10)
    assert empty.tiles.shape == (1, 1, 0, 1) and empty.bits.shape[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_batch_takes_a_program_per_sequence(generator, dtype):
    """attention_varlen with a program whose row b is sequence b's mask (prefix-LM per sequence, chunks & causal,
    documents within sequences), forward and backward, against each sequence alone given its dense mask."""
    lengths = [300, 0, 129, 257]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    total, heads, dim = int(cu[-1]), 4, 16
    q, k, v, grad = (torch.randn(total, heads, dim, generator=generator).to(dtype) for _ in range(4))
    ids = random_ids(generator, 4, 300, 3)
    for mask in (masks.prefix_lm(torch.tensor([40, 0, 129, 7])), masks.chunks(100) & masks.causal(),
                 masks.documents(ids) & masks.causal()):
        per_row = not isinstance(mask, masks._Both) or isinstance(mask.first, masks._Documents)
        program = masks.mask_program(mask, 4 if per_row else None, None, 300, 300)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fused_attn.attention_varlen(*inputs, cu, cu, attn_mask=program)
        grads = torch.autograd.grad(out, inputs, grad)
        dense = program.dense()
        for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if end == start:
                continue
            seq = [t[start:end].transpose(0, 1).unsqueeze(0).detach().double().requires_grad_() for t in (q, k, v)]
            mask_b = dense[b if dense.shape[0] > 1 else 0, 0, :end - start, :end - start]
            expected = fused_attn.attention(*seq, attn_mask=mask_b, backend="reference")
            expected_grads = torch.autograd.grad(expected, seq, grad[start:end].transpose(0, 1).unsqueeze(0).double())
            tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(out[start:end].double(), expected[0].transpose(0, 1), **tolerance)
            for got, want in zip(grads, expected_grads):
                torch.testing.assert_close(got[start:end].double(), want[0].transpose(0, 1), **tolerance)
    short = masks.mask_program(masks.chunks(10), len_q=200)
    with pytest.raises(ValueError, match="does not cover the longest sequences"):
        fused_attn.attention_varlen(q, k, v, cu, cu, attn_mask=short)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_takes_programs(generator, need_weights):
    """fused_attn.MultiheadAttention with a program (or its BlockMask) as attn_mask equals torch's module given
    the same mask as a tensor (torch's convention: True = hidden)."""
    torch.manual_seed(0)
    module = fused_attn.MultiheadAttention(32, 4, batch_first=True)
    reference = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(2, 300, 32, generator=generator)
    padding = torch.zeros(2, 300, dtype=torch.bool)
    padding[1, 250:] = True
    program = masks.mask_program(masks.documents(random_ids(generator, 1, 300, 4)[0]) & masks.causal(), len_q=300)
    out, weights = module(x, x, x, attn_mask=program, key_padding_mask=padding, need_weights=need_weights)
    expected, expected_weights = reference(x, x, x, attn_mask=~program.dense()[0, 0], key_padding_mask=padding,
                                           need_weights=need_weights)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, atol=2e-6, rtol=2e-5)
    with pytest.raises(ValueError, match="attn_mask: a mask program is not taken with add_bias_kv"):
        fused_attn.MultiheadAttention(32, 4, batch_first=True, add_bias_kv=True)(x, x, x, attn_mask=program)
