"""The correctness check that opens `make bench`: every backend that runs on the device against the
float64 reference, forward and backward, by the criterion of fused_attn.testing."""

from __future__ import annotations

import dataclasses

import torch

import fused_attn
from fused_attn import testing
from fused_attn.backends import registry


@dataclasses.dataclass(frozen=True)
class CheckProblem:
    name: str
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 4
    len_q: int = 77
    len_k: int = 77
    head_dim: int = 64
    head_dim_v: int = 64
    is_causal: bool = False
    mask: str | None = None
    padding: bool = False


PROBLEMS = (
    CheckProblem("plain"),
    CheckProblem("causal", is_causal=True),
    CheckProblem("bool mask + padding", mask="bool", padding=True),
    CheckProblem("additive mask, L_q != L_k", mask="additive", len_q=50, len_k=131),
    CheckProblem("gqa, causal", heads_kv=2, is_causal=True),
    CheckProblem("head dims 40 / 24", head_dim=40, head_dim_v=24),
)


def device_backends(device: torch.device) -> list[str]:
    """Backends available here that would be chosen for tensors on `device`."""
    return [name for name, why in fused_attn.available_backends().items()
            if why is None and device.type in registry.get(name).devices]


def check_one(backend: str, problem: CheckProblem, dtype: torch.dtype, device: torch.device,
              seed: int = 0) -> dict:
    """Runs one problem forward and backward; returns {"errors": {...}, "passed", "reason"}."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape):
        return torch.randn(shape, generator=generator).to(device, dtype).requires_grad_()

    q = tensor(problem.batch, problem.heads_q, problem.len_q, problem.head_dim)
    k = tensor(problem.batch, problem.heads_kv, problem.len_k, problem.head_dim)
    v = tensor(problem.batch, problem.heads_kv, problem.len_k, problem.head_dim_v)
    options = dict(is_causal=problem.is_causal)
    if problem.mask:
        mask = testing.random_mask((problem.batch, 1, problem.len_q, problem.len_k), problem.mask, dtype,
                                   generator=generator)
        options["attn_mask"] = mask.to(device)
    if problem.padding:
        options["key_padding_mask"] = (torch.rand(problem.batch, problem.len_k, generator=generator) < 0.2
                                       ).to(device)
    try:
        out, lse = fused_attn.attention(q, k, v, enable_gqa=True, return_lse=True, backend=backend, **options)
        grad_out = torch.randn(out.shape, generator=generator).to(device, dtype)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        errors = testing.check_against_reference(testing.Results(out, lse, *grads), q, k, v, grad_out,
                                                 **options)
        return {"errors": errors, "passed": True, "reason": ""}
    except (AssertionError, RuntimeError, ValueError) as failure:
        return {"errors": {}, "passed": False, "reason": str(failure)[:200]}


def run_check(device: torch.device, dtypes, backends=None, printer=print) -> bool:
    """Prints one line per (backend, dtype, problem); returns whether everything passed."""
    backends = backends or device_backends(device)
    all_passed = True
    printer(f"{'backend':<10} {'dtype':<9} {'problem':<28} {'worst error / allowed':>22}  result")
    for backend in backends:
        for dtype in dtypes:
            for problem in PROBLEMS:
                result = check_one(backend, problem, dtype, device)
                all_passed &= result["passed"]
                if result["passed"]:
                    name, (error, allowed) = max(result["errors"].items(), key=lambda e: e[1][0] / e[1][1])
                    detail = f"{name} {error:.1e}/{allowed:.1e}"
                    printer(f"{backend:<10} {str(dtype)[6:]:<9} {problem.name:<28} {detail:>22}  pass")
                else:
                    printer(f"{backend:<10} {str(dtype)[6:]:<9} {problem.name:<28} {'':>22}  FAIL: "
                            f"{result['reason']}")
    return all_passed
