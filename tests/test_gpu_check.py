"""`make gpu-check` without a GPU: its one line and exit 0, the grid it would time, and its dry run on the
CPU (report files, verdict, exit status on a correctness failure)."""

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import check, gpu_check, sweep

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def child_tests(tmp_path_factory) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Child pytest runs that take a second (a test file outside tests/, without its conftest), in place of
    the GPU tests' runs, which skip here after collecting the whole suite: {"pass": ..., "fail": ...}."""
    folder = tmp_path_factory.mktemp("child_tests")
    (folder / "test_passes.py").write_text("def test_passes():\n    assert True\n")
    (folder / "test_fails.py").write_text("def test_fails():\n    assert False\n")
    return {"pass": ((str(folder / "test_passes.py"),),), "fail": ((str(folder / "test_fails.py"),),)}


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, env=environment,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU is visible" in lines[0], completed.stdout
    assert "40 shapes" in lines[0] and "20 decode rows" in lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0(tmp_path):
    """`make gpu-check` itself, as on a fresh clone: its install step runs without echoing its commands. Here that
    step installs nothing (pip's commands are `:`) into a stamp of its own, and the check runs this interpreter."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # as a user runs it, not as a sub-make
    environment["CUDA_VISIBLE_DEVICES"] = ""
    stamp = tmp_path / "installed"
    completed = subprocess.run(["make", "gpu-check", f"PY={sys.executable}", "PIP_INSTALL=:", f"INSTALLED={stamp}"],
                               cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert stamp.exists()  # the install step ran
    lines = (completed.stdout + completed.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA GPU is visible"), lines


def test_grid_is_the_issues():
    plan = gpu_check.gpu_plan()
    shapes = gpu_check.attention_shapes(plan)
    assert len(shapes) == 2 * 2 * 2 * 5
    assert {shape.dtype for shape in shapes} == {torch.float16, torch.bfloat16}
    assert {shape.head_dim for shape in shapes} == {64, 128}
    assert {shape.causal for shape in shapes} == {False, True}
    assert sorted({shape.length for shape in shapes}) == [1024, 2048, 4096, 8192, 16384]
    assert {shape.batch * shape.length for shape in shapes} == {16384} and {shape.heads for shape in shapes} == {16}
    assert sweep.DIRECTIONS == ("fwd", "fwd+bwd")
    decode = gpu_check.decode_shapes(plan)
    assert {(shape.dtype, shape.paged, shape.length) for shape in decode} == {
        (dtype, paged, length) for dtype in (torch.float16, torch.bfloat16) for paged in (False, True)
        for length in (1024, 2048, 4096, 8192, 16384)}
    assert all(shape.length % shape.block_size == 0 for shape in decode)
    assert plan.backends == ("triton", "cuda") and plan.compile_flex and plan.flex_label == "flex"
    assert set(gpu_check.SDPA_KERNELS) == {"sdpa-flash", "sdpa-cudnn", "sdpa-efficient"}
    assert ("-m", "cuda", "tests") in plan.tests


def test_gpu_rounds_rotate_and_take_each_call_as_one_median(monkeypatch):
    """On a GPU each call of a round is one triton.testing.do_bench median; here a stand-in returns the
    run's own number."""
    calls = []
    monkeypatch.setattr(gpu_check.timing, "gpu_median_seconds", lambda run: calls.append(run()) or run())
    samples = gpu_check.gpu_interleaved_samples({"a": lambda: 1.0, "b": lambda: 2.0, "c": lambda: 4.0}, rounds=3)
    assert samples == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [4.0] * 3}
    assert calls == [1.0, 2.0, 4.0, 2.0, 4.0, 1.0, 4.0, 1.0, 2.0]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, child_tests):
    """One passing dry run (two problems of the check, to keep it short): (exit status, printed lines,
    {suffix: path})."""
    results = tmp_path_factory.mktemp("results")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(gpu_check, "GPU_TESTS", child_tests["pass"])
        patch.setattr(check, "PROBLEMS", {name: check.PROBLEMS[name] for name in ("plain", "causal")})
        status = gpu_check.main(["--dry-run", "--results", str(results)])
    return status, printed.getvalue().strip().splitlines(), {path.suffix: path for path in results.iterdir()}


