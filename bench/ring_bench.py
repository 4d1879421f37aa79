"""`python -m bench.ring_bench`: what ring attention (fused_attn.distributed) costs over one process.

The full sequence, (B, H, L, D), attended by `fused_attn.attention` in one process, and by
`ring_attention` in W processes on its shards (gloo on the CPU; `--device cuda` runs NCCL, one GPU a
rank, for users with GPUs). Reported per configuration: the median time of a forward and of a
forward+backward (for the ring, the slowest rank's, each round starting at a barrier), the time per
ring step (forward+backward / W), the ratio to the single process, and the bytes each rank sends
(forward, backward).

On the CPU the ranks share the machine: the single process gets every core, each of W ranks
cores / W threads (at least one), so the ratio shows the ring's overhead at equal hardware; with
more ranks than cores they time-slice and the ratio says so.

    python -m bench.ring_bench [--worlds 2 4] [--length 2048] [--layouts zigzag contiguous]
                               [--dtypes fp32 bf16] [--causal 1 0] [--rounds 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fused_attn
from fused_attn import distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------

def _entry(rank, world, store_path, backend, threads, timeout_s, function, args):
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    function(rank, world, *args)
    # Not on failure: a rank that raised exits at once, which its peers see as a lost connection,
    # instead of waiting in the teardown for them.
    dist.destroy_process_group()


def run_processes(world: int, function, args=(), *, backend: str = "gloo", threads: int = 1,
                  deadline_s: float = 600.0, collective_timeout_s: float = 120.0) -> None:
    """function(rank, world, *args) in `world` spawned processes of one process group, each collective
    bounded by `collective_timeout_s`; the first failure is raised
    (torch.multiprocessing.ProcessRaisedException, the others terminated), and TimeoutError after
    `deadline_s`."""
    with tempfile.TemporaryDirectory() as directory:
        context = mp.start_processes(_entry, args=(world, os.path.join(directory, "store"), backend, threads,
                                                   collective_timeout_s, function, args), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + deadline_s
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                raise TimeoutError(f"the {world}-process ring did not finish within {deadline_s} s")


# ---------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------

def _inputs(config: dict, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    shape = (config["batch"], config["heads"], config["length"], config["head_dim"])
    return [torch.randn(shape, generator=generator).to(device, DTYPES[config["dtype"]]) for _ in range(4)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(function, device, rounds: int, barrier=None) -> list[float]:
    function()  # warm-up
    samples = []
    for _ in range(rounds):
        if barrier is not None:
            barrier()
        _synchronize(device)
        begin = time.perf_counter()
        function()
        _synchronize(device)
        samples.append(time.perf_counter() - begin)
    return samples


def _forward_backward(attend, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)


def _ring_worker(rank, world, configs, device_type, rounds, result_path):
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    results = []
    for config in configs:
        q, k, v, grad_out = (distributed.shard(t, config["layout"]) for t in _inputs(config, device))

        def attend(q, k, v):
            return distributed.ring_attention(q, k, v, is_causal=config["causal"], layout=config["layout"],
                                              **_scores_keywords(config, device))

        distributed.traffic.reset()
        with torch.no_grad():
            attend(q, k, v)
        forward_bytes = distributed.traffic.sent_bytes
        distributed.traffic.reset()
        _forward_backward(attend, q, k, v, grad_out)
        backward_bytes = distributed.traffic.sent_bytes - forward_bytes
        with torch.no_grad():
            forward = _timed(lambda: attend(q, k, v), device, rounds, dist.barrier)
        forward_backward = _timed(lambda: _forward_backward(attend, q, k, v, grad_out), device, rounds, dist.barrier)
        # The ring is as fast as its slowest rank, round by round.
        times = torch.tensor([forward, forward_backward], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        results.append(dict(fwd_ms=1e3 * statistics.median(times[0].tolist()),
                            fwd_bwd_ms=1e3 * statistics.median(times[1].tolist()),
                            fwd_sent_bytes=forward_bytes, bwd_sent_bytes=backward_bytes))
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(results, handle)


def _single_process(config: dict, device: torch.device, rounds: int) -> dict:
    q, k, v, grad_out = _inputs(config, device)

    def attend(q, k, v):
        return fused_attn.attention(q, k, v, is_causal=config["causal"], **_scores_keywords(config, device))

    with torch.no_grad():
        forward = _timed(lambda: attend(q, k, v), device, rounds)
    forward_backward = _timed(lambda: _forward_backward(attend, q, k, v, grad_out), device, rounds)
    return dict(fwd_ms=1e3 * statistics.median(forward), fwd_bwd_ms=1e3 * statistics.median(forward_backward),
                fwd_sent_bytes=0, bwd_sent_bytes=0)


def _scores_keywords(config: dict, device: torch.device) -> dict:
    """Dropout and ALiBi (BLOOM's slopes, 2^(-8 h / H)), with which the ring runs a call per chunk pair."""
    keywords = dict(dropout_p=config["dropout_p"])
    if config["alibi"]:
        heads = config["heads"]
        keywords["alibi_slopes"] = 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device) / heads)
    return keywords


