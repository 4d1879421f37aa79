"""Static GPU check of the `triton` backend, without a GPU.

Every kernel is compiled at its default configs for sm_80, sm_90 and sm_100 by Triton's own compiler (fp16 and
bf16, head dims 64 and 128; on sm_90 and sm_100 also fp32 at 128 and bf16 at 256;
causal and not, causal with dropout, causal with every score variant
(attention sinks included), dK/dV also with a learned bias's gradient, packed batches, mask programs
without and with dropout, the forward and split-KV decode kernels over paged caches of the query's dtype, int8
and float8_e4m3fn (scales per token; float8_e4m3fn also per sequence), the decode combine with sinks; see
bench/triton_report.py), and its cubin is read back with cuobjdump: it compiles, nothing spills (no local
loads/stores in the SASS, no stack), the matrix products run on tensor cores (HMMA on sm_80, HGMMA on
sm_90, UTCHMMA — tcgen05.mma — on sm_100; HMMA for tiles of fewer rows than a warpgroup's 64, the decode
kernel's 16 and some of the D = 256 backward's; fp32's on FMA units, in full precision), and
shared memory fits
the device (163 KB on sm_80, 227 KB on sm_90 and sm_100). The tensor-descriptor variants, the forward's, dK/dV's,
dQ's and the decode kernel's, plain and warp-specialized, are compiled for sm_90 and sm_100
too, where a launch offers them (not in fp32; warp-specialized up to head dim 128), and their SASS must hold TMA
loads (UTMALDG) and stores (UTMASTG), which no pointer kernel has. The rows are the
triton rows of `python -m bench.inspect --json`, run once per test session (the `static_gpu_report` fixture of
conftest.py; 880 Triton compilations, 177 under `make test`, which compiles each kernel, variant and target at one of
its shapes: FUSED_ATTN_STATIC_REPORT in bench/triton_report.py; beside the CUDA report that tests/test_cuda_compile.py
reads).
"""

from __future__ import annotations

import dataclasses

import pytest

triton = pytest.importorskip("triton")

from bench import gpu_binaries, triton_report  # noqa: E402

try:
    gpu_binaries.find_cuobjdump()
    pytestmark = []
except gpu_binaries.ToolMissing as missing:
    pytestmark = pytest.mark.skip(reason=str(missing))

COMBINATIONS = list(triton_report.combinations())
KEYS = {"backend", "kernel", "target", "cubin_arch", "dtype", "head_dim", "causal", "dropout", "bias_grad", "scores",
        "config", "tma_instructions", "global_scratch_bytes", "warp_specialized", "launch_warps",
        "registers",
        "spill_bytes", "stack_bytes", "shared_bytes", "tensor_core_instructions", "fits", "problems"}


# What Triton builds for each target, as a device of that capability would: from 9.0 on the architecture-specific
# variant, without which wgmma (HGMMA) and tcgen05.mma (UTCHMMA) do not exist.
BUILT_FOR = {"sm_80": "sm_80", "sm_90": "sm_90a", "sm_100": "sm_100a"}


@pytest.fixture(scope="module")
def rows(static_gpu_report):
    if "triton" in static_gpu_report.missing:
        pytest.fail(f"bench.inspect could not compile the Triton kernels:\n{static_gpu_report.stderr[-4000:]}")
    found = {}
    for row in static_gpu_report.of("triton"):
        found[tuple(row[key] for key in ("kernel", "target", "dtype", "head_dim", "causal", "dropout",
                                         "bias_grad", "scores"))] = row
    return found


