"""The `cuda` backend's kernels compiled by nvcc for sm_80 and sm_90, judged by ptxas's own report.

Every shipped template instance (the split-KV decode kernels' too), each with the code of every runtime
feature (dropout, mask programs, ...): no spills, registers within what __launch_bounds__ allows, shared
memory within the target's limit (and within 99 KB, so sm_86/sm_89 run them too), tensor-core
instructions in the fp16/bf16 tile products and none in the fp32 ones. Skips only where nvcc is
absent. The rows are the cuda rows of `python -m bench.inspect --json`, run once per test session
(the `static_gpu_report` fixture of conftest.py; 30-40 s here for the CUDA part, both targets).
"""

from __future__ import annotations

import re

import pytest

from bench import cuda_report, gpu_binaries

HEADER = cuda_report.KERNEL_DIR / "flash_kernels.cuh"


def shipped_instances() -> set[tuple[str, int]]:
    """(dtype, head dim) pairs listed by FUSED_ATTN_CUDA_FOR_EACH_INSTANCE, read from the header."""
    text = HEADER.read_text()
    start = text.index("#define FUSED_ATTN_CUDA_FOR_EACH_INSTANCE(X)")
    body = text[start:text.index("\n\n", start)]
    return {(cuda_report.DTYPE_NAMES[t], int(d)) for t, d in re.findall(r"X\((\w+), (\d+)\)", body)}


def shipped_decode_instances() -> set[tuple[str, int, int]]:
    """(dtype, head dim, tile rows) of FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE, read from the header."""
    text = HEADER.read_text()
    tiles = re.search(r"#define FUSED_ATTN_CUDA_DECODE_TILES\(X, T, D\) (.*)", text).group(1)
    rows = [int(m) for m in re.findall(r"X\(T, D, (\d+)\)", tiles)]
    start = text.index("#define FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE(X)")
    body = text[start:text.index("\n\n", start)]
    return {(cuda_report.DTYPE_NAMES[t], int(d), m)
            for t, d in re.findall(r"DECODE_TILES\(X, (\w+), (\d+)\)", body) for m in rows}


@pytest.fixture(scope="module")
def report_rows(static_gpu_report):
    try:
        gpu_binaries.find_cuobjdump(cuda_report.find_nvcc())
    except gpu_binaries.ToolMissing as missing:
        pytest.skip(f"the CUDA tools are not installed: {missing}")
    if "cuda" in static_gpu_report.missing:
        pytest.fail(f"bench.inspect could not compile the CUDA kernels:\n{static_gpu_report.stderr[-4000:]}")
    return static_gpu_report.of("cuda")


def _offenders(rows, predicate):
    return [f"{r['kernel']}[{r['dtype']}, D={r['head_dim']}] on {r['target']}: {r}" for r in rows
            if predicate(r)]


def test_every_shipped_instance_is_compiled_for_every_target(report_rows):
    instances, decode_instances = shipped_instances(), shipped_decode_instances()
    assert len(instances) == 12 and len(decode_instances) == 18
    for target in cuda_report.TARGETS:
        rows = [r for r in report_rows if r["target"] == target]
        for kernel in cuda_report.DROPOUT_KERNELS:
            compiled = {(r["dtype"], r["head_dim"]) for r in rows if r["kernel"] == kernel}
            assert compiled == instances, (target, kernel)
        decode = {(r["dtype"], r["head_dim"], int(re.match(r"BLOCK_M=(\d+)", r["config"]).group(1)))
                  for r in rows if r["kernel"] == "decode"}
        assert decode == decode_instances, target
        for kernel in ("backward_delta", "decode_combine"):
            assert {r["dtype"] for r in rows if r["kernel"] == kernel} == {"float16", "bfloat16", "float32"}, target


def test_no_spills_and_no_stack(report_rows):
    assert not _offenders(report_rows, lambda r: r["spill_bytes"] or r["stack_bytes"])


def test_registers_within_launch_bounds(report_rows):
    # __launch_bounds__(128, 1): 128 threads, so up to 255 registers a thread.
    assert all(r["registers"] > 0 for r in report_rows)
    assert not _offenders(report_rows, lambda r: r["registers"] > cuda_report.MAX_REGISTERS)


def test_shared_memory_within_target_limits(report_rows):
    assert not _offenders(report_rows,
                          lambda r: r["shared_bytes"] > gpu_binaries.SHARED_MEMORY_LIMIT[r["target"]])
    # Also within the 99 KB of sm_86/sm_89, the other default target architectures.
    assert not _offenders(report_rows, lambda r: r["shared_bytes"] > 99 * 1024)


