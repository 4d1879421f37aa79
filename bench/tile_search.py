"""The first tiles that compile a group of static-report rows without local memory, without a GPU.

The tables of `fused_attn.backends.triton_kernels` (`_DEFAULTS` and the feature entries beside it) hold, for each
launch, tiles that Triton compiled for their target with no spills, no stack and the tensor-core instructions
expected (bench/triton_report.py). Where the report finds a row that fails, this compiles the rows of a group (a
kernel's variants at one dtype and head dim, on several targets) at candidate configs in the order given, and
reports the first config every row passes, with, for each candidate that failed, its first failing row.

    python -m bench.tile_search --targets sm_90 sm_100 --dtype float32 --head-dim 128 --kernel fwd \\
        --configs 32,16,4,2 32,32,8,1 16,16,4,1        # every variant of the forward
    python -m bench.tile_search ... --scores program packed                  # only those variants

Each candidate is BLOCK_M,BLOCK_N,warps,stages; a descriptor variant (`--kernel fwd_desc`) takes its switches on top.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import triton_report


def _config(text: str) -> tuple[int, int, int, int]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"expected BLOCK_M,BLOCK_N,warps,stages, got {text!r}")
    return values


def first_failure(config, rows, compile_row=None) -> dict | None:
    """The first of `rows` ((kernel, target, dtype, head dim, causal, dropout, bias_grad, scores)) that does not
    compile cleanly at `config` (BLOCK_M, BLOCK_N, warps, stages), as its report row, or None."""
    from fused_attn.backends import triton_kernels as tk

    compile_row = compile_row or triton_report._compile_row
    for row in rows:
        result = compile_row(*row, config=tk.KernelConfig(*config))
        if result["problems"] or result["stack_bytes"] or result["spill_bytes"]:
            return result
    return None


def search(configs, rows, compile_row=None):
    """(the first of `configs` with no failing row or None, [(config, its first failing row)] of those before)."""
    failed = []
    for config in configs:
        failure = first_failure(config, rows, compile_row)
        if failure is None:
            return config, failed
        failed.append((config, failure))
    return None, failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tile_search", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", required=True, choices=list(triton_report.TARGETS))
    parser.add_argument("--dtype", required=True, choices=[*triton_report.DTYPES, "float32"])
    parser.add_argument("--head-dim", type=int, required=True)
    # The kernels launched at a default config (the decode kernel's is fixed: triton_decode.block_n).
    parser.add_argument("--kernel", required=True, choices=[k for k in triton_report.MATMUL_KERNELS
                                                            if triton_report.base_kernel(k) != "decode"])
    parser.add_argument("--scores", nargs="*", help="only the variants with these scores (False, True, packed, ...)")
    parser.add_argument("--configs", nargs="+", type=_config, required=True)
    options = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("compiles for the GPU: unset TRITON_INTERPRET")
    # The rows a report would compile: the kernel only on the targets, dtypes and head dims launches offer it for.
    rows = [(options.kernel, target, options.dtype, options.head_dim, *variant)
            for target in options.targets
            if options.kernel in triton_report.kernels(target, options.dtype, options.head_dim)
            for variant in triton_report.variants(options.kernel)
            if options.scores is None or str(variant[3]) in options.scores]
    if not rows:
        parser.error(f"no report row of {options.kernel} in {options.dtype} at head dim {options.head_dim} on "
                     f"{', '.join(options.targets)} with scores {options.scores}")
    found, failed = search(options.configs, rows)
    for config, row in failed:
        print(json.dumps(dict(config=config, target=row["target"], causal=row["causal"], dropout=row["dropout"],
                              bias_grad=row["bias_grad"], scores=row["scores"], registers=row["registers"],
                              stack_bytes=row["stack_bytes"], problems=row["problems"])))
    print(f"found: {','.join(map(str, found))}" if found else "found: none", flush=True)
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
