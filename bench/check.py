"""The correctness check that opens `make bench`: every backend that runs on the device against the
float64 reference, forward and backward, by the criterion of fused_attn.testing."""

from __future__ import annotations

from dataclasses import replace

import torch

import fused_attn
from fused_attn import testing
from fused_attn.backends import registry

_PLAIN = testing.Case(batch=2, heads_q=4, heads_kv=4, len_q=77, len_k=77, dim_qk=64)
PROBLEMS = {
    "plain": _PLAIN,
    "causal": replace(_PLAIN, is_causal=True),
    "bool mask + padding": replace(_PLAIN, mask="bool", mask_shape="batch", key_padding=True),
    "additive mask, L_q != L_k": replace(_PLAIN, mask="additive", mask_shape="batch", len_q=50, len_k=131),
    "gqa, causal": replace(_PLAIN, heads_kv=2, is_causal=True),
    "head dims 40 / 24": replace(_PLAIN, dim_qk=40, dim_v=24),
}


def device_backends(device: torch.device) -> list[str]:
    """Backends available here that would be chosen for tensors on `device`."""
    return [name for name, why in fused_attn.available_backends().items()
            if why is None and device.type in registry.get(name).devices]


def check_one(backend: str, case: testing.Case, dtype: torch.dtype, device: torch.device) -> dict:
    """Runs one problem forward and backward through `fused_attn.attention`, each tensor in its own
    layout (`testing.rotated_layouts(0)`); returns {"errors": {...}, "passed", "reason"}."""
    generator = torch.Generator().manual_seed(0)
    inputs = testing.random_inputs(case, dtype, 0, generator, device)
    try:
        errors = testing.check_inputs(testing.run_attention(inputs, backend), inputs)
        return {"errors": errors, "passed": True, "reason": ""}
    except Exception as failure:
        # Not only the criterion's AssertionError: on a GPU, Triton's compiler raises its own errors
        # (CompilationError, OutOfResources). Each is this line's FAIL, not the end of the check.
        return {"errors": {}, "passed": False, "reason": f"{type(failure).__name__}: {str(failure)[:200]}"}


def run_check(device: torch.device, dtypes, backends=None, printer=print) -> bool:
    """Prints one line per (backend, dtype, problem); returns whether everything passed."""
    backends = backends or device_backends(device)
    all_passed = True
    printer(f"{'backend':<10} {'dtype':<9} {'problem':<28} {'worst error / allowed':>22}  result")
    for backend in backends:
        for dtype in dtypes:
            for problem, case in PROBLEMS.items():
                result = check_one(backend, case, dtype, device)
                all_passed &= result["passed"]
                if result["passed"]:
                    name, (error, allowed) = max(result["errors"].items(), key=lambda e: e[1][0] / e[1][1])
                    detail = f"{name} {error:.1e}/{allowed:.1e}"
                    printer(f"{backend:<10} {str(dtype)[6:]:<9} {problem:<28} {detail:>22}  pass")
                else:
                    printer(f"{backend:<10} {str(dtype)[6:]:<9} {problem:<28} {'':>22}  FAIL: "
                            f"{result['reason']}")
    return all_passed
