"""Where results go: the terminal table, a CSV with the run's provenance on every row, a PNG plot."""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import itertools
import os
import platform
import subprocess
from pathlib import Path

import torch

import fused_attn

COLUMNS = ("backend", "direction", "dtype", "batch", "heads", "length", "head_dim", "causal", "time_ms",
           "tflops", "speed_vs_sdpa", "speed_vs_reference", "peak_mib")


def device_model(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def machine_description(device: torch.device) -> str:
    """One line: the model, and on CPUs the vector features, ATen's capability and the threads."""
    if device.type == "cuda":
        return f"{device_model(device)}; torch {torch.__version__} (CUDA {torch.version.cuda})"
    flags = []
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        pass
    wanted = " ".join(flag for flag in SIMD_FLAGS if flag in flags) or "none listed"
    return (f"{device_model(device)}; {os.cpu_count()} CPUs; flags {wanted}; torch {torch.__version__} "
            f"(capability {torch.backends.cpu.get_cpu_capability()}); threads {torch.get_num_threads()}; "
            f"python {platform.python_version()}")


def git_revision() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(device: torch.device) -> dict:
    """What a row needs to be compared with another machine's: device, versions, revision, time."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    try:  # its version, without importing it (flash_attn rows are measured on GPUs only)
        flash_attn_version = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        flash_attn_version = "not installed"
    return {
        "device": device.type,
        "device_model": device_model(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "flash_attn": flash_attn_version,
        "fused_attn": fused_attn.__version__,
        "git_revision": git_revision(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    header = ("backend", "dir", "dtype", "B", "H", "L", "D", "causal", "ms", "TFLOP/s", "x sdpa", "x ref",
              "peak MiB")
    cells = [header] + [tuple(_cell(row[c]) for c in COLUMNS) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def write_csv(rows: list[dict], meta: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*meta, *COLUMNS])
        writer.writeheader()
        for row in rows:
            writer.writerow({**meta, **row})


def write_plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Throughput against length: one panel per (direction, head dim) and dtype, one colour per
    backend (solid: full, dashed: causal), one legend for the figure (a GPU run has a dozen lines,
    which a legend per panel would cover)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    dtypes = sorted({row["dtype"] for row in rows})
    columns = sorted({(row["direction"], row["head_dim"]) for row in rows})
    figure, axes = plt.subplots(len(dtypes), len(columns), figsize=(4.5 * len(columns), 4 * len(dtypes)),
                                squeeze=False)
    backends = sorted({row["backend"] for row in rows})
    colours = {backend: f"C{i}" for i, backend in enumerate(backends)}
    legend = {}
    for (d, dtype), (c, (direction, head_dim)) in itertools.product(enumerate(dtypes), enumerate(columns)):
        axis = axes[d][c]
        for backend in backends:
            for causal, style in ((False, "-"), (True, "--")):
                points = sorted((row["length"], row["tflops"]) for row in rows if row["backend"] == backend
                                and row["dtype"] == dtype and row["direction"] == direction
                                and row["head_dim"] == head_dim and row["causal"] == causal)
                if points:
                    label = f"{backend}{' causal' if causal else ''}"
                    legend[label], = axis.plot(*zip(*points), style, color=colours[backend], marker="o")
        axis.set_xscale("log", base=2)
        axis.set_title(f"{dtype} {direction} D={head_dim}")
        axis.set_xlabel("sequence length")
        axis.set_ylabel("TFLOP/s")
    threads = f" ({meta['threads']} threads)" if meta["device"] == "cpu" else ""
    figure.suptitle(f"fused_attn {meta['fused_attn']} on {meta['device_model']}{threads}")
    figure.tight_layout()
    figure.legend(legend.values(), legend.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
