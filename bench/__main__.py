"""`python -m bench`: check every backend against the float64 reference, then benchmark them.

    python -m bench [--quick | --full] [--device cpu|cuda] [--no-check] [--results DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from . import check, report, sweep


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv=None):
    """The arguments, with `device` resolved to "cpu" or "cuda"."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="short sweep, a few minutes on 2 cores (default)")
    size.add_argument("--full", action="store_true", help="the whole sweep")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda when a GPU is present, else cpu")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--rounds", type=positive_int, default=None, help="timing rounds per shape on CPU")
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if args.device == "cuda" and not has_cuda:
        # Otherwise the first CUDA call, deep in the run, fails with torch's own traceback.
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        parser.error(f"--device cuda: no CUDA device is available (torch {torch.__version__}, {build})")
    args.device = args.device or ("cuda" if has_cuda else "cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    quick = not args.full
    meta = report.provenance(device)
    print(f"fused_attn {meta['fused_attn']} ({meta['git_revision']}), torch {meta['torch']}, "
          f"triton {meta['triton']}")
    print(f"device: {meta['device_model']}, {meta['threads']} threads\n")

    passed = True
    if not args.no_check:
        dtypes = (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float32, torch.bfloat16)
        print("Correctness against the float64 reference (forward, log-sum-exp, gradients):")
        passed = check.run_check(device, dtypes)
        print()

    shapes = sweep.gpu_shapes(quick) if device.type == "cuda" else sweep.cpu_shapes(quick)
    rounds = args.rounds or (5 if quick else 7)
    rows = []
    for shape in tqdm(shapes, desc="benchmark", unit="shape", file=sys.stderr):
        rows.extend(sweep.measure_shape(shape, device, rounds=rounds))
    print(report.format_table(rows))

    stem = f"{device.type}-{meta['timestamp'].replace(':', '')}"
    csv_path, plot_path = args.results / f"{stem}.csv", args.results / f"{stem}.png"
    report.write_csv(rows, meta, csv_path)
    report.write_plot(rows, meta, plot_path)
    print(f"\nwrote {csv_path} and {plot_path}")
    if not passed:
        print("correctness check FAILED (see above)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
