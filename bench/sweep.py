"""The benchmark sweep: every backend against SDPA and the einsum reference, same inputs, same threads.

FLOPs are counted as 2·B·H·L_q·L_k·(D_qk + D_v) for the forward (4·B·H·L_q·L_k·D when the head dims
agree), half of it when causal, and 2.5× the forward for the backward.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

import fused_attn
from fused_attn.backends import reference, registry

from . import timing

DIRECTIONS = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    length: int
    head_dim: int
    causal: bool
    dtype: torch.dtype

    def flops(self, direction: str) -> float:
        forward = 4.0 * self.batch * self.heads * self.length * self.length * self.head_dim
        forward *= 0.5 if self.causal else 1.0
        return {"fwd": forward, "bwd": 2.5 * forward, "fwd+bwd": 3.5 * forward}[direction]

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"{dtype} B={self.batch} H={self.heads} L={self.length} D={self.head_dim}"
                f"{' causal' if self.causal else ''}")


def cpu_shapes(quick: bool) -> list[Shape]:
    if quick:
        lengths, dims, dtypes = (256, 512, 1024), (64,), (torch.float32, torch.bfloat16)
        return [Shape(2, 8, length, d, causal, dtype) for dtype, d, causal, length
                in itertools.product(dtypes, dims, (False, True), lengths)]
    shapes = [Shape(4, 8, length, d, causal, dtype) for dtype, d, causal, length in itertools.product(
        (torch.float32, torch.bfloat16), (64, 128), (False, True), (512, 1024, 2048))]
    return shapes + [Shape(1, 8, 8192, 64, causal, dtype) for dtype, causal in
                     itertools.product((torch.float32, torch.bfloat16), (False, True))]


def gpu_shapes(quick: bool) -> list[Shape]:
    lengths = (512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    batch_for = {length: max(1, 16384 // length) for length in lengths}  # constant tokens per call
    return [Shape(batch_for[length], 16, length, d, causal, dtype) for dtype, d, causal, length in
            itertools.product((torch.float16, torch.bfloat16), (64, 128), (False, True), lengths)]


def note(message: str) -> None:
    """A line on stderr that leaves the progress bar intact: what the sweep leaves out, and why."""
    tqdm.write(message, file=sys.stderr)


@functools.cache
def flash_attn_function() -> Callable | None:
    """flash_attn's `flash_attn_func`, or None: when it is not installed, and also when its install is
    broken (a wheel built for another torch or CUDA fails at import with ImportError, OSError,
    RuntimeError...): the benchmark then runs without it, rather than not at all. Tried once."""
    try:
        from flash_attn import flash_attn_func
    except Exception as error:
        if not (isinstance(error, ModuleNotFoundError) and error.name == "flash_attn"):
            note(f"flash_attn left out: it fails at import ({type(error).__name__}: {error})")
        return None
    return flash_attn_func


def implementations(device: torch.device, shape: Shape) -> dict[str, Callable]:
    """name -> fn(q, k, v, causal) for every implementation measured on `device`."""
    impls = {"sdpa": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for label, kind in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                            ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                            ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(q, k, v, c, kind=kind):
                with sdpa_kernel(kind):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=c)
            impls[label] = run
        flash_attn_func = flash_attn_function()
        if flash_attn_func is not None:  # it takes and returns (B, L, H, D)
            impls["flash_attn"] = lambda q, k, v, c: flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=c).transpose(1, 2)
    for name, why in fused_attn.available_backends().items():
        if why is None and name != "reference" and device.type in registry.get(name).devices:
            impls[name] = lambda q, k, v, c, name=name: fused_attn.attention(q, k, v, is_causal=c, backend=name)
    # The einsum reference materialises B·H·L² scores (several copies): skip it where that is > 4 GiB.
    if 4 * shape.batch * shape.heads * shape.length ** 2 * shape.dtype.itemsize <= 4 << 30:
        impls["reference"] = lambda q, k, v, c: reference.attention(q, k, v, is_causal=c)[0]
    return impls


def runner(fn, q, k, v, causal, direction, grad):
    """A no-argument call of `fn`: the forward (no autograd graph), or forward then backward."""
    if direction == "fwd":
        def run():
            with torch.no_grad():
                return fn(q, k, v, causal)
        return run

    def run():
        out = fn(q, k, v, causal)
        return torch.autograd.grad(out, (q, k, v), grad)
    return run


def supported(label: str, run: Callable[[], object]) -> bool:
    """Whether `run` (one implementation in one direction) runs; if not, says why and it is left out.

    Refusals come as RuntimeError from SDPA's kernels ("No available kernel") and flash_attn's
    checks, as ValueError (BackendError) from fused_attn's backends, as Triton's own errors from its
    compiler (CompilationError, OutOfResources), as out-of-memory for the einsum reference: any of
    them leaves this row out rather than end the run. A backward can refuse where its forward ran.
    """
    try:
        run()
        return True
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        note(f"{label} left out: {type(error).__name__}: {first_line}")
        return False


def measure_shape(shape: Shape, device: torch.device, directions=DIRECTIONS, rounds: int = 5) -> list[dict]:
    """One row per (implementation, direction) for `shape`."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.length, shape.head_dim, generator=generator)
               .to(device, shape.dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(q.shape, generator=generator).to(device, shape.dtype)
    impls = implementations(device, shape)
    rows = []
    for direction in directions:
        runners = {name: runner(fn, q, k, v, shape.causal, direction, grad) for name, fn in impls.items()}
        runners = {name: run for name, run in runners.items()
                   if supported(f"{name} {direction} at {shape}", run)}
        if device.type == "cuda":
            seconds = {name: timing.gpu_median_seconds(run) for name, run in runners.items()}
            ratio_sdpa = {name: seconds["sdpa"] / s if "sdpa" in seconds else None
                          for name, s in seconds.items()}
        else:
            samples = timing.interleaved_samples(runners, rounds=rounds)
            seconds = {name: statistics.median(times) for name, times in samples.items()}
            ratio_sdpa = {name: timing.median_ratio(samples["sdpa"], times) if "sdpa" in samples else None
                          for name, times in samples.items()}
        for name, run in runners.items():
            rows.append({
                "backend": name, "direction": direction, "dtype": str(shape.dtype).removeprefix("torch."),
                "batch": shape.batch, "heads": shape.heads, "length": shape.length,
                "head_dim": shape.head_dim, "causal": shape.causal,
                "time_ms": seconds[name] * 1e3,
                "tflops": shape.flops(direction) / seconds[name] / 1e12,
                "speed_vs_sdpa": ratio_sdpa[name],
                "speed_vs_reference": seconds["reference"] / seconds[name] if "reference" in seconds else None,
                "peak_mib": timing.peak_memory_bytes(run, device) / 2 ** 20,
            })
    return rows
