"""`python -m bench.gpu_check` (`make gpu-check`): one command that proves a CUDA machine end to end.

With a CUDA device: records the device and the versions that matter; runs the GPU tests in a child
pytest; checks each GPU backend against the float64 reference (`bench.check`); times fused_attn's
`triton` and `cuda` backends against each SDPA kernel alone (flash, cuDNN, memory-efficient),
FlexAttention under torch.compile and flash-attn (where `import flash_attn` works) over the grid of
`gpu_plan`, forward and forward+backward, and one query against dense and paged caches (decode), every
timed output checked against float64 (the forward's on rows of the first sequence), and what the triton
backend's autotuners kept where a row's first calls tuned (`fused_attn.backends.triton_tuning`: pointers, a
descriptor or a warp-specialized variant, with the candidates' times where Triton kept them for that tuning).
Writes JSON lines (one record per measurement and per tuning, each with the run's provenance), a Markdown table
and a PNG into the results directory, and prints a one-line verdict. Exit status 1 on any correctness failure (a test
run, a line of the check, an output beyond the error bound), else 0: slowness is reported, never
failed. Without a CUDA device it says so in one line and exits 0.

`--dry-run` runs the same pipeline on the CPU, on tiny shapes, with the `cpu` backend in place of the
GPU backends: the SDPA kernels the CPU lacks are recorded as refused and FlexAttention runs
uncompiled, so that the tests' plumbing, the timing, the report, the verdict and the exit status run
without a GPU. Every output of a dry run says so; none of its numbers is a GPU number.

    python -m bench.gpu_check [--dry-run] [--results DIR] [--rounds N] [--lengths L [L ...]] [--no-tests]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import fused_attn
from fused_attn import testing
from fused_attn.backends import triton_tuning

from . import check, report, sweep, timing
from .__main__ import positive_int

ROOT = Path(__file__).resolve().parent.parent
GPU_BACKENDS = ("triton", "cuda")
# Each SDPA kernel alone, by the names of torch.nn.attention.SDPBackend.
SDPA_KERNELS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                "sdpa-efficient": "EFFICIENT_ATTENTION"}
# Child pytest runs (arguments after `pytest -q`): the tests marked `cuda`, then the files whose tests
# run on CUDA tensors whenever a device is present (the triton kernels compiled for it).
GPU_TESTS = (("-m", "cuda", "tests"), ("-m", "not slow", "tests/test_triton.py", "tests/test_varlen.py"))
DRY_RUN_LABEL = "DRY RUN (on the CPU, tiny shapes, cpu backend; not GPU numbers)"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures, and where."""
    device: torch.device
    dry_run: bool
    backends: tuple[str, ...]  # fused_attn's backends timed against the others
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens: int  # B·L of every attention shape
    heads: int
    decode_batch: int
    decode_heads: tuple[int, int]  # (H_q, H_kv)
    decode_head_dim: int
    decode_lengths: tuple[int, ...]
    block_size: int  # keys per block of the paged caches (flash-attn 2 asks for a multiple of 256)
    rounds: int
    tests: tuple[tuple[str, ...], ...]
    compile_flex: bool

    @property
    def flex_label(self) -> str:
        return "flex" if self.compile_flex else "flex-eager"


def gpu_plan(lengths=(1024, 2048, 4096, 8192, 16384), rounds: int = 3) -> Plan:
    """The issue's grid: fp16/bf16 × D 64/128 × causal or not × L 1k–16k at 16k tokens, H=16, forward and
    forward+backward; decode: one query of 32 heads over 8 key/value heads, caches of 1k–16k keys."""
    return Plan(device=torch.device("cuda"), dry_run=False, backends=GPU_BACKENDS,
                dtypes=(torch.float16, torch.bfloat16), head_dims=(64, 128), lengths=tuple(lengths), tokens=16384,
                heads=16, decode_batch=8, decode_heads=(32, 8), decode_head_dim=128, decode_lengths=tuple(lengths),
                block_size=256, rounds=rounds, tests=GPU_TESTS, compile_flex=True)


