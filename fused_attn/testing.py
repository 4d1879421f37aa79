"""The oracle, the error criterion and random problems, shared by the tests and the benchmarks.

Criterion (as FlashAttention tests): compute the reference in float64 and in the input dtype; a
backend's error against float64 must be at most twice the same-dtype reference's error, plus a small
floor for the dtype, for the output, the log-sum-exp and every gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from .backends import reference

# Floors, relative to the largest magnitude of the float64 result (at least 1).
ERROR_FLOOR = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 1e-5,
    torch.float64: 1e-10,
}

# Each builds a (B, H, L, D) tensor whose storage is laid out differently; unused storage is NaN,
# so a kernel that reads through the wrong strides produces NaN instead of a plausible number.
LAYOUTS = ("contiguous", "heads_inner", "seq_first", "packed", "reversed")


def strided(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to `values` (B, H, L, D) whose memory is laid out as `layout` says."""
    b, h, length, d = values.shape
    if layout == "contiguous":
        storage, order = values.new_empty(b, h, length, d), (0, 1, 2, 3)
    elif layout == "heads_inner":  # (B, L, H, D): a head split of a (B, L, E) tensor
        storage, order = values.new_empty(b, length, h, d), (0, 2, 1, 3)
    elif layout == "seq_first":  # (L, B, H, D): a head split of an (L, B, E) tensor
        storage, order = values.new_empty(length, b, h, d), (1, 2, 0, 3)
    elif layout == "packed":  # the middle slice of a packed (B, L, 3, H, D + 1) projection
        packed = values.new_full((b, length, 3, h, d + 1), float("nan"))
        view = packed[:, :, 1, :, :d].permute(0, 2, 1, 3)
        view.copy_(values)
        return view
    elif layout == "reversed":  # no unit stride along D
        storage, order = values.new_empty(d, length, h, b), (3, 2, 1, 0)
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    view = storage.permute(*order)
    view.copy_(values)
    return view


def nan_filled_like(tensor: torch.Tensor) -> torch.Tensor:
    """Same shape and strides as `tensor`, every element NaN: shows any element a kernel fails to write."""
    return torch.full_like(tensor, float("nan"))


def random_mask(shape, kind: str, dtype: torch.dtype, device="cpu", generator=None) -> torch.Tensor:
    """A random mask of `shape` (to broadcast against (B, H, L_q, L_k)) and `kind`: "bool" or "additive".

    About one key in four is hidden. Additive masks mix finite biases and -inf.
    """
    hidden = torch.rand(shape, generator=generator, device=device) < 0.25
    if kind == "bool":
        return ~hidden
    if kind == "additive":
        bias = torch.randn(shape, generator=generator, device=device)
        return bias.masked_fill(hidden, float("-inf")).to(dtype)
    raise ValueError(f"kind: expected 'bool' or 'additive', got {kind!r}")


@dataclasses.dataclass
class Results:
    """A forward and backward: output, log-sum-exp and the gradients of query, key and value."""

    out: torch.Tensor
    lse: torch.Tensor
    grad_query: torch.Tensor | None = None
    grad_key: torch.Tensor | None = None
    grad_value: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if getattr(self, field.name) is not None}


def reference_results(query, key, value, grad_out=None, *, dtype=None, attn_mask=None,
                      key_padding_mask=None, is_causal=False, scale=None) -> Results:
    """The einsum reference, on the CPU, in `dtype` (default the inputs'), with autograd gradients.

    Masks are in `attention`'s convention (bool True = attend; additive of query's dtype, which is
    converted to `dtype`). H_q may be a multiple of H_kv.
    """
    dtype = dtype or query.dtype

    def prepared(tensor, grad):
        return tensor.detach().to("cpu", dtype).requires_grad_(grad)

    wants_grad = grad_out is not None
    q, k, v = (prepared(t, wants_grad) for t in (query, key, value))
    mask = None
    if attn_mask is not None:
        mask = attn_mask.detach().cpu()
        mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    padding = None if key_padding_mask is None else key_padding_mask.cpu()
    out, lse = reference.attention(q, k, v, mask, padding, is_causal, scale)
    results = Results(out.detach(), lse.detach())
    if wants_grad:
        results.grad_query, results.grad_key, results.grad_value = torch.autograd.grad(
            out, (q, k, v), grad_out.detach().to("cpu", dtype))
    return results


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, where equal infinities (a -inf lse of a hidden row) count as 0."""
    actual = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    both_inf = torch.isinf(actual) & torch.isinf(expected) & (actual == expected)
    difference = (actual - expected).abs().masked_fill(both_inf, 0.0)
    return float(difference.max()) if difference.numel() else 0.0


def allowed_error(name: str, exact: torch.Tensor, same_dtype: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the error of the same-dtype reference, plus the floor of `dtype` at the result's scale."""
    finite = exact[torch.isfinite(exact)]
    magnitude = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return 2.0 * max_error(same_dtype, exact) + ERROR_FLOOR[dtype] * magnitude


def assert_close_to_reference(actual: Results, exact: Results, same_dtype: Results,
                              dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Checks every result of `actual` by the criterion; returns {name: (error, allowed)}.

    Raises AssertionError naming each result that is not written (NaN) or out of bounds.
    """
    report, failures = {}, []
    for name, value in actual.named().items():
        expected, baseline = getattr(exact, name), getattr(same_dtype, name)
        if tuple(value.shape) != tuple(expected.shape):
            failures.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(expected.shape)}")
            continue
        nan_where_finite = torch.isnan(value.detach().cpu()) & ~torch.isnan(expected)
        if nan_where_finite.any():
            failures.append(f"{name}: {int(nan_where_finite.sum())} elements NaN (unwritten?)")
            continue
        error, allowed = max_error(value, expected), allowed_error(name, expected, baseline, dtype)
        report[name] = (error, allowed)
        if not error <= allowed:
            failures.append(f"{name}: error {error:.3e} > allowed {allowed:.3e}")
    if failures:
        raise AssertionError("; ".join(failures))
    return report


def check_against_reference(actual: Results, query, key, value, grad_out=None, **options):
    """`assert_close_to_reference` against the float64 and same-dtype references of these inputs."""
    exact = reference_results(query, key, value, grad_out, dtype=torch.float64, **options)
    same_dtype = reference_results(query, key, value, grad_out, **options)
    return assert_close_to_reference(actual, exact, same_dtype, query.dtype)