def test_dry_run_writes_json_lines_markdown_and_png(dry_run):
    status, lines, paths = dry_run
    assert status == 0
    assert set(paths) == {".jsonl", ".md", ".png"} and all("dry-run" in path.name for path in paths.values())
    records = [json.loads(line) for line in paths[".jsonl"].read_text().splitlines()]
    assert all(record["dry_run"] is True and record["git_revision"] and record["torch"] for record in records)
    measured = [record for record in records if record.get("status") == "measured"]
    kinds = {(record["kind"], record["backend"]) for record in measured}
    assert {("attention", "cpu"), ("attention", "sdpa-flash"), ("attention", "flex-eager"),
            ("decode", "cpu"), ("decode", "sdpa-flash"), ("decode", "flex-eager")} <= kinds
    plan = gpu_check.dry_run_plan()
    cpu_rows = [record for record in measured if record["backend"] == "cpu"]
    assert len(cpu_rows) == 2 * len(gpu_check.attention_shapes(plan)) + len(gpu_check.decode_shapes(plan))
    assert all(record["time_ms"] > 0 and record["tflops"] > 0 and record["vs_sdpa"]["sdpa-flash"] > 0
               for record in cpu_rows)
    judged = [record for record in measured if record.get("direction") != "fwd+bwd"]
    assert judged and all(record["correct"] and record["error"] <= record["allowed_error"] for record in judged)
    # The kernels the CPU lacks are recorded as refused, not a crash; so is FlexAttention's backward.
    refused = {(record["backend"], record.get("direction")) for record in records if record.get("status") == "refused"}
    assert {("sdpa-cudnn", "fwd"), ("sdpa-efficient", "fwd+bwd"), ("flex-eager", "fwd+bwd")} <= refused
    tests, checked = (next(record for record in records if record["kind"] == kind) for kind in ("tests", "check"))
    assert tests["passed"] and "1 passed" in tests["summary"] and checked["passed"] and checked["lines"] == 4
    markdown = paths[".md"].read_text()
    assert "DRY RUN" in markdown.splitlines()[0] and "| cpu × sdpa-flash |" in markdown
    assert "## Decode" in markdown and "## Did not run" in markdown
    assert paths[".png"].stat().st_size > 1000
    assert lines[-1].startswith("gpu-check DRY RUN (on the CPU") and ": PASS — 0 correctness failures" in lines[-1]
    assert records[-1]["kind"] == "verdict" and records[-1]["line"] == lines[-1]