def dry_run_plan(lengths=(32, 64), rounds: int = 2) -> Plan:
    """The same pipeline on the CPU at sizes that take seconds; the tests' run is the GPU one's first
    (here every test it selects skips)."""
    return Plan(device=torch.device("cpu"), dry_run=True, backends=("cpu",), dtypes=(torch.float16, torch.bfloat16),
                head_dims=(16,), lengths=tuple(lengths), tokens=2 * max(lengths), heads=2, decode_batch=2,
                decode_heads=(4, 2), decode_head_dim=16, decode_lengths=(2 * max(lengths),),
                block_size=16, rounds=rounds, tests=GPU_TESTS[:1], compile_flex=False)


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    heads_q: int
    heads_kv: int
    length: int  # keys in each sequence's cache
    head_dim: int
    dtype: torch.dtype
    paged: bool
    block_size: int

    def flops(self) -> float:
        return 4.0 * self.batch * self.heads_q * self.length * self.head_dim

    def cache_bytes(self) -> int:
        """K and V, read once by a call."""
        return 2 * self.batch * self.heads_kv * self.length * self.head_dim * self.dtype.itemsize

    def __str__(self) -> str:
        return (f"{dtype_name(self.dtype)} decode B={self.batch} H={self.heads_q}/{self.heads_kv} L_k={self.length} "
                f"D={self.head_dim} {'paged' if self.paged else 'dense'}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention_shapes(plan: Plan) -> list[sweep.Shape]:
    return [sweep.Shape(max(1, plan.tokens // length), plan.heads, length, dim, causal, dtype)
            for dtype, dim, causal, length in
            itertools.product(plan.dtypes, plan.head_dims, (False, True), plan.lengths)]


def decode_shapes(plan: Plan) -> list[DecodeShape]:
    heads_q, heads_kv = plan.decode_heads
    return [DecodeShape(plan.decode_batch, heads_q, heads_kv, length, plan.decode_head_dim, dtype, paged,
                        plan.block_size)
            for dtype, paged, length in itertools.product(plan.dtypes, (False, True), plan.decode_lengths)]


# -- the implementations ------------------------------------------------------------------------------------------

def sdpa_kernel_call(kind: str) -> Callable:
    """F.scaled_dot_product_attention restricted to one SDPA kernel: a shape it does not take raises."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(*args, **kwargs):
        with sdpa_kernel(getattr(SDPBackend, kind)):
            return F.scaled_dot_product_attention(*args, **kwargs)
    return call


@functools.cache
def compiled_flex_attention() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled as its documentation shows (dynamic shapes after the first change of a size). Dtypes, head
    # dims, masks and the backward still recompile: more than dynamo's default limit of 8, beyond which
    # flex_attention would quietly run uncompiled.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 1024)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
    return torch.compile(flex_attention)


def flex_attention_function(plan: Plan) -> Callable:
    if plan.compile_flex:
        return compiled_flex_attention()
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


@functools.cache
def flash_attn_kvcache_function() -> Callable | None:
    """flash-attn's `flash_attn_with_kvcache`, or None where `import flash_attn` fails (said once)."""
    if sweep.flash_attn_function() is None:
        return None
    from flash_attn import flash_attn_with_kvcache
    return flash_attn_with_kvcache


def attention_implementations(plan: Plan, shape: sweep.Shape) -> dict[str, Callable]:
    """name -> fn(q, k, v, causal) on (B, H, L, D) tensors, as `sweep.runner` calls them."""
    impls = {name: (lambda q, k, v, c, name=name: fused_attn.attention(q, k, v, is_causal=c, backend=name))
             for name in plan.backends}
    for label, kind in SDPA_KERNELS.items():
        impls[label] = lambda q, k, v, c, call=sdpa_kernel_call(kind): call(q, k, v, is_causal=c)
    from torch.nn.attention.flex_attention import create_block_mask

    flex = flex_attention_function(plan)
    block_mask = None
    if shape.causal:  # built once per shape, outside the timing, as a model builds it once per batch
        block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, shape.length, shape.length,
                                       device=plan.device)

    def flex_call(q, k, v, c):
        if not torch.is_grad_enabled():  # on the CPU it refuses inputs that require grad, even under no_grad
            q, k, v = q.detach(), k.detach(), v.detach()
        return flex(q, k, v, block_mask=block_mask)
    impls[plan.flex_label] = flex_call
    flash_attn_func = sweep.flash_attn_function()
    if flash_attn_func is not None:  # it takes and returns (B, L, H, D)
        impls["flash_attn"] = lambda q, k, v, c: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=c).transpose(1, 2)
    return impls


def decode_inputs(shape: DecodeShape, device: torch.device):
    """q (B, H_q, 1, D); the cache as (B, L, H_kv, D) buffers (k, v) and, paged, the same keys in shuffled
    blocks of `block_size` (num_blocks, block_size, H_kv, D) with their int32 block table."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(shape.batch, shape.heads_q, 1, shape.head_dim, generator=generator).to(device, shape.dtype)
    k, v = (torch.randn(shape.batch, shape.length, shape.heads_kv, shape.head_dim, generator=generator)
            .to(device, shape.dtype) for _ in range(2))
    blocks = shape.length // shape.block_size
    table = torch.randperm(shape.batch * blocks, generator=generator).view(shape.batch, blocks).int().to(device)
    k_blocks, v_blocks = (torch.empty_like(x).view(-1, shape.block_size, shape.heads_kv, shape.head_dim)
                          for x in (k, v))
    k_blocks[table.long()] = k.unflatten(1, (blocks, shape.block_size))
    v_blocks[table.long()] = v.unflatten(1, (blocks, shape.block_size))
    return q, k, v, k_blocks, v_blocks, table


def decode_implementations(plan: Plan, shape: DecodeShape, q, k, v, k_blocks, v_blocks, table) -> dict[str, Callable]:
    """name -> a call without arguments returning (B, H_q, 1, D). fused_attn and flash-attn read the cache
    of the row (dense or paged); SDPA and FlexAttention, which have no block table, read the dense one in both."""
    lengths = torch.full((shape.batch,), shape.length, dtype=torch.int32, device=q.device)
    keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, H_kv, L, D) views of the buffers
    cache = dict(block_table=table) if shape.paged else {}
    k_cache, v_cache = (k_blocks, v_blocks) if shape.paged else (keys, values)
    impls = {name: (lambda name=name: fused_attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                                         backend=name, **cache))
             for name in plan.backends}
    for label, kind in SDPA_KERNELS.items():
        impls[label] = lambda call=sdpa_kernel_call(kind): call(q, keys, values, enable_gqa=True)
    flex = flex_attention_function(plan)
    impls[plan.flex_label] = lambda: flex(q, keys, values, enable_gqa=True)
    with_kvcache = flash_attn_kvcache_function()
    if with_kvcache is not None:  # (B, 1, H_q, D) queries, caches in its own layouts
        flash_k, flash_v = (k_blocks, v_blocks) if shape.paged else (k, v)
        impls["flash_attn"] = lambda: with_kvcache(q.transpose(1, 2), flash_k, flash_v, cache_seqlens=lengths,
                                                   **cache).transpose(1, 2)
    return impls


# -- timing -------------------------------------------------------------------------------------------------------

def refusal(run: Callable[[], object]) -> tuple[object, str | None]:
    """(what `run` returns, None), or (None, why it does not run): an SDPA kernel that does not take the
    shape, a flash-attn check, a compiler error, out of memory... each is this row's note, not the end."""
    try:
        return run(), None
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        return None, f"{type(error).__name__}: {first_line}"


def gpu_interleaved_samples(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """{name: seconds per round}: timing.interleaved_samples's rotating rounds, each call of a candidate one
    `timing.gpu_median_seconds` (triton.testing.do_bench: CUDA events, L2 flushed, median), whose result is
    the clock's advance."""
    elapsed = [0.0]

    def measured(run):
        def call():
            elapsed[0] += timing.gpu_median_seconds(run)
        return call

    return timing.interleaved_samples({name: measured(run) for name, run in runs.items()}, rounds, warmup=0,
                                      clock=lambda: elapsed[0])


def samples_of(plan: Plan, runs: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    if plan.device.type == "cuda":
        return gpu_interleaved_samples(runs, plan.rounds)
    return timing.interleaved_samples(runs, plan.rounds)


def measurement_records(samples: dict[str, list[float]], refused: dict[str, str], base: dict, flops: float,
                        cache_bytes: int | None = None) -> list[dict]:
    """One record per implementation: its median time, TFLOP/s (and GB/s of cache read), and its speed
    against each SDPA kernel timed beside it: the median over rounds of the kernel's time over its own
    (above 1: faster than the kernel); or why it did not run."""
    kernels = [name for name in SDPA_KERNELS if name in samples]
    fastest = min(kernels, key=lambda name: statistics.median(samples[name]), default=None)
    records = []
    for name, times in samples.items():
        seconds = statistics.median(times)
        record = {**base, "backend": name, "status": "measured", "rounds": len(times), "time_ms": seconds * 1e3,
                  "tflops": flops / seconds / 1e12,
                  "vs_sdpa": {kernel: timing.median_ratio(samples[kernel], times) for kernel in kernels},
                  "fastest_sdpa": fastest}
        record["vs_fastest_sdpa"] = record["vs_sdpa"].get(fastest)
        if cache_bytes is not None:
            record["gb_s"] = cache_bytes / seconds / 1e9
        records.append(record)
    records += [{**base, "backend": name, "status": "refused", "reason": reason} for name, reason in refused.items()]
    return records


def first_calls(runs: dict[str, Callable[[], object]], keep: Callable = lambda out: out):
    """Each run called once (a compilation, an autotuning, a refusal happen here, before the timing):
    ({name: keep(what it returned)}, {name: why it does not run})."""
    kept, refused = {}, {}
    for name, run in runs.items():
        out, why = refusal(run)
        if why is None:
            kept[name] = keep(out)
        else:
            refused[name] = why
    return kept, refused


def tuned_first_calls(runs: dict[str, Callable[[], object]], base: dict, keep: Callable = lambda out: out):
    """`first_calls`, and a record ("autotune") per tuning the triton backend's autotuners made in them
    (`triton_tuning.new_tunings`: the config each kept, pointers, a descriptor or a warp-specialized variant, and
    the candidates' times where Triton kept them for it), with the row's fields. A tuning made by an earlier row
    (the forward of forward+backward, tuned by the forward row) is that row's."""
    before = triton_tuning.snapshot()
    kept, refused = first_calls(runs, keep)
    tunings = [{**base, "kind": "autotune", "row": base["kind"], "backend": "triton", **tuning}
               for tuning in triton_tuning.new_tunings(before)]
    return kept, refused, tunings


def judge(records: list[dict], outputs: dict[str, torch.Tensor], exact: torch.Tensor, allowed: float) -> None:
    """Adds each measured record's error against float64, the bound and whether it holds (a record with
    "correct": False is a correctness failure of the run)."""
    for record in records:
        if record["status"] == "measured":
            error = testing.max_error(outputs[record["backend"]], exact)
            record.update(error=error, allowed_error=allowed, correct=error <= allowed)


def sampled_rows(length: int, count: int = 64) -> torch.Tensor:
    """Query rows spread over the sequence, the first and the last among them."""
    return torch.linspace(0, length - 1, min(count, length)).round().long().unique()


def attention_reference(q, k, v, causal: bool, rows: torch.Tensor):
    """Rows `rows` of the first sequence's output in float64, and the error bound of the project's criterion
    (the same rows by SDPA's math kernel in the inputs' dtype): the whole output in float64 would not fit at
    the grid's longest rows."""
    math = sdpa_kernel_call("MATH")
    mask = None
    if causal:  # top-left, as is_causal, for the selected rows
        mask = torch.arange(k.shape[2], device=k.device)[None, :] <= rows[:, None]
    with torch.no_grad():
        q_rows, keys, values = q[:1, :, rows], k[:1], v[:1]
        exact = math(q_rows.double(), keys.double(), values.double(), attn_mask=mask)
        return exact, testing.allowed_error("out", exact, math(q_rows, keys, values, attn_mask=mask), q.dtype)


def measure_attention(plan: Plan, shape: sweep.Shape) -> list[dict]:
    """The shape's records, forward and forward+backward, every implementation on the same inputs; the
    forward outputs checked on `sampled_rows` of the first sequence against float64."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.length, shape.head_dim, generator=generator)
               .to(plan.device, shape.dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(q.shape, generator=generator).to(plan.device, shape.dtype)
    rows = sampled_rows(shape.length).to(plan.device)
    exact, allowed = attention_reference(q, k, v, shape.causal, rows)
    impls = attention_implementations(plan, shape)
    records = []
    for direction in sweep.DIRECTIONS:
        runs = {name: sweep.runner(fn, q, k, v, shape.causal, direction, grad) for name, fn in impls.items()}
        base = {"kind": "attention", "direction": direction, "dtype": dtype_name(shape.dtype), "batch": shape.batch,
                "heads": shape.heads, "length": shape.length, "head_dim": shape.head_dim, "causal": shape.causal}
        outputs, refused, tunings = tuned_first_calls(runs, base,
                                                      lambda out: out[:1, :, rows] if direction == "fwd" else None)
        samples = samples_of(plan, {name: run for name, run in runs.items() if name not in refused})
        direction_records = measurement_records(samples, refused, base, shape.flops(direction))
        if direction == "fwd":
            judge(direction_records, outputs, exact, allowed)
        records += direction_records + tunings
    return records


def measure_decode(plan: Plan, shape: DecodeShape) -> list[dict]:
    """The row's records, each implementation's output checked against float64 first."""
    inputs = decode_inputs(shape, plan.device)
    q, k, v = inputs[:3]
    keys, values = k.transpose(1, 2), v.transpose(1, 2)
    with torch.no_grad():
        math = sdpa_kernel_call("MATH")
        exact = math(q.double(), keys.double(), values.double(), enable_gqa=True)
        allowed = testing.allowed_error("out", exact, math(q, keys, values, enable_gqa=True), shape.dtype)
        runs = decode_implementations(plan, shape, *inputs)
        base = {"kind": "decode", "dtype": dtype_name(shape.dtype), "batch": shape.batch, "heads_q": shape.heads_q,
                "heads_kv": shape.heads_kv, "length": shape.length, "head_dim": shape.head_dim,
                "cache": "paged" if shape.paged else "dense", "block_size": shape.block_size if shape.paged else None}
        outputs, refused, tunings = tuned_first_calls(runs, base)
        samples = samples_of(plan, {name: run for name, run in runs.items() if name not in refused})
    records = measurement_records(samples, refused, base, shape.flops(), shape.cache_bytes())
    judge(records, outputs, exact, allowed)
    return records + tunings


# -- tests, check, provenance -----------------------------------------------------------------------------------

def run_tests(plan: Plan, printer=print) -> list[dict]:
    """Each of the plan's pytest runs in a child process, its output passed through; a record per run."""
    records = []
    for arguments in plan.tests:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *arguments]
        shown = shlex.join(["python", *command[1:]])
        printer(f"$ {shown}")
        with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
            lines = []
            for line in child.stdout:
                printer(line.rstrip("\n"))
                lines.append(line.rstrip("\n"))
        summary = next((line for line in reversed(lines) if line.strip()), "(no output)")
        records.append({"kind": "tests", "command": shown, "returncode": child.returncode,
                        "passed": child.returncode == 0, "summary": summary})
    return records


def run_check(plan: Plan, printer=print) -> dict:
    lines = []

    def keep(line):
        printer(line)
        lines.append(line)

    passed = check.run_check(plan.device, plan.dtypes, backends=list(plan.backends), printer=keep)
    results = lines[1:]
    return {"kind": "check", "passed": passed, "lines": len(results),
            "failed": [line for line in results if "FAIL" in line]}


def driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def provenance(plan: Plan) -> dict:
    """report.provenance, and what a GPU run needs besides: capability, driver, CUDA, cuDNN, Python."""
    meta = report.provenance(plan.device)
    meta.update(dry_run=plan.dry_run, python=platform.python_version(), cuda_runtime=torch.version.cuda,
                backends={name: why or "available" for name, why in fused_attn.available_backends().items()})
    if plan.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(plan.device)
        meta.update(capability=f"{major}.{minor}", driver=driver_version(), cudnn=torch.backends.cudnn.version())
    return meta


# -- report ------------------------------------------------------------------------------------------------------

def implementation_order(plan: Plan, records: list[dict]) -> list[str]:
    named = [*plan.backends, *SDPA_KERNELS, plan.flex_label, "flash_attn"]
    present = {record["backend"] for record in records}
    return [name for name in named if name in present]


def _number(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def markdown_table(plan: Plan, records: list[dict], kind: str) -> list[str]:
    """One line per row of the grid: each implementation's TFLOP/s (decode: µs per call; "—": it did not
    run), then each fused_attn backend's speed against each SDPA kernel."""
    rows = [record for record in records if record.get("kind") == kind and "backend" in record]
    names = implementation_order(plan, rows)
    ratios = [(backend, kernel) for backend in plan.backends for kernel in SDPA_KERNELS]
    if kind == "attention":
        keys = ("dtype", "head_dim", "causal", "batch", "length", "direction")
        head = ["dtype", "D", "causal", "B", "L", "pass"]
        cell = lambda record: _number(record.get("tflops"))  # noqa: E731
    else:
        keys = ("dtype", "cache", "batch", "heads_q", "heads_kv", "length", "head_dim")
        head = ["dtype", "cache", "B", "H_q", "H_kv", "L_k", "D"]
        cell = lambda record: _number(record["time_ms"] * 1e3 if "time_ms" in record else None)  # noqa: E731
    lines = ["| " + " | ".join(head + names + [f"{b} × {k}" for b, k in ratios]) + " |",
             "|" + "---|" * (len(head) + len(names) + len(ratios))]
    groups = collections.defaultdict(dict)
    for record in rows:
        groups[tuple(record[key] for key in keys)][record["backend"]] = record
    for key, by_name in groups.items():
        cells = [str(value) for value in key] + [cell(by_name[name]) if name in by_name else "" for name in names]
        cells += [_number(by_name.get(b, {}).get("vs_sdpa", {}).get(k), 3) for b, k in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def row_label(record: dict) -> str:
    """The grid row a record belongs to, in a few words."""
    if record.get("row", record.get("kind")) == "attention":
        return (f"{record['dtype']} D={record['head_dim']}{' causal' if record['causal'] else ''} "
                f"L={record['length']} {record['direction']}")
    return f"{record['dtype']} {record['cache']} L_k={record['length']}"


def autotune_lines(records: list[dict]) -> list[str]:
    """The triton backend's autotuner choices: how often each variant won, then one line per tuning with the kept
    config's time and the fastest pointer candidate's (where Triton kept the candidates' times)."""
    tunings = [record for record in records if record.get("kind") == "autotune"]
    if not tunings:
        return []
    won = collections.Counter(record["variant"] for record in tunings)
    lines = ["## Triton autotuner choices", "",
             f"{len(tunings)} tunings: " + ", ".join(f"{variant} kept in {count}" for variant, count in won.items())
             + ". Times are the autotuner's own (`triton.testing.do_bench` medians, ms).", "",
             "| row | autotuner | kept | kept ms | fastest pointers ms |", "|---|---|---|---|---|"]
    lines += [f"| {row_label(record)} | {record['autotuner']} | {record['chosen']} | "
              f"{_number(record.get('chosen_ms'))} | {_number(record.get('fastest_pointers_ms'))} |"
              for record in tunings]
    return lines + [""]


def write_markdown(path: Path, plan: Plan, meta: dict, records: list[dict], verdict_line: str) -> None:
    title = f"# gpu-check: {meta['device_model']}"
    if plan.dry_run:
        title = f"# gpu-check {DRY_RUN_LABEL}"
    device = (f"capability {meta['capability']}, driver {meta['driver']}, CUDA {meta['cuda_runtime']}, "
              f"cuDNN {meta['cudnn']}, " if "capability" in meta else "")
    lines = [title, "",
             f"{meta['device_model']}: {device}torch {meta['torch']}, Triton {meta['triton']}, flash-attn "
             f"{meta['flash_attn']}, Python {meta['python']}; fused_attn {meta['fused_attn']} "
             f"({meta['git_revision']}), {meta['timestamp']}.", "", f"**{verdict_line}**", "", "## Correctness", ""]
    for record in records:
        if record.get("kind") == "tests":
            lines.append(f"- `{record['command']}`: {record['summary']} ({'pass' if record['passed'] else 'FAIL'})")
        elif record.get("kind") == "check":
            lines.append(f"- `bench.check` on {', '.join(plan.backends)}: {record['lines'] - len(record['failed'])}/"
                         f"{record['lines']} lines pass")
            lines += [f"  - {line}" for line in record["failed"]]
    for kind, what in (("attention", f"forward outputs ({len(sampled_rows(max(plan.lengths)))} query rows of the "
                                      "first sequence)"), ("decode", "decode outputs")):
        judged = [record for record in records if record.get("kind") == kind and "correct" in record]
        wrong = [record for record in judged if not record["correct"]]
        lines.append(f"- {what} of every timed implementation against float64: {len(judged) - len(wrong)}/"
                     f"{len(judged)} within the bound")
        lines += [f"  - {wrong_output(record)}" for record in wrong]
    lines += [f"- {record['shape']}: the run failed there, {record['reason']}" for record in records
              if record.get("kind") == "crash"]
    flex = "FlexAttention under torch.compile" if plan.compile_flex else "FlexAttention uncompiled"
    lines += ["", f"## Attention: TFLOP/s, B·L = {plan.tokens}, H = {plan.heads}", "",
              f"Each SDPA kernel alone (`torch.nn.attention.sdpa_kernel`), {flex} (`{plan.flex_label}`); the "
              "ratio columns are the median over interleaved rounds of the SDPA kernel's time over the fused_attn "
              "backend's (above 1: fused_attn is faster). FLOPs: 4·B·H·L²·D, half when causal, ×3.5 for "
              "forward+backward.", "", *markdown_table(plan, records, "attention"), ""]
    heads_q, heads_kv = plan.decode_heads
    lines += [f"## Decode: µs per call, one query, B = {plan.decode_batch}, H_q = {heads_q}, H_kv = {heads_kv}", "",
              f"Paged: blocks of {plan.block_size} keys in shuffled order, read in place by fused_attn and "
              "flash-attn; SDPA and FlexAttention read the dense cache in both rows.", "",
              *markdown_table(plan, records, "decode"), "", *autotune_lines(records)]
    refused = collections.Counter((record["backend"], record["reason"]) for record in records
                                  if record.get("status") == "refused")
    if refused:
        lines += ["## Did not run", ""]
        lines += [f"- {name} ({count} rows): {reason}" for (name, reason), count in sorted(refused.items())]
    path.write_text("\n".join(lines) + "\n")


def wrong_output(record: dict) -> str:
    if record["kind"] == "attention":
        row = (f"{record['dtype']} B={record['batch']} H={record['heads']} L={record['length']} "
               f"D={record['head_dim']}{' causal' if record['causal'] else ''}")
    else:
        row = f"{record['dtype']} {record['cache']} L_k={record['length']}"
    return (f"{record['kind']} {record['backend']} {row}: error {record['error']:.2e} > "
            f"{record['allowed_error']:.2e}")


def correctness_failures(plan: Plan, records: list[dict]) -> list[str]:
    failures = [f"tests `{record['command']}`: {record['summary']}" for record in records
                if record.get("kind") == "tests" and not record["passed"]]
    failures += [f"check: {' '.join(line.split())}" for record in records if record.get("kind") == "check"
                 for line in record["failed"]]
    failures += [wrong_output(record) for record in records if record.get("correct") is False]
    failures += [f"{record['shape']}: {record['reason']}" for record in records if record.get("kind") == "crash"]
    if not plan.backends:
        failures.append("no fused_attn GPU backend is available: nothing of fused_attn ran")
    return failures


def verdict(plan: Plan, records: list[dict], failures: list[str], report_path: Path) -> str:
    """One line: PASS or FAIL by the correctness failures alone, then each fused_attn backend's count of rows
    at or above the fastest SDPA kernel of the row."""
    scores = []
    for backend in plan.backends:
        for kind in ("attention", "decode"):
            ratios = [record["vs_fastest_sdpa"] for record in records if record.get("kind") == kind
                      and record.get("backend") == backend and record.get("vs_fastest_sdpa") is not None]
            if ratios:
                scores.append(f"{backend} ≥ fastest SDPA kernel on {sum(r >= 1.0 for r in ratios)}/{len(ratios)} "
                              f"{kind} rows (median ×{statistics.median(ratios):.2f})")
    prefix = f"gpu-check {DRY_RUN_LABEL}" if plan.dry_run else "gpu-check"
    outcome = "FAIL" if failures else "PASS"
    return (f"{prefix}: {outcome} — {len(failures)} correctness failures; {'; '.join(scores) or 'nothing timed'}; "
            f"report {report_path}")


def no_gpu_line() -> str:
    plan = gpu_plan()
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"gpu-check: no CUDA GPU is visible (torch {torch.__version__}, {build}); nothing run. With one it runs "
            f"`pytest -m cuda` and the triton tests, bench.check, and times triton and cuda against SDPA "
            f"flash/cuDNN/efficient, FlexAttention and flash-attn on {len(attention_shapes(plan))} shapes × "
            f"fwd, fwd+bwd and {len(decode_shapes(plan))} decode rows (`--dry-run` runs the pipeline on the CPU).")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the whole pipeline on the CPU on tiny shapes (no GPU numbers)")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--rounds", type=positive_int, default=None, help="interleaved rounds per row")
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                        help="sequence lengths and decode cache lengths (default: 1024 ... 16384)")
    parser.add_argument("--no-tests", action="store_true", help="skip the child pytest runs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(no_gpu_line())
        return 0
    options = {key: value for key, value in (("lengths", args.lengths), ("rounds", args.rounds)) if value is not None}
    plan = dry_run_plan(**options) if args.dry_run else gpu_plan(**options)
    if any(length % plan.block_size for length in plan.decode_lengths):
        print(f"gpu-check: --lengths must be multiples of {plan.block_size}, the paged caches' block size")
        return 2
    if args.no_tests:
        plan = dataclasses.replace(plan, tests=())
    if not plan.dry_run:
        available = fused_attn.available_backends()
        plan = dataclasses.replace(plan, backends=tuple(name for name in plan.backends if available[name] is None))
    meta = provenance(plan)
    if plan.dry_run:
        print(f"gpu-check: {DRY_RUN_LABEL}")
    print(f"{meta['device_model']}, torch {meta['torch']}, triton {meta['triton']}, flash-attn {meta['flash_attn']}, "
          f"fused_attn {meta['fused_attn']} ({meta['git_revision']}); backends: "
          + ", ".join(f"{name} {why}" for name, why in meta["backends"].items()))
    records = run_tests(plan)
    print("\nCorrectness against the float64 reference (bench.check):")
    records.append(run_check(plan))
    for measure, shapes in ((measure_attention, attention_shapes(plan)), (measure_decode, decode_shapes(plan))):
        for shape in shapes:
            print(f"timing {shape}", file=sys.stderr)
            try:
                records += measure(plan, shape)
            except Exception as error:  # beyond one implementation's refusal (a CUDA error poisons the context)
                records.append({"kind": "crash", "shape": str(shape), "reason": f"{type(error).__name__}: {error}"})

    stem = f"gpu-check{'-dry-run' if plan.dry_run else ''}-{meta['timestamp'].replace(':', '')}"
    paths = {suffix: args.results / f"{stem}.{suffix}" for suffix in ("jsonl", "md", "png")}
    args.results.mkdir(parents=True, exist_ok=True)
    failures = correctness_failures(plan, records)
    line = verdict(plan, records, failures, paths["md"])
    records.append({"kind": "verdict", "passed": not failures, "failures": failures, "line": line})
    with open(paths["jsonl"], "w") as handle:
        for record in records:
            handle.write(json.dumps({**meta, **record}) + "\n")
    write_markdown(paths["md"], plan, meta, records, line)
    plotted = [record for record in records if record.get("kind") == "attention" and record["status"] == "measured"]
    if plotted:
        label = f"{DRY_RUN_LABEL}: {meta['device_model']}" if plan.dry_run else meta["device_model"]
        report.write_plot(plotted, {**meta, "device_model": label}, paths["png"])
    print(f"\nwrote {', '.join(str(path) for path in paths.values() if path.exists())}")
    for failure in failures:
        print(f"FAIL: {failure}")
    print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