def test_tensor_cores_for_half_precision_only(report_rows):
    def wrong(r):
        count = sum(r["tensor_core_instructions"].values())
        if r["kernel"] in cuda_report.MATMUL_KERNELS and r["dtype"] != "float32":
            return count == 0 or not all(m.startswith("HMMA") for m in r["tensor_core_instructions"])
        return count != 0

    assert not _offenders(report_rows, wrong)
    bf16 = [r for r in report_rows if r["dtype"] == "bfloat16" and r["kernel"] == "forward"]
    assert all(any(".BF16" in m for m in r["tensor_core_instructions"]) for r in bf16)


def test_report_rows_have_the_documented_keys(report_rows):
    keys = {"backend", "kernel", "target", "dtype", "head_dim", "causal", "config", "registers",
            "spill_bytes", "stack_bytes", "shared_bytes", "tensor_core_instructions", "philox_rounds", "fits",
            "problems"}
    for row in report_rows:
        assert set(row) == keys
        assert row["backend"] == "cuda" and row["causal"] is None
        assert row["fits"] == (not row["problems"])
    assert all(row["fits"] for row in report_rows), [r["problems"] for r in report_rows if r["problems"]]


def test_dropout_stream_is_compiled_into_every_tile_kernel(report_rows):
    """Dropout is a runtime argument: each forward and backward tile kernel holds one Philox4x32-10
    block (ten rounds) in its SASS, so the registers and spills above include it; the decode kernel,
    which never drops, holds none (its tile code is the forward's with the stream turned off)."""
    tiles = [r for r in report_rows if r["kernel"] in cuda_report.DROPOUT_KERNELS]
    assert tiles and not _offenders(tiles, lambda r: r["philox_rounds"] < cuda_report.PHILOX_ROUNDS)
    assert all(r["philox_rounds"] == 0 for r in report_rows if r["kernel"] not in cuda_report.DROPOUT_KERNELS)


@pytest.mark.slow
def test_torch_glue_compiles():
    """flash_cuda.cu (TORCH_LIBRARY_IMPL, launches) against this torch's headers, for sm_80."""
    try:
        cuda_report.find_nvcc()
    except gpu_binaries.ToolMissing as missing:
        pytest.skip(f"nvcc is not installed: {missing}")
    log = cuda_report.compile_glue("sm_80")
    assert "Compiling entry function" in log
    assert not re.search(r"[1-9]\d* bytes spill", log)


# ---- the parsers, on fixed text (no nvcc needed) ---------------------------------------------------

PTXAS_SAMPLE = """\
ptxas info    : Compiling entry function '_ZN15fused_attn_cuda20flash_forward_kernelI6__halfLi64EEEvNS_13ForwardParamsE' for 'sm_80'
ptxas info    : Function properties for _ZN15fused_attn_cuda20flash_forward_kernelI6__halfLi64EEEvNS_13ForwardParamsE
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 74 registers, used 1 barriers, 1024 bytes smem, 784 bytes cmem[0]
"""

SASS_SAMPLE = """\
	code for sm_80
		Function : _ZN15fused_attn_cuda20flash_forward_kernelI6__halfLi64EEEvNS_13ForwardParamsE
        /*0100*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0110*/               @P0 HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0120*/                   FFMA R1, R2, R3, R1 ;
        /*0130*/                   IMAD.WIDE.U32 R36, R36, -0x2daee0ad, RZ ;  /* 0xd2511f5324247825 */
        /*0140*/                   IMAD.WIDE.U32 R34, R34, -0x326172a9, RZ ;  /* 0xcd9e8d5722227825 */
"""


def test_parsers_read_ptxas_and_sass():
    usage = cuda_report.parse_ptxas(PTXAS_SAMPLE)
    name = next(iter(usage))
    assert usage[name] == {"registers": 74, "stack_bytes": 8, "spill_bytes": 16, "static_shared_bytes": 1024}
    assert cuda_report.parse_sass(SASS_SAMPLE)[name] == {"HMMA.16816.F32": 2, "philox_rounds": 1}
    assert cuda_report._parse_mangled(name) == ("forward", "__half", 64, None)
    assert cuda_report._parse_mangled("_ZN15fused_attn_cuda19flash_decode_kernelI13__nv_bfloat16Li128ELi16EEEvNS_"
                                      "12DecodeParamsE") == ("decode", "__nv_bfloat16", 128, 16)
    assert cuda_report._parse_mangled("_ZN15fused_attn_cuda27flash_decode_combine_kernelIfEEvNS_13CombineParamsE") \
        == ("decode_combine", "float", None, None)
    row = cuda_report._row("sm_80", ("forward", "__half", 64, None),
                           {"block_m": 64, "block_n": 64, "threads": 128, "dynamic_shared_bytes": 70000},
                           usage[name], {})
    assert not row["fits"] and row["shared_bytes"] == 71024
    assert any("spills" in p for p in row["problems"]) and any("tensor-core" in p for p in row["problems"])
    assert any("Philox" in p for p in row["problems"])