def test_a_failing_check_exits_non_zero(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(check, "PROBLEMS", {name: check.PROBLEMS[name] for name in ("plain", "causal")})
    original = check.check_one

    def check_one(backend, case, dtype, device):
        if case is check.PROBLEMS["causal"] and dtype == torch.bfloat16:
            return {"errors": {}, "passed": False, "reason": "AssertionError: out error beyond the bound"}
        return original(backend, case, dtype, device)
    monkeypatch.setattr(check, "check_one", check_one)
    status = gpu_check.main(["--dry-run", "--no-tests", "--lengths", "16", "--rounds", "1", "--results", str(tmp_path)])
    assert status == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert ": FAIL — 1 correctness failures" in last
    verdict = json.loads(next(tmp_path.glob("*.jsonl")).read_text().splitlines()[-1])
    assert verdict["kind"] == "verdict" and not verdict["passed"]
    assert verdict["failures"] == ["check: cpu bfloat16 causal FAIL: AssertionError: out error beyond the bound"]


def test_failing_tests_and_outputs_beyond_the_bound_are_correctness_failures(child_tests):
    plan = dataclasses.replace(gpu_check.dry_run_plan(), tests=child_tests["fail"])
    records = gpu_check.run_tests(plan, printer=lambda line: None)
    assert len(records) == 1 and not records[0]["passed"] and records[0]["returncode"] == 1
    assert "1 failed" in records[0]["summary"]
    decode = {"kind": "decode", "backend": "cpu", "dtype": "float16", "cache": "paged", "length": 64,
              "error": 0.5, "allowed_error": 0.01, "correct": False}
    forward = {"kind": "attention", "backend": "cpu", "dtype": "bfloat16", "batch": 2, "heads": 2, "length": 64,
               "head_dim": 16, "causal": True, "error": 0.25, "allowed_error": 0.02, "correct": False}
    crash = {"kind": "crash", "shape": "bfloat16 B=1 H=16 L=16384 D=128", "reason": "AcceleratorError: CUDA error"}
    failures = gpu_check.correctness_failures(plan, [*records, decode, {**decode, "correct": True}, forward, crash])
    assert failures == [f"tests `{records[0]['command']}`: {records[0]['summary']}",
                        "decode cpu float16 paged L_k=64: error 5.00e-01 > 1.00e-02",
                        "attention cpu bfloat16 B=2 H=2 L=64 D=16 causal: error 2.50e-01 > 2.00e-02",
                        "bfloat16 B=1 H=16 L=16384 D=128: AcceleratorError: CUDA error"]
    assert gpu_check.verdict(plan, [], failures, Path("r.md")).startswith(
        "gpu-check DRY RUN (on the CPU, tiny shapes, cpu backend; not GPU numbers): FAIL — 4 correctness failures")
    no_backend = gpu_check.correctness_failures(dataclasses.replace(plan, backends=()), [])
    assert no_backend == ["no fused_attn GPU backend is available: nothing of fused_attn ran"]


def stand_in_flash_attn() -> types.ModuleType:
    """flash-attn's two functions by their documented layouts, computed by SDPA: q, k, v (B, L, H, D);
    kvcache: q (B, L_q, H_q, D), a cache (B, L_max, H_kv, D) or blocks (num_blocks, block_size, H_kv, D) with an
    int32 block table (B, max_blocks)."""
    module = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, causal=False):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None):
        if block_table is not None:
            k_cache, v_cache = (cache[block_table.long()].flatten(1, 2) for cache in (k_cache, v_cache))
        length = int(cache_seqlens.max())  # every sequence has the same length in gpu_check's rows
        keys, values = (cache[:, :length].transpose(1, 2) for cache in (k_cache, v_cache))
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, enable_gqa=True).transpose(1, 2)

    module.flash_attn_func, module.flash_attn_with_kvcache = flash_attn_func, flash_attn_with_kvcache
    return module


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_flash_attn_gets_its_own_layouts(paged, monkeypatch):
    """Where `import flash_attn` works, its rows are measured; a stand-in computing flash-attn's documented
    contract by SDPA shows that gpu_check hands it tensors in its layouts (a decode output in another
    layout would fail the float64 check)."""
    sweep.flash_attn_function.cache_clear()
    gpu_check.flash_attn_kvcache_function.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in_flash_attn())
    try:
        plan = gpu_check.dry_run_plan(lengths=(16,), rounds=1)
        shape = gpu_check.decode_shapes(plan)[1 if paged else 0]
        assert shape.paged == paged
        decode = {record["backend"]: record for record in gpu_check.measure_decode(plan, shape)}
        assert decode["flash_attn"]["status"] == "measured" and decode["flash_attn"]["correct"]
        attention = gpu_check.measure_attention(plan, gpu_check.attention_shapes(plan)[1])
        assert {(record["backend"], record["direction"], record["status"]) for record in attention
                if record["backend"] == "flash_attn"} == {("flash_attn", "fwd", "measured"),
                                                          ("flash_attn", "fwd+bwd", "measured")}
    finally:
        sweep.flash_attn_function.cache_clear()
        gpu_check.flash_attn_kvcache_function.cache_clear()


