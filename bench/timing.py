"""Timing and memory measurement that holds up on noisy machines.

CPU: the candidates are timed interleaved, one call each per round, so drift hits them alike, and
the order rotates from round to round, so each candidate takes each place in the round equally
often; with two candidates, each follows the other in half of the calls (a call runs slower after
one that evicted its data from the caches). The result is the median time of each and the median
over rounds of each candidate's time ratio to a baseline. GPU: `triton.testing.do_bench` (median), which synchronises and flushes the L2 cache.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def interleaved_samples(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                        budget_s: float | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """{name: seconds of each call}: one call of each candidate per round, after `warmup` calls each.

    Round i starts with the (i mod n)-th candidate. With `budget_s`, stops after the round that
    exceeds it (but never before three rounds). `clock` times the calls (the budget is wall clock):
    `time.thread_time` counts only the calling thread's CPU time, which other jobs on the machine
    barely disturb.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    names = list(candidates)
    samples = {name: [] for name in names}
    start = time.perf_counter()
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            begin = clock()
            candidates[name]()
            samples[name].append(clock() - begin)
        if budget_s is not None and index >= 2 and time.perf_counter() - start > budget_s:
            break
    return samples


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of numerator / denominator: with times, > 1 means the denominator is faster."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


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