def test_report_compiles_what_launches_take():
    """The rows are the launches the backend makes: no descriptor variant in fp32, no warp-specialized one above head
    dim 128, no decode kernel above triton_decode.MAX_HEAD_DIM; fp32 at 128 and bf16 at 256 on the targets with TMA
    from Triton 3.7 on (WIDER_FROM), and on no other."""
    from fused_attn.backends import triton_compat, triton_decode

    shapes = {(target, dtype, head_dim) for _, target, dtype, head_dim, *_ in COMBINATIONS}
    wider = {(target, dtype, head_dim) for target in ("sm_90", "sm_100")
             for dtype, head_dim in (("float32", 128), ("bfloat16", 256))}
    assert shapes & wider == (set() if triton_compat.older_than(triton_report.WIDER_FROM) else wider)
    assert not any(target == "sm_80" and dtype == "float32" for target, dtype, _ in shapes)
    for kernel, target, dtype, head_dim, *_ in COMBINATIONS:
        if kernel in triton_report.DESCRIPTOR_VARIANTS:
            assert dtype != "float32" and target != "sm_80", (kernel, target, dtype)
        if kernel in triton_report.WARP_SPECIALIZED_VARIANTS:
            assert head_dim <= 128, (kernel, head_dim)
        if kernel.startswith("decode"):
            assert head_dim <= triton_decode.MAX_HEAD_DIM, (kernel, head_dim)