def test_triton_tuning_names_what_each_autotuner_kept(monkeypatch):
    """triton_tuning against autotuners holding what Triton's do after tuning: the config kept per key, its variant,
    and the candidates' times of the last tuning, given only where that tuning is the one new key."""
    triton = pytest.importorskip("triton")
    from fused_attn.backends import triton_tuning

    monkeypatch.setattr(triton_tuning, "_tuners", {})
    pointers = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "DESCRIPTORS": False, "WARP_SPECIALIZE": False},
                             num_warps=4, num_stages=3)
    described = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "DESCRIPTORS": True, "WARP_SPECIALIZE": False},
                              num_warps=4, num_stages=3)
    specialized = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "DESCRIPTORS": True, "WARP_SPECIALIZE": True},
                                num_warps=4, num_stages=3)
    forward = types.SimpleNamespace(keys=["L_Q", "L_K"], cache={}, configs_timings={})
    decode = types.SimpleNamespace(keys=["L_K"], cache={(4096, "torch.float16"): pointers})
    triton_tuning.registered("fwd+descriptors", forward)
    triton_tuning.registered("decode+descriptors", decode)
    before = triton_tuning.snapshot()
    assert before["choices"] == {("decode+descriptors", (4096, "torch.float16")):
                                 "BLOCK_M=128,BLOCK_N=64,warps=4,stages=3"}
    forward.cache[(2048, 2048, "torch.float16")] = described
    # A tuning of one candidate (nothing timed) keeps the last tuning's times: they are not this key's.
    assert "chosen_ms" not in triton_tuning.new_tunings(before)[0]
    failed = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "DESCRIPTORS": False, "WARP_SPECIALIZE": False},
                           num_warps=4, num_stages=3)  # out of resources: Triton times it as infinite
    forward.configs_timings = {pointers: [0.50, 0.49, 0.52], described: [0.40, 0.39, 0.41], specialized: 0.45,
                               failed: [float("inf")] * 3}
    [tuning] = triton_tuning.new_tunings(before)
    assert tuning["candidates_ms"]["BLOCK_M=128,BLOCK_N=128,warps=4,stages=3"] is None
    json.dumps(tuning, allow_nan=False)
    assert tuning["autotuner"] == "fwd+descriptors" and tuning["variant"] == "descriptors"
    assert tuning["key"] == {"L_Q": "2048", "L_K": "2048", "dtype0": "torch.float16"}
    assert tuning["chosen"] == "BLOCK_M=128,BLOCK_N=64,warps=4,stages=3,descriptors"
    assert tuning["chosen_ms"] == 0.40 and tuning["fastest_pointers_ms"] == 0.50
    assert tuning["candidates_ms"]["BLOCK_M=128,BLOCK_N=64,warps=4,stages=3,descriptors,warp_specialized"] == 0.45
    # Two keys tuned since: the last tuning's times belong to one of them only, so neither gets them.
    forward.cache[(4096, 4096, "torch.float16")] = specialized
    tunings = triton_tuning.new_tunings(before)
    assert [t["variant"] for t in tunings] == ["descriptors", "warp_specialized"]
    assert not any("chosen_ms" in t for t in tunings)


def test_the_backend_registers_its_autotuners():
    """The triton backend's autotuners are triton_tuning's, under their kernels' names, with the attributes it
    reads."""
    pytest.importorskip("triton")
    from fused_attn.backends import triton_decode, triton_tuning
    from fused_attn.backends import triton_kernels as tk

    forward, decode = tk._autotuned("fwd", True), triton_decode._autotuned_decode(False)
    assert triton_tuning._tuners["fwd+descriptors"] is forward and triton_tuning._tuners["decode+descriptors"] is decode
    assert list(forward.keys) == tk.autotune_key("fwd") and isinstance(forward.cache, dict)


def test_autotuner_choices_reach_the_records_and_the_report(monkeypatch, tmp_path):
    """What the autotuners kept during a row's first calls becomes records of kind "autotune" with the row's fields,
    a section of the Markdown, and no correctness failure."""
    from fused_attn.backends import triton_tuning

    plan = gpu_check.dry_run_plan()
    tuning = {"autotuner": "decode+descriptors", "key": {"L_K": "64"}, "chosen": "warps=4,stages=2,descriptors",
              "variant": "descriptors", "chosen_ms": 0.012, "fastest_pointers_ms": 0.015}
    monkeypatch.setattr(triton_tuning, "new_tunings", lambda before: [tuning])
    records = gpu_check.measure_decode(plan, gpu_check.decode_shapes(plan)[0])
    [tuned] = [record for record in records if record["kind"] == "autotune"]
    assert tuned["row"] == "decode" and tuned["length"] == plan.decode_lengths[0] and tuned["chosen_ms"] == 0.012
    assert gpu_check.correctness_failures(plan, records) == []
    lines = gpu_check.autotune_lines(records)
    assert lines[2].startswith("1 tunings: descriptors kept in 1.")
    assert any(line.startswith(f"| {gpu_check.row_label(tuned)} | decode+descriptors | warps=4,stages=2,descriptors "
                               "| 0.012 | 0.015 |") for line in lines)
    meta = gpu_check.provenance(plan)
    gpu_check.write_markdown(tmp_path / "r.md", plan, meta, records, "verdict")
    assert "## Triton autotuner choices" in (tmp_path / "r.md").read_text()
