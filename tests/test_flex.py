"""FlexAttention interop: a BlockMask as `attn_mask` (its mask program, fused_attn.masks) and
`fused_attn.flex_attention`, against torch's own FlexAttention (its dense `create_mask` and its eager
`flex_attention`) by the project's criterion."""

import gc
import warnings
import weakref

import pytest
import torch
from torch.nn.attention.flex_attention import (AuxRequest, BlockMask, create_block_mask, create_mask, flex_attention,
                                               noop_mask)

import fused_attn
from fused_attn import masks, testing
from fused_attn.backends import registry

# The backends that run mask programs on CPU tensors. (The GPU backends declare them too; here Triton's run
# in its interpreter, whose bf16 dots need the remedy of tests/test_triton.py, where they are tested.)
BACKENDS = [name for name, why in fused_attn.available_backends().items()
            if why is None and "mask_program" in registry.get(name).takes_score_variants
            and "cpu" in registry.get(name).devices]


@pytest.fixture(autouse=True)
def quiet_eager_flex():
    """torch's flex_attention warns, once, that without torch.compile it materialises the scores."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def document_ids(batch, length, generator):
    """Sorted ids of up to five documents per row, different in each row."""
    return torch.randint(0, 5, (batch, length), generator=generator).sort(dim=1).values


def mask_mods(generator):
    """FlexAttention mask_mods, as written for it (tensor expressions and indexing), several depending on the
    batch row or the head."""
    docs = document_ids(3, 512, generator)

    def documents_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    def per_head(b, h, q_idx, kv_idx):
        return ((q_idx // 50 + kv_idx // (20 + 10 * h)) % 5) <= (1 + h) % 5

    def window_or_prefix(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= 70) | (kv_idx < 40)

    return {"documents_causal": documents_causal, "per_head": per_head, "window_or_prefix": window_or_prefix}


CASES = {  # mask_mod, B, H, L_q, L_k, BLOCK_SIZE
    "documents_b3_128": ("documents_causal", 3, None, 300, 300, 128),
    "per_head_h3_128": ("per_head", None, 3, 200, 390, 128),
    "documents_b2h2_64": ("documents_causal", 2, 2, 260, 260, 64),
    "window_prefix_32x256": ("window_or_prefix", None, None, 333, 301, (32, 256)),
    "per_head_b2h3_100": ("per_head", 2, 3, 150, 450, 100),
}


def block_mask_of(case, generator):
    name, batch, heads, len_q, len_k, block_size = CASES[case]
    mask_mod = mask_mods(generator)[name]
    block_mask = create_block_mask(mask_mod, batch, heads, len_q, len_k, device="cpu", BLOCK_SIZE=block_size)
    return block_mask, create_mask(mask_mod, batch, heads, len_q, len_k, device="cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_program_of_a_block_mask_is_its_mask(generator, case):
    block_mask, dense = block_mask_of(case, generator)
    program = masks.program_of_block_mask(block_mask)
    assert (program.batch, program.heads) == tuple(block_mask.kv_num_blocks.shape[:2])
    assert torch.equal(program.dense().expand_as(dense), dense)


def test_at_the_programs_tile_the_block_classification_is_kept(generator):
    """BLOCK_SIZE (128, 128): unlisted blocks are empty tiles, full blocks full tiles, and the mask_mod is
    evaluated on the partial blocks only."""
    docs = document_ids(2, 700, generator)
    evaluated = []

    def documents_causal(b, h, q_idx, kv_idx):
        seen = (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)
        evaluated.append(seen.numel())
        return seen

    block_mask = create_block_mask(documents_causal, 2, None, 700, 700, device="cpu")
    listed, full = block_mask.to_dense().bool(), BlockMask.from_kv_blocks(block_mask.full_kv_num_blocks,
                                                                          block_mask.full_kv_indices).to_dense().bool()
    evaluated.clear()
    program = masks.program_of_block_mask(block_mask)
    assert bool((program.tiles[~listed] == masks.EMPTY).all()) and bool((program.tiles[full] == masks.FULL).all())
    assert sum(evaluated) == int(block_mask.kv_num_blocks.sum()) * masks.TILE ** 2
    assert torch.equal(program.dense(), create_mask(documents_causal, 2, None, 700, 700, device="cpu"))


def blocks_expanded(num_blocks, indices, block_size, len_q, len_k):
    """torch's own dense block map, each block expanded to its pairs: (B, H, L_q, L_k) bool."""
    blocks = BlockMask.from_kv_blocks(num_blocks, indices).to_dense().bool()
    return blocks.repeat_interleave(block_size, -2).repeat_interleave(block_size, -1)[..., :len_q, :len_k]