def test_sample_is_every_kernel_variant_and_target_once_and_meets_every_shape(monkeypatch):
    full = list(triton_report.combinations(sample=False))
    sample = list(triton_report.combinations(sample=True))
    without_shape = lambda row: (*row[:2], *row[4:])  # noqa: E731
    assert set(sample) <= set(full)
    assert sorted(map(without_shape, sample), key=str) == sorted(set(map(without_shape, full)), key=str)
    assert {row[1:4] for row in sample} == {row[1:4] for row in full}  # each target's shapes
    assert len(sample) < len(full) / 4
    for value, expected in (("sample", sample), ("full", full), (None, full)):
        if value is None:
            monkeypatch.delenv(triton_report.SAMPLE_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(triton_report.SAMPLE_VARIABLE, value)
        assert list(triton_report.combinations()) == expected
    monkeypatch.setenv(triton_report.SAMPLE_VARIABLE, "some")
    with pytest.raises(ValueError, match="FUSED_ATTN_STATIC_REPORT: expected full or sample"):
        list(triton_report.combinations())


def test_report_covers_every_kernel_and_config(rows):
    assert sorted(rows, key=str) == sorted(COMBINATIONS, key=str)
    for row in rows.values():
        assert KEYS <= set(row), KEYS - set(row)
        assert row["backend"] == "triton"


@pytest.mark.parametrize("combination", COMBINATIONS, ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_default_config_compiles_within_the_device(rows, combination):
    kernel, target = combination[:2]
    row = rows[combination]
    assert row["problems"] == [] and row["fits"], row["problems"]
    assert row["cubin_arch"] == BUILT_FOR[target]  # read from the cubin's SASS
    assert row["registers"] > 0  # a real function was read from the cubin
    assert row["spill_bytes"] == 0 and row["stack_bytes"] == 0
    assert 0 < row["shared_bytes"] <= gpu_binaries.SHARED_MEMORY_LIMIT[target]
    mnemonics = {name.split(".")[0] for name in row["tensor_core_instructions"]}
    if kernel in triton_report.MATMUL_KERNELS and row["dtype"] != "float32":
        assert triton_report.tensor_core_prefix(kernel, target, row["config"]) in mnemonics, \
            row["tensor_core_instructions"]
    else:  # the preprocess is a reduction, no products; fp32's run in full precision on FMA units
        assert not mnemonics, row["tensor_core_instructions"]
    if kernel in triton_report.DESCRIPTOR_VARIANTS:  # loads and stores through TMA; the pointer kernels have none
        assert row["tma_instructions"].get("UTMALDG", 0) > 0, row["tma_instructions"]
        assert row["tma_instructions"].get("UTMASTG", 0) > 0, row["tma_instructions"]
    else:
        assert not row["tma_instructions"], row["tma_instructions"]


def test_inspection_flags_spills_and_missing_tensor_cores(tmp_path, monkeypatch):
    """The verdict is derived from the SASS and resource usage, so it can fail: feed it a cubin
    description with local memory traffic and no HMMA."""
    usage = " Function k:\n  REG:40 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:400\n"
    sass = ("\tcode for sm_90a\n"
            "        /*0000*/                   LDL.64 R2, [R1] ;\n"
            "        /*0010*/                   FFMA R3, R2, R2, R3 ;\n"
            "        /*0020*/                   STL [R1], R3 ;\n")

    class Done:
        def __init__(self, stdout):
            self.stdout = stdout

    def fake_run(command, **kwargs):
        return Done(usage if "--dump-resource-usage" in command else sass)

    monkeypatch.setattr(triton_report.subprocess, "run", fake_run)
    row = triton_report._inspect(tmp_path / "k.cubin", {"shared": 200 * 1024}, "sm_80", True)
    assert row["spill_bytes"] == 8 and row["stack_bytes"] == 16 and row["registers"] == 40
    assert row["cubin_arch"] == "sm_90a"
    text = " | ".join(row["problems"])
    assert "register spills: 2 local loads/stores" in text
    assert "stack frame of 16 bytes" in text
    assert "no HMMA instructions" in text
    assert "shared memory" in text
    assert "the cubin is built for sm_90a, not sm_80" in text


def test_shared_memory_estimate_bounds_the_compiled_kernels(rows):
    """The autotuner prunes candidates by `shared_memory_estimate`; it must not undercount. The decode kernel's
    fixed config counts as the forward's (`triton_decode.shared_memory_config`)."""
    from fused_attn.backends import triton_decode
    from fused_attn.backends import triton_kernels as tk

    for (kernel, target, dtype, head_dim, causal, dropout, bias_grad, scores), row in rows.items():
        base, element_size = triton_report.base_kernel(kernel), 4 if dtype == "float32" else 2
        if kernel not in triton_report.MATMUL_KERNELS:
            continue
        # The launch's own constexprs: the tiles can depend on any feature (sm_100's on the score variants too).
        _, _, features, _, _ = triton_report._representative_call(kernel, dtype, head_dim, causal, dropout, bias_grad,
                                                                  scores, target)
        if base == "decode":  # its fixed config, whose text names no variant
            base, config = "fwd", triton_decode.shared_memory_config(features)
            assert str(dataclasses.replace(config, descriptors=False, warp_specialize=False)) == row["config"]
        else:
            config = tk.default_config(base, triton_report.config_arch(target), head_dim, element_size, features)
            if kernel in triton_report.DESCRIPTOR_VARIANTS:
                config = dataclasses.replace(config, **triton_report.DESCRIPTOR_VARIANTS[kernel][1])
            assert str(config) == row["config"]
        estimate = tk.shared_memory_estimate(base, config, head_dim, head_dim, element_size, dropout)
        assert row["shared_bytes"] <= estimate, (kernel, target, dtype, head_dim, causal, dropout, bias_grad,
                                                 scores)


def test_warp_specialized_variants_split_their_loops_on_blackwell(rows):
    """Read from the TTGIR, not assumed: on sm_100 every warp-specialized variant's loop is split into partitions
    (`ttg.warp_specialize`), whose warps the launch adds to its own."""
    specialized = [(c, row) for c, row in rows.items() if c[0] in triton_report.WARP_SPECIALIZED_VARIANTS]
    if not specialized:
        pytest.skip("this Triton offers no warp-specialized variant (triton_compat.warp_specialization)")
    assert {c[0] for c, _ in specialized} == set(triton_report.WARP_SPECIALIZED_VARIANTS)
    for combination, row in specialized:
        if combination[1] == "sm_100":
            warps = int(row["config"].split("warps=")[1].split(",")[0])
            assert row["warp_specialized"] and row["launch_warps"] > warps, (combination, row["launch_warps"])


def test_tile_search_keeps_the_first_config_every_row_compiles_cleanly():
    """bench.tile_search against Triton's compiler: fp32's forward with a program at D = 128 on sm_100 used local
    memory at the table's tiles (16 bytes of stack) and not at the ones `_FLOAT32_DEFAULTS` holds."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiles for the GPU, as the report
    done = subprocess.run([sys.executable, "-m", "bench.tile_search", "--targets", "sm_100", "--dtype", "float32",
                           "--head-dim", "128", "--kernel", "fwd", "--scores", triton_report.PROGRAM, "--configs",
                           "32,16,4,2", "32,32,8,1", "16,16,4,1"], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    *failed, verdict = done.stdout.splitlines()
    assert verdict == "found: 32,32,8,1"
    [row] = [json.loads(line) for line in failed]  # the failed config, by its first failing row
    assert row["config"] == [32, 16, 4, 2] and row["stack_bytes"] > 0 and row["scores"] == triton_report.PROGRAM