def run(worlds=(2, 4), batch=1, heads=8, length=2048, head_dim=64, dtypes=("fp32",), causal=(True, False),
        layouts=("zigzag", "contiguous"), rounds=5, device="cpu", deadline_s=1800.0, dropout_p=0.0,
        alibi=False) -> list[dict]:
    """Rows of measurements: the single process (processes=1) and each ring, for every configuration."""
    device = torch.device(device)
    cores = os.cpu_count() or 1
    configs = [dict(batch=batch, heads=heads, length=length, head_dim=head_dim, dtype=dtype, causal=is_causal,
                    layout=layout, dropout_p=dropout_p, alibi=alibi)
               for dtype in dtypes for is_causal in causal for layout in layouts]
    rows = []
    for config in configs:
        if device.type == "cpu":
            torch.set_num_threads(cores)
        single = _single_process(config, device, rounds)
        rows.append(dict(config, processes=1, threads=torch.get_num_threads(), **single))
    for world in worlds:
        threads = max(1, cores // world)
        with tempfile.TemporaryDirectory() as directory:
            result_path = os.path.join(directory, "results.json")
            run_processes(world, _ring_worker, (configs, device.type, rounds, result_path),
                          backend="nccl" if device.type == "cuda" else "gloo", threads=threads, deadline_s=deadline_s)
            with open(result_path) as handle:
                measured = json.load(handle)
        for config, result in zip(configs, measured):
            rows.append(dict(config, processes=world, threads=threads, **result))
    singles = {_key(row): row for row in rows if row["processes"] == 1}
    for row in rows:
        single = singles[_key(row)]
        row["per_step_ms"] = row["fwd_bwd_ms"] / row["processes"]
        row["fwd_vs_single"] = row["fwd_ms"] / single["fwd_ms"]
        row["fwd_bwd_vs_single"] = row["fwd_bwd_ms"] / single["fwd_bwd_ms"]
    return rows


def _key(row: dict) -> tuple:
    return tuple(row[name] for name in ("batch", "heads", "length", "head_dim", "dtype", "causal", "layout",
                                        "dropout_p", "alibi"))


COLUMNS = (("processes", "ranks"), ("threads", "thr/rank"), ("layout", "layout"), ("dtype", "dtype"),
           ("causal", "causal"), ("fwd_ms", "fwd ms"), ("fwd_bwd_ms", "fwd+bwd ms"), ("per_step_ms", "ms/step"),
           ("fwd_vs_single", "fwd x1"), ("fwd_bwd_vs_single", "fwd+bwd x1"), ("fwd_sent_bytes", "fwd KiB sent"),
           ("bwd_sent_bytes", "bwd KiB sent"))


def _cell(name: str, value) -> str:
    if name.endswith("_bytes"):
        return f"{value / 1024:.0f}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_rows(rows: list[dict]) -> str:
    """The terminal table: one line per single process ("1") or ring of W ranks."""
    header = [title for _, title in COLUMNS]
    cells = [header] + [[_cell(name, row[name]) for name, _ in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    return "ring attention vs one process (x1: time over the single process's)\n" + "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"])
    parser.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    parser.add_argument("--layouts", nargs="+", choices=distributed.LAYOUTS, default=["zigzag", "contiguous"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every call")
    parser.add_argument("--alibi", action="store_true", help="ALiBi slopes on every call")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: NCCL, one GPU per rank (needs as many GPUs as the largest world)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < max(args.worlds):
        parser.error(f"--device cuda needs {max(args.worlds)} GPUs, found {torch.cuda.device_count()}")
    from . import report

    print(report.machine_description(torch.device(args.device)))
    rows = run(args.worlds, args.batch, args.heads, args.length, args.head_dim, args.dtypes,
               [bool(c) for c in args.causal], args.layouts, args.rounds, args.device, dropout_p=args.dropout,
               alibi=args.alibi)
    print(f"B={args.batch} H={args.heads} L={args.length} D={args.head_dim} dropout_p={args.dropout} "
          f"alibi={args.alibi}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