@pytest.mark.parametrize("block_size", [64, 128])
def test_hand_made_block_masks_mean_what_flex_kernels_compute(generator, block_size):
    """A BlockMask made from blocks: unlisted blocks hidden, full blocks seen whole whatever the mask_mod
    says, the mask_mod deciding the other listed blocks; with noop_mask and no full blocks, every listed
    block is seen whole. (torch's eager flex_attention evaluates the mask_mod everywhere instead.)"""
    len_q, len_k = 300, 260
    rows, cols = -(-len_q // block_size), -(-len_k // block_size)
    chosen = torch.rand(2, 1, rows, cols, generator=generator)
    partial, full = chosen < 0.4, chosen > 0.75

    def stripes(b, h, q_idx, kv_idx):
        return (q_idx + 2 * kv_idx + b) % 3 == 0

    partial, full = masks._ordered_blocks(partial), masks._ordered_blocks(full)
    blocks_only = BlockMask.from_kv_blocks(*partial, BLOCK_SIZE=block_size, seq_lengths=(len_q, len_k))
    assert blocks_only.mask_mod is noop_mask
    expected = blocks_expanded(*partial, block_size, len_q, len_k)
    assert torch.equal(masks.program_of_block_mask(blocks_only).dense(), expected)

    with_full = BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=block_size, mask_mod=stripes,
                                         seq_lengths=(len_q, len_k))
    stripes_in_partial = blocks_expanded(*partial, block_size, len_q, len_k) & create_mask(stripes, 2, 1, len_q, len_k)
    expected = stripes_in_partial | blocks_expanded(*full, block_size, len_q, len_k)
    assert torch.equal(masks.program_of_block_mask(with_full).dense(), expected)


def test_the_program_is_made_once_per_block_mask(generator, monkeypatch):
    block_mask, _ = block_mask_of("documents_b3_128", generator)
    made = []
    original = masks.mask_program
    monkeypatch.setattr(masks, "mask_program", lambda *args, **kwargs: made.append(1) or original(*args, **kwargs))
    q, k, v = (torch.randn(3, 2, 300, 16, generator=generator) for _ in range(3))
    for _ in range(3):  # three layers
        fused_attn.attention(q, k, v, attn_mask=block_mask)
    program = masks.program_of_block_mask(block_mask)
    assert len(made) == 1
    block_mask.mask_mod = mask_mods(generator)["per_head"]  # replaced: made again
    remade = weakref.ref(masks.program_of_block_mask(block_mask))
    assert remade() is not program and len(made) == 2
    del block_mask
    gc.collect()
    assert remade() is None  # the program died with its BlockMask


