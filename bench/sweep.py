"""The benchmark sweep: every backend against SDPA and the einsum reference, same inputs, same threads.

FLOPs are counted as 2·B·H·L_q·L_k·(D_qk + D_v) for the forward (4·B·H·L_q·L_k·D when the head dims
agree), half of it when causal, and 2.5× the forward for the backward.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

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
        try:
            from flash_attn import flash_attn_func

            impls["flash_attn"] = lambda q, k, v, c: flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=c).transpose(1, 2)
        except ImportError:
            pass
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


def supported(name: str, fn, q, k, v, causal) -> bool:
    """Some SDPA kernels refuse some inputs on some GPUs: measure only what runs."""
    try:
        with torch.no_grad():
            fn(q, k, v, causal)
        return True
    except RuntimeError:
        return False


def measure_shape(shape: Shape, device: torch.device, directions=DIRECTIONS, rounds: int = 5) -> list[dict]:
    """One row per (implementation, direction) for `shape`."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.length, shape.head_dim, generator=generator)
               .to(device, shape.dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(q.shape, generator=generator).to(device, shape.dtype)
    impls = {name: fn for name, fn in implementations(device, shape).items()
             if supported(name, fn, q, k, v, shape.causal)}
    rows = []
    for direction in directions:
        runners = {name: runner(fn, q, k, v, shape.causal, direction, grad) for name, fn in impls.items()}
        if device.type == "cuda":
            seconds = {name: timing.gpu_median_seconds(run) for name, run in runners.items()}
            ratio_sdpa = {name: seconds["sdpa"] / s for name, s in seconds.items()}
        else:
            samples = timing.interleaved_samples(runners, rounds=rounds)
            seconds = {name: statistics.median(times) for name, times in samples.items()}
            ratio_sdpa = {name: timing.median_ratio(samples["sdpa"], times) for name, times in samples.items()}
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
