"""fused_attn.attention_varlen against its definition: the packed sequences padded into a batch, the
padding hidden by key_padding_mask, the reference run in float64 and in the inputs' dtype, the padded
rows dropped again. Bottom-right alignment pads on the left (each sequence's last query then sits on
its last key in the padded batch too), top-left on the right."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fused_attn
from fused_attn import testing
from fused_attn.backends import registry
from fused_attn.dropout import Dropout, peek_rng, shifted_rng
from fused_attn.problem import Problem, lse_dtype
from fused_attn.scores import variant_of
from fused_attn.varlen import varlen_fwd


def triton_on_this_machine(request) -> None:
    """Skips unless the triton kernels run here: on a GPU, or in the interpreter on CPU tensors (with
    its bf16 remedy)."""
    if registry.get("triton").unavailable() is not None:
        pytest.skip("the triton kernels need a CUDA device or TRITON_INTERPRET=1")
    if not torch.cuda.is_available():
        request.getfixturevalue("interpreter_remedies")


def device_of(backend: str) -> str:
    """Where a backend's inputs live in these tests: triton's on the GPU when there is one."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...] | None = None  # None: the query lengths (self-attention)
    heads_q: int = 4
    heads_kv: int = 2
    dim_qk: int = 16
    dim_v: int = 16
    is_causal: bool = False
    causal_alignment: str = "top_left"
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: bool = False
    lse_grad: bool = False
    sinks: bool = False

    @property
    def keys(self) -> tuple[int, ...]:
        return self.lengths_q if self.lengths_k is None else self.lengths_k


# Features drawn together; lengths with empty sequences, sequences without keys, more queries than
# keys, and sequences longer than one CPU block (128 queries, 512 keys).
CASES = {
    "plain": VarlenCase((7, 33, 1, 20)),
    "causal_gqa_lse": VarlenCase((5, 0, 40, 9), is_causal=True, lse_grad=True),
    "cross_bottom_right": VarlenCase((3, 12, 30, 5), (17, 0, 30, 2), is_causal=True, causal_alignment="bottom_right",
                                     heads_kv=1, dim_v=24),
    "window_softcap_alibi": VarlenCase((50, 19, 4), (60, 7, 4), is_causal=True, causal_alignment="bottom_right",
                                       window=(6, 2), softcap=4.0, alibi=True, lse_grad=True),
    "long_window": VarlenCase((150, 2, 71), window=(20, 33), alibi=True, heads_kv=4, dim_qk=24),
    "long_keys": VarlenCase((9, 130), (530, 140), softcap=2.5, heads_kv=1, lse_grad=True),
    "sinks_causal_empty_keys": VarlenCase((5, 3, 40, 9), (5, 0, 40, 12), is_causal=True,
                                          causal_alignment="bottom_right", lse_grad=True, sinks=True),
    "sinks_window_softcap_alibi": VarlenCase((150, 2, 71), window=(20, 33), softcap=3.0, alibi=True, sinks=True),
}

# Packed (total, H, D) tensors in their own layouts: contiguous, head-major storage, a slice of a
# wider tensor (the head dim of a packed projection).
PACKED_LAYOUTS = ("contiguous", "head_major", "sliced")