def test_a_program_as_a_block_mask_means_the_same_mask(generator):
    """block_mask_of_program: a BlockMask that program_of_block_mask maps back to the program itself while it
    lives, and whose blocks mean the program's mask (a copy of its tensors is converted anew), also where
    the program leaves its causal part to the kernels' band."""
    ids = document_ids(2, 700, generator)
    program = masks.mask_program(masks.documents(ids) & masks.causal(), 2, None, 700, 700)
    block_mask = masks.block_mask_of_program(program)
    assert masks.program_of_block_mask(block_mask) is program
    assert block_mask.shape == (2, 1, 700, 700) and block_mask.BLOCK_SIZE == (masks.TILE, masks.TILE)
    copied = BlockMask.from_kv_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                      block_mask.full_kv_indices, BLOCK_SIZE=block_mask.BLOCK_SIZE,
                                      mask_mod=block_mask.mask_mod, seq_lengths=block_mask.seq_lengths)
    expected = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(700, 700, dtype=torch.bool).tril()
    assert torch.equal(program.dense(), expected)
    assert torch.equal(masks.program_of_block_mask(copied).dense(), expected)
    assert torch.equal(create_mask(block_mask.mask_mod, 2, 1, 700, 700, device="cpu"), expected)


def random_qkv(generator, batch, heads_q, heads_kv, len_q, len_k, dim_qk=16, dim_v=None, kv_batch=None,
               requires_grad=False):
    kv_batch = batch if kv_batch is None else kv_batch
    tensors = (torch.randn(batch, heads_q, len_q, dim_qk, generator=generator),
               torch.randn(kv_batch, heads_kv, len_k, dim_qk, generator=generator),
               torch.randn(kv_batch, heads_kv, len_k, dim_v or dim_qk, generator=generator))
    return tuple(t.requires_grad_(requires_grad) for t in tensors)


FLEX_CALLS = {  # case of CASES, heads (q, kv), batch of key/value (None: the query's), options
    "documents_b3": ("documents_b3_128", (2, 2), None, {}),
    "per_head_gqa_scale": ("per_head_h3_128", (3, 1), None, {"enable_gqa": True, "scale": 0.3}),
    "documents_b2h2_block64_kv_broadcast": ("documents_b2h2_64", (2, 2), 1, {}),
    "window_prefix_rectangular_blocks": ("window_prefix_32x256", (2, 2), None, {}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", list(FLEX_CALLS))
def test_flex_attention_matches_torch_flex_attention(generator, call, backend, dtype):
    """Output and log-sum-exp by the project's criterion: torch's flex_attention in float64 is the exact
    result, fused_attn's reference in the dtype (on the BlockMask's dense mask) sets the allowed error."""
    case, (heads_q, heads_kv), kv_batch, options = FLEX_CALLS[call]
    block_mask, dense = block_mask_of(case, generator)
    batch = max(block_mask.kv_num_blocks.shape[0], 2)
    q, k, v = (t.to(dtype) for t in random_qkv(generator, batch, heads_q, heads_kv, *block_mask.seq_lengths,
                                                dim_v=8, kv_batch=kv_batch))
    out, aux = flex_attention(q.double(), k.double(), v.double(), block_mask=block_mask,
                              return_aux=AuxRequest(lse=True), **options)
    exact = testing.Results(out, aux.lse)
    actual = testing.Results(*fused_attn.flex_attention(q, k, v, block_mask=block_mask, return_lse=True,
                                                        backend=backend, **options))
    same_dtype = testing.reference_results(q, *(t.expand(batch, -1, -1, -1) for t in (k, v)), attn_mask=dense,
                                           scale=options.get("scale"))
    assert actual.out.dtype == dtype and actual.lse.dtype == torch.float32  # as FlexAttention's
    testing.assert_close_to_reference(actual, exact, same_dtype, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flex_attention_gradients_match_the_reference(generator, backend):
    """torch's flex_attention has no backward on the CPU: the gradients (through the output and the
    log-sum-exp) are checked against fused_attn's float64 reference on the BlockMask's dense mask."""
    block_mask, dense = block_mask_of("per_head_b2h3_100", generator)
    q, k, v = random_qkv(generator, 2, 3, 3, 150, 450, requires_grad=True)
    grad_out, grad_lse = torch.randn(2, 3, 150, 16, generator=generator), torch.randn(2, 3, 150, generator=generator)
    out, lse = fused_attn.flex_attention(q, k, v, block_mask=block_mask, return_lse=True, backend=backend)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out, attn_mask=dense,
                                    grad_lse=grad_lse)


def test_rows_that_see_no_key_give_zero_as_flex_does(generator):
    """Documents of the queries with no key of theirs: FlexAttention gives 0 and lse -inf there."""
    q_docs, kv_docs = torch.full((1, 200), 7), torch.arange(180)[None] // 60
    q_docs[0, :100] = torch.arange(100) // 40

    def same_document(b, h, q_idx, kv_idx):
        return q_docs[b, q_idx] == kv_docs[b, kv_idx]

    block_mask = create_block_mask(same_document, None, None, 200, 180, device="cpu")
    q, k, v = random_qkv(generator, 1, 2, 2, 200, 180)
    expected, aux = flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    out, lse = fused_attn.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert bool((out[:, :, 100:] == 0).all()) and bool(torch.isneginf(lse[:, :, 100:]).all())
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, aux.lse)


def test_return_aux_kernel_options_and_no_block_mask(generator):
    q, k, v = random_qkv(generator, 2, 2, 2, 130, 140)
    block_mask, _ = block_mask_of("documents_b3_128", generator)
    expected, expected_aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    out, aux = fused_attn.flex_attention(q, k, v, return_aux=AuxRequest(lse=True),
                                         kernel_options={"BLOCK_M": 64, "PRESCALE_QK": True})
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(aux.lse, expected_aux.lse)
    assert aux.max_scores is None
    q, k, v = random_qkv(generator, 3, 2, 2, 300, 300)
    out = fused_attn.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest())
    assert out[1].lse is None and out[0].shape == (3, 2, 300, 16)


