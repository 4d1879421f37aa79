"""Timing and memory measurement that holds up on noisy machines.

CPU: the candidates are timed interleaved, one call each per round, so drift hits them alike; the
result is the median time of each and the median over rounds of each candidate's time ratio to a
baseline. GPU: `triton.testing.do_bench` (median), which synchronises and flushes the L2 cache.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def interleaved_medians(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                        baseline: str | None = None) -> dict[str, dict[str, float]]:
    """{name: {"median_s", "ratio_to_baseline"}}: per-round ratio baseline_time / time (>1 = faster)."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    result = {}
    for name, samples in times.items():
        entry = {"median_s": statistics.median(samples)}
        if baseline is not None:
            ratios = [b / t for b, t in zip(times[baseline], samples)]
            entry["ratio_to_baseline"] = statistics.median(ratios)
        result[name] = entry
    return result


def gpu_median_seconds(fn: Callable[[], object]) -> float:
    """Median time of `fn` on the current CUDA device, by triton.testing.do_bench."""
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median") / 1e3


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated by torch during `fn`, beyond what was allocated before it.

    CUDA: the caching allocator's peak statistic. CPU: the profiler's allocation and free events
    replayed in order (the CPU allocator keeps no peak statistic).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as profiler:
        fn()
    # Every allocation and free, in time order, with its signed size.
    records = sorted((event.start_ns(), event.nbytes())
                     for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]")
    allocated = peak = 0
    for _, size in records:
        allocated += size
        peak = max(peak, allocated)
    return peak