def packed(values: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "head_major":
        return values.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "sliced":
        wide = torch.full((*values.shape[:2], values.shape[2] + 5), float("nan"), dtype=values.dtype)
        wide[..., 3:3 + values.shape[2]] = values
        return wide[..., 3:3 + values.shape[2]]
    return values.contiguous()


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@dataclasses.dataclass
class Packed:
    case: VarlenCase
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grad_out: torch.Tensor
    grad_lse: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    sinks: torch.Tensor | None = None

    def keywords(self) -> dict:
        case = self.case
        return dict(is_causal=case.is_causal, causal_alignment=case.causal_alignment, window_size=case.window,
                    softcap=case.softcap or None, alibi_slopes=self.alibi_slopes, sinks=self.sinks)


def random_packed(case: VarlenCase, dtype, rotation: int, generator) -> Packed:
    layouts = [PACKED_LAYOUTS[(rotation + i) % len(PACKED_LAYOUTS)] for i in range(4)]
    total_q, total_k = sum(case.lengths_q), sum(case.keys)

    def draw(total, heads, dim, layout):
        return packed(torch.randn(total, heads, dim, generator=generator).to(dtype), layout)

    query = draw(total_q, case.heads_q, case.dim_qk, layouts[0])
    key = draw(total_k, case.heads_kv, case.dim_qk, layouts[1])
    value = draw(total_k, case.heads_kv, case.dim_v, layouts[2])
    grad_out = draw(total_q, case.heads_q, case.dim_v, layouts[3])
    grad_lse = torch.randn(total_q, case.heads_q, generator=generator).t() if case.lse_grad else None
    slopes = torch.rand(case.heads_q, len(case.lengths_q), generator=generator).t() if case.alibi else None
    sinks = (torch.randn(case.heads_q, generator=generator) * 2 + 1).to(lse_dtype(dtype)) if case.sinks else None
    return Packed(case, query, key, value, grad_out, grad_lse, slopes, sinks)


def padded_positions(lengths, width: int, left: bool) -> list[torch.Tensor]:
    """Each sequence's positions in a batch padded to `width`, on the left or on the right."""
    return [torch.arange(width - n, width) if left else torch.arange(n) for n in lengths]


def pad(tensor: torch.Tensor, lengths, positions, width: int) -> torch.Tensor:
    """Packed (total, H, D) -> (B, H, width, D), zeros where padded."""
    out = tensor.new_zeros(len(lengths), tensor.shape[1], width, tensor.shape[2])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :, positions[b]] = tensor[start:start + n].transpose(0, 1)
        start += n
    return out


def unpad(tensor: torch.Tensor, positions) -> torch.Tensor:
    """(B, H, width, ...) -> packed (total, H, ...)."""
    return torch.cat([tensor[b, :, index].transpose(0, 1) for b, index in enumerate(positions)])


def reference_of(inputs: Packed, dtype) -> testing.Results:
    """The definition: pad, attend with the padded keys hidden, unpad (gradients too)."""
    case = inputs.case
    width_q, width_k = max(case.lengths_q, default=0), max(case.keys, default=0)
    left = case.causal_alignment == "bottom_right"
    rows = padded_positions(case.lengths_q, width_q, left)
    columns = padded_positions(case.keys, width_k, left)
    padding = torch.ones(len(case.keys), width_k, dtype=torch.bool)
    for b, index in enumerate(columns):
        padding[b, index] = False
    q, k, v, grad_out = (pad(t, lengths, where, width) for t, lengths, where, width in (
        (inputs.query, case.lengths_q, rows, width_q), (inputs.key, case.keys, columns, width_k),
        (inputs.value, case.keys, columns, width_k), (inputs.grad_out, case.lengths_q, rows, width_q)))
    grad_lse = None
    if inputs.grad_lse is not None:
        grad_lse = pad(inputs.grad_lse.t()[:, :, None], case.lengths_q, rows, width_q)[..., 0]
    variant = variant_of(q, case.causal_alignment, case.window, case.softcap or None, inputs.alibi_slopes,
                         inputs.sinks)
    results = testing.reference_results(q, k, v, grad_out, dtype=dtype, key_padding_mask=padding,
                                        is_causal=case.is_causal, grad_lse=grad_lse, variant=variant)
    # The padded rows have no gradient flowing in: the sinks' gradient is the packed rows' alone.
    return testing.Results(unpad(results.out, rows), unpad(results.lse[..., None], rows)[..., 0].t(),
                           unpad(results.grad_query, rows), unpad(results.grad_key, columns),
                           unpad(results.grad_value, columns), grad_sinks=results.grad_sinks)