def test_calls_it_does_not_take_are_refused_by_name(generator):
    q, k, v = random_qkv(generator, 3, 2, 2, 300, 300)
    block_mask, _ = block_mask_of("documents_b3_128", generator)
    with pytest.raises(ValueError, match="score_mod: fused_attn.flex_attention takes no score_mod"):
        fused_attn.flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score)
    with pytest.raises(TypeError, match="block_mask: expected None or a .*BlockMask.*got Tensor"):
        fused_attn.flex_attention(q, k, v, block_mask=torch.ones(300, 300, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"block_mask: made for \(L_q, L_k\) = \(300, 300\), the call has \(300, 200"):
        fused_attn.flex_attention(q, k[:, :, :200], v[:, :, :200], block_mask=block_mask)
    with pytest.raises(ValueError, match="return_aux: max_scores"):
        fused_attn.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True, max_scores=True))
    with pytest.raises(ValueError, match="return_lse: give return_lse or return_aux, not both"):
        fused_attn.flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(ValueError, match=r"attn_mask: a mask program for \(L_q, L_k\) = \(300, 300\)"):
        fused_attn.attention(q[:, :, :200], k, v, attn_mask=block_mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_mask_as_attn_mask(generator, backend):
    """attention and split_heads_attention take a BlockMask as attn_mask: the same results as its dense
    mask, with GQA and key padding beside it."""
    block_mask, dense = block_mask_of("per_head_h3_128", generator)
    q, k, v = random_qkv(generator, 2, 3, 1, 200, 390, requires_grad=True)
    padding = torch.rand(2, 390, generator=generator) < 0.2
    grad_out = torch.randn(2, 3, 200, 16, generator=generator)
    out = fused_attn.attention(q, k, v, attn_mask=block_mask, enable_gqa=True, key_padding_mask=padding,
                               backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    testing.check_against_reference(testing.Results(out, None, *grads), q, k, v, grad_out, attn_mask=dense,
                                    key_padding_mask=padding)
    merged = fused_attn.split_heads_attention(q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2),
                                              v.transpose(1, 2).flatten(2), 3, attn_mask=block_mask, num_kv_heads=1,
                                              key_padding_mask=padding, backend=backend)
    torch.testing.assert_close(merged, out.detach().transpose(1, 2).flatten(2))