def run_varlen(inputs: Packed, backend: str, strided_bounds: bool = False) -> testing.Results:
    """The call with autograd, on the backend's device; `strided_bounds` gives cu_seqlens as every
    other element of a longer tensor."""
    case, device = inputs.case, device_of(backend)
    q, k, v = (t.detach().to(device).requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    bounds = []
    for lengths in (case.lengths_q, case.keys):
        cu = cumulative(lengths).to(device)
        bounds.append(torch.stack([cu, torch.full_like(cu, -7)], 1).flatten()[::2] if strided_bounds else cu)
    keywords = inputs.keywords()
    if keywords["alibi_slopes"] is not None:
        keywords["alibi_slopes"] = keywords["alibi_slopes"].to(device)
    wrt = [q, k, v]
    if keywords["sinks"] is not None:
        keywords["sinks"] = keywords["sinks"].detach().to(device).requires_grad_()
        wrt.append(keywords["sinks"])
    out, lse = fused_attn.attention_varlen(q, k, v, *bounds, max(case.lengths_q), max(case.keys), return_lse=True,
                                           backend=backend, **keywords)
    outputs, grads_in = [out], [inputs.grad_out.to(device)]
    if inputs.grad_lse is not None:
        outputs.append(lse)
        grads_in.append(inputs.grad_lse.to(device))
    grads = torch.autograd.grad(outputs, wrt, grads_in)
    return testing.Results(out.detach(), lse.detach(), *grads[:3], grad_sinks=grads[3] if len(grads) > 3 else None)


DTYPE_ROTATIONS = [(torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2), (torch.float64, 0)]


@pytest.mark.parametrize("dtype,rotation", DTYPE_ROTATIONS, ids=str)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_matches_padded_definition(generator, backend, name, dtype, rotation, request):
    if backend == "triton":
        if dtype == torch.float64:
            pytest.skip("the triton kernels take float16, bfloat16 and float32")
        triton_on_this_machine(request)
    inputs = random_packed(CASES[name], dtype, rotation, generator)
    actual = run_varlen(inputs, backend)
    testing.assert_close_to_reference(actual, reference_of(inputs, torch.float64), reference_of(inputs, dtype),
                                      dtype)
    # A sequence without keys: rows 0, lse -inf (with sinks: the sink); the bounds of other sequences are
    # never crossed.
    lse = actual.lse
    assert not torch.isnan(lse).any()
    no_key = torch.full((lse.shape[0], 1), float("-inf"), dtype=lse.dtype)
    if inputs.sinks is not None:
        no_key = inputs.sinks.to(lse.dtype)[:, None]
    for b, (n_q, n_k) in enumerate(zip(CASES[name].lengths_q, CASES[name].keys)):
        if n_k == 0 and n_q > 0:
            start = sum(CASES[name].lengths_q[:b])
            assert (lse[:, start:start + n_q].cpu() == no_key).all()
            assert (actual.out[start:start + n_q] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_dropout_is_each_sequence_with_its_own_offset(generator, backend, dtype, request):
    """Sequence b drops what a one-sequence call with the call's (seed, offset + b) drops."""
    if backend == "triton":
        triton_on_this_machine(request)
    case = VarlenCase((13, 0, 37, 6), (20, 4, 37, 6), is_causal=True, causal_alignment="bottom_right",
                      window=(9, 0), softcap=3.0, alibi=True)
    inputs = random_packed(case, dtype, 1, generator)
    seed = 1234
    device = device_of(backend)
    rng = peek_rng(torch.device(device), torch.Generator(device).manual_seed(seed)).cpu()
    q, k, v = (t.detach().to(device).requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    keywords = dict(inputs.keywords(), alibi_slopes=inputs.alibi_slopes.to(device))
    out = fused_attn.attention_varlen(q, k, v, cumulative(case.lengths_q).to(device), cumulative(case.keys).to(device),
                                      dropout_p=0.3, backend=backend, generator=torch.Generator(device).manual_seed(seed),
                                      **keywords)
    grads = [g.cpu() for g in torch.autograd.grad(out, (q, k, v), inputs.grad_out.to(device))]
    out = out.detach().cpu()
    starts_q, starts_k = cumulative(case.lengths_q).tolist(), cumulative(case.keys).tolist()
    for b in range(len(case.lengths_q)):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        one = [t[s0:s1].transpose(0, 1).unsqueeze(0) for t, s0, s1 in (
            (inputs.query, q0, q1), (inputs.key, k0, k1), (inputs.value, k0, k1), (inputs.grad_out, q0, q1))]
        variant = variant_of(one[0], case.causal_alignment, case.window, case.softcap, inputs.alibi_slopes[b:b + 1])
        dropout = Dropout(0.3, shifted_rng(rng, offset=b))
        options = dict(is_causal=True, dropout=dropout, variant=variant)
        exact = testing.reference_results(*one, dtype=torch.float64, **options)
        same = testing.reference_results(*one, dtype=dtype, **options)
        actual = testing.Results(out[q0:q1].transpose(0, 1).unsqueeze(0), exact.lse,
                                 *(g[s0:s1].transpose(0, 1).unsqueeze(0)
                                   for g, s0, s1 in zip(grads, (q0, k0, k0), (q1, k1, k1))))
        testing.assert_close_to_reference(actual, exact, same, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["causal_gqa_lse", "window_softcap_alibi"])
def test_triton_small_tiles_cross_sequences_in_every_kernel(generator, name, dtype, request):
    """Tiles of 16 and 32 rows: blocks straddle the ends of sequences (in the packed storage, the next
    sequence's tokens), and query and key blocks lie past a short sequence's end."""
    triton_on_this_machine(request)
    from fused_attn.backends import triton_kernels as tk

    tiles = dict(fwd=tk.KernelConfig(16, 32, 4, 1), bwd_dkdv=tk.KernelConfig(32, 16, 4, 1),
                 bwd_dq=tk.KernelConfig(16, 32, 4, 1))
    inputs = random_packed(CASES[name], dtype, 2, generator)
    with tk.forced_configs(**tiles):
        actual = run_varlen(inputs, "triton")
    testing.assert_close_to_reference(actual, reference_of(inputs, torch.float64), reference_of(inputs, dtype),
                                      dtype)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_strided_bounds_are_read_through_their_strides(generator, backend, request):
    if backend == "triton":
        triton_on_this_machine(request)
    inputs = random_packed(CASES["cross_bottom_right"], torch.float32, 1, generator)
    expected = run_varlen(inputs, backend)
    actual = run_varlen(inputs, backend, strided_bounds=True)
    for name, value in actual.named().items():
        torch.testing.assert_close(value, getattr(expected, name), rtol=0, atol=0)


def test_compiles_without_graph_breaks_and_matches_eager(generator):
    case = CASES["window_softcap_alibi"]
    inputs = random_packed(case, torch.float32, 0, generator)
    cu_q, cu_k = cumulative(case.lengths_q), cumulative(case.keys)

    def step(q, k, v):
        return fused_attn.attention_varlen(q, k, v, cu_q, cu_k, max(case.lengths_q), max(case.keys), backend="cpu",
                                           **inputs.keywords())

    q, k, v = (t.detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    eager = step(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    grads = torch.autograd.grad(compiled, (q, k, v), inputs.grad_out)
    expected = torch.autograd.grad(eager, (q, k, v), inputs.grad_out)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_opcheck(generator):
    case = CASES["causal_gqa_lse"]
    inputs = random_packed(case, torch.float64, 0, generator)
    q, k, v = (t.detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    args = (q, k, v, cumulative(case.lengths_q), cumulative(case.keys), -1, -1, True, 0.25, 0.0, None, "cpu",
            3, 0, True, 2.0, None)
    torch.library.opcheck(varlen_fwd, args)


def test_backends_declare_packed_batches():
    """cpu, reference, triton and cuda take packed batches (cuda's kernels: tests/test_cuda_emulated.py)."""
    problem = Problem(torch.device("cpu"), torch.float16, 3, 4, 4, 100, 100, 64, 64, False, 0.0, None, False, False,
                      varlen=True)
    assert registry.get("reference").refusals(problem) == registry.get("cpu").refusals(problem) == []
    assert registry.get("triton").takes_varlen and registry.get("cuda").takes_varlen
    assert not any("attention_varlen" in reason for reason in registry.get("cuda").refusals(problem))


def test_bad_arguments_are_named(generator):
    q, k, v = torch.randn(10, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    good_q, good_k = cumulative((4, 6)), cumulative((5, 7))

    def call(**changes):
        arguments = dict(query=q, key=k, value=v, cu_seqlens_q=good_q, cu_seqlens_k=good_k)
        arguments.update(changes)
        return fused_attn.attention_varlen(**arguments)

    for changes, message in [
        (dict(query=q[None]), "query: expected a 3-D"),
        (dict(value=torch.randn(11, 2, 8)), "value: expected"),
        (dict(key=torch.randn(12, 3, 8), value=torch.randn(12, 3, 8)), "key: expected a number of heads"),
        (dict(cu_seqlens_q=good_q.float()), "cu_seqlens_q: expected an int32"),
        (dict(cu_seqlens_k=cumulative((12,))), "cu_seqlens_k: expected shape"),
        (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32)[[0, 1, 3]] - 1), "cu_seqlens_q: expected cumulative"),
        (dict(cu_seqlens_q=torch.tensor([0, 7, 5], dtype=torch.int32)), "cu_seqlens_q: expected cumulative"),
        (dict(cu_seqlens_k=cumulative((5, 6))), "cu_seqlens_k: expected cumulative"),
        (dict(max_seqlen_q=5), "max_seqlen_q: a sequence of cu_seqlens_q"),
        (dict(max_seqlen_k=-2), "max_seqlen_k: expected None or an int"),
        (dict(alibi_slopes=torch.rand(3, 2)), "alibi_slopes: expected shape"),
        (dict(dropout_p=1.0), "dropout_p"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            call(**changes)


def jagged(pieces, requires_grad=True):
    """A jagged nested (B, H, j, D) tensor from (L_b, H, D) pieces, as SDPA's users build them."""
    nested = torch.nested.nested_tensor([p.detach() for p in pieces], layout=torch.jagged,
                                        requires_grad=requires_grad)
    return nested.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nested_tensors_match_pytorchs_own_nested_sdpa(generator, dtype):
    """attention() on jagged nested tensors against PyTorch's own nested SDPA (no causal mask and no
    empty sequence: what it runs on the CPU), gradients included, and against attention_varlen."""
    pieces = [[torch.randn(n, 4, 16, generator=generator).to(dtype) for n in (7, 30, 1)] for _ in range(3)]
    q, k, v = (jagged(p) for p in pieces)
    out = fused_attn.attention(q, k, v, backend="cpu")
    assert out.is_nested and out.shape[1] == 4
    qr, kr, vr = (jagged(p) for p in pieces)
    expected = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.transpose(1, 2).values(), expected.transpose(1, 2).values(), **tolerance)
    grad = torch.randn(out.transpose(1, 2).values().shape, generator=generator).to(dtype)
    for ours, theirs in zip(torch.autograd.grad(out.transpose(1, 2).values(), (q, k, v), grad),
                            torch.autograd.grad(expected.transpose(1, 2).values(), (qr, kr, vr), grad)):
        torch.testing.assert_close(ours.transpose(1, 2).values(), theirs.transpose(1, 2).values(), **tolerance)


def test_nested_tensors_take_what_pytorchs_nested_sdpa_refuses(generator):
    """Causal attention, an empty sequence, GQA: the same as attention_varlen on the packed values."""
    lengths = (9, 0, 20)
    q = jagged([torch.randn(n, 4, 16, generator=generator) for n in lengths])
    k = jagged([torch.randn(n, 2, 16, generator=generator) for n in lengths])
    v = jagged([torch.randn(n, 2, 8, generator=generator) for n in lengths])
    out, lse = fused_attn.attention(q, k, v, is_causal=True, enable_gqa=True, window_size=(4, 0), return_lse=True)
    packed = [t.transpose(1, 2).values() for t in (q, k, v)]
    expected, expected_lse = fused_attn.attention_varlen(*packed, cumulative(lengths), cumulative(lengths),
                                                         is_causal=True, window_size=(4, 0), return_lse=True)
    torch.testing.assert_close(out.transpose(1, 2).values(), expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    with pytest.raises(ValueError, match="key: expected 4 heads"):
        fused_attn.attention(q, k, v)
    with pytest.raises(ValueError, match="attn_mask: not taken with nested tensors"):
        fused_attn.attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key: expected a jagged nested tensor"):
        fused_attn.attention(q, torch.randn(3, 4, 20, 16), q)


def test_an_integer_alignment_is_refused_for_packed_batches():
    """Each sequence of a packed batch has its own diagonal: an offset for all of them is refused."""
    q = torch.randn(10, 2, 8)
    bounds = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="causal_alignment: expected 'top_left' or 'bottom_right' for a packed"):
        fused_attn.attention_varlen(q, q, q, bounds, bounds, is_causal=True, causal_alignment=3)
