"""The benchmark machinery on a tiny problem: rows, ratios, memory, CSV and plot are produced; and
what `python -m bench` does on a GPU machine with its arguments, rows and failures."""

import csv
import itertools
import os
import sys
import types

import pytest
import torch

from bench import __main__ as bench_main
from bench import check, report, sweep, timing


def test_sweep_rows_csv_and_plot(tmp_path):
    shape = sweep.Shape(batch=1, heads=2, length=64, head_dim=16, causal=True, dtype=torch.float32)
    rows = sweep.measure_shape(shape, torch.device("cpu"), rounds=2)
    names = {row["backend"] for row in rows}
    assert {"sdpa", "reference"} <= names
    for row in rows:
        assert row["time_ms"] > 0 and row["tflops"] > 0 and row["peak_mib"] >= 0
        assert row["speed_vs_sdpa"] > 0
    sdpa_fwd = next(r for r in rows if r["backend"] == "sdpa" and r["direction"] == "fwd")
    assert sdpa_fwd["speed_vs_sdpa"] == 1.0
    # The reference materialises the 64x64 scores of 2 heads at least once: 32 KiB.
    reference_fwd = next(r for r in rows if r["backend"] == "reference" and r["direction"] == "fwd")
    assert reference_fwd["peak_mib"] * 2 ** 20 >= 2 * 64 * 64 * 4
    meta = report.provenance(torch.device("cpu"))
    report.write_csv(rows, meta, tmp_path / "r.csv")
    report.write_plot(rows, meta, tmp_path / "r.png")
    with open(tmp_path / "r.csv") as handle:
        written = list(csv.DictReader(handle))
    assert len(written) == len(rows) and written[0]["git_revision"] and written[0]["device_model"]
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "x sdpa" in report.format_table(rows)


def test_check_prints_one_passing_line_per_problem():
    lines = []
    passed = check.run_check(torch.device("cpu"), (torch.float32,), backends=["reference"], printer=lines.append)
    assert passed, "\n".join(lines)
    assert len(lines) == 1 + len(check.PROBLEMS) and all(line.endswith("pass") for line in lines[1:])


def test_flop_count():
    shape = sweep.Shape(batch=2, heads=3, length=10, head_dim=8, causal=False, dtype=torch.float16)
    assert shape.flops("fwd") == 4 * 2 * 3 * 10 * 10 * 8
    causal = sweep.Shape(batch=2, heads=3, length=10, head_dim=8, causal=True, dtype=torch.float16)
    assert causal.flops("fwd+bwd") == 3.5 * shape.flops("fwd") / 2


def test_interleaved_rounds_rotate_the_order():
    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = timing.interleaved_samples(candidates, rounds=3, warmup=0)
    assert calls == list("abc" "bca" "cab")
    assert {name: len(times) for name, times in samples.items()} == {"a": 3, "b": 3, "c": 3}


# ---- `python -m bench` on a GPU machine, tested without one -----------------------------------------
# The GPU paths run on CUDA runners only; what they do with their rows, arguments and failures is
# tested here on recorded shapes. No timing below is measured or claimed: the numbers of gpu_like_rows() are
# placeholders that only feed the table, CSV and plot writers.


def gpu_like_rows() -> list[dict]:
    """Rows shaped as a GPU run writes them: every SDPA kernel, triton, cuda, flash_attn, the reference
    only where it fits (so speed_vs_reference is None elsewhere) and sdpa-cudnn missing where it refused
    the backward. Placeholder numbers (see above)."""
    rows = []
    for direction, length, causal in itertools.product(sweep.DIRECTIONS, (512, 2048), (False, True)):
        names = ["sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flash_attn", "triton", "cuda"]
        if length == 512:
            names.append("reference")
        if direction == "fwd+bwd" and length == 2048:
            names.remove("sdpa-cudnn")
        for placeholder, name in enumerate(names, start=1):
            rows.append({"backend": name, "direction": direction, "dtype": "bfloat16",
                         "batch": 16384 // length, "heads": 16, "length": length, "head_dim": 128,
                         "causal": causal, "time_ms": float(placeholder), "tflops": 10.0 * placeholder,
                         "speed_vs_sdpa": 1.0 / placeholder,
                         "speed_vs_reference": 2.0 if length == 512 else None, "peak_mib": 64.0 * placeholder})
    return rows


@pytest.fixture
def gpu_meta(monkeypatch):
    """Provenance as on a GPU runner: the GPU's name comes from torch.cuda.get_device_name."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    return report.provenance(torch.device("cuda"))


def test_parse_args_resolves_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = bench_main.parse_args([])
    assert args.device == "cpu" and not args.full and not args.no_check and args.rounds is None
    assert bench_main.parse_args(["--full", "--rounds", "3", "--device", "cpu"]).rounds == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench_main.parse_args([]).device == "cuda"
    assert bench_main.parse_args(["--device", "cpu"]).device == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "--device cuda: no CUDA device is available"),
    (["--rounds", "0"], "expected a positive integer, got 0"),
    (["--device", "tpu"], "invalid choice"),
    (["--quick", "--full"], "not allowed with argument"),
])
def test_bad_arguments_are_usage_errors_not_tracebacks(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        bench_main.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_table_of_gpu_rows():
    rows = gpu_like_rows()
    lines = report.format_table(rows).splitlines()
    assert len(lines) == 1 + len(rows) and len({len(line) for line in lines}) == 1  # aligned columns
    cudnn_bwd = next(line for line, row in zip(lines[1:], rows) if row["backend"] == "sdpa-cudnn"
                     and row["direction"] == "fwd+bwd")
    assert cudnn_bwd.split()[:4] == ["sdpa-cudnn", "fwd+bwd", "bfloat16", "32"]
    without_reference = next(line for line, row in zip(lines[1:], rows) if row["length"] == 2048)
    assert without_reference.split()[-2] == "-"  # speed_vs_reference None
    assert {line.split()[0] for line in lines[1:]} == {row["backend"] for row in rows}


def test_csv_of_gpu_rows_has_one_header_and_the_gpu_on_every_row(tmp_path, gpu_meta):
    rows = gpu_like_rows()
    report.write_csv(rows, gpu_meta, tmp_path / "gpu.csv")
    with open(tmp_path / "gpu.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        written = list(reader)
    assert reader.fieldnames == [*gpu_meta, *report.COLUMNS]
    assert len(written) == len(rows)
    for row in written:
        assert None not in row and all(row[name] is not None for name in reader.fieldnames)
        assert row["device"] == "cuda" and row["device_model"] == "NVIDIA H100 80GB HBM3"
        for name in ("torch", "triton", "flash_attn", "fused_attn", "git_revision", "timestamp"):
            assert row[name], name
    assert {row["speed_vs_reference"] for row in written if row["length"] == "2048"} == {""}
    assert {row["backend"] for row in written} >= {"sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flash_attn"}


def test_plot_of_gpu_rows_without_a_display(tmp_path, gpu_meta, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    report.write_plot(gpu_like_rows(), gpu_meta, tmp_path / "plots" / "gpu.png")
    png = (tmp_path / "plots" / "gpu.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.fixture
def flash_attn_module(monkeypatch):
    """Sets sys.modules["flash_attn"] for one test; the sweep tries the import again afterwards."""
    sweep.flash_attn_function.cache_clear()
    yield lambda module: monkeypatch.setitem(sys.modules, "flash_attn", module)
    sweep.flash_attn_function.cache_clear()


def gpu_implementations() -> dict:
    shape = sweep.Shape(batch=1, heads=2, length=8, head_dim=4, causal=False, dtype=torch.float16)
    return sweep.implementations(torch.device("cuda"), shape)


def test_gpu_implementations_compare_every_sdpa_kernel_and_flash_attn_in_its_layout(flash_attn_module):
    seen = []

    def flash_attn_func(q, k, v, causal):
        seen.append((tuple(q.shape), causal))
        return q * 2

    flash_attn_module(types.SimpleNamespace(flash_attn_func=flash_attn_func))
    impls = gpu_implementations()
    assert {"sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flash_attn", "reference"} <= set(impls)
    assert "cpu" not in impls  # backends for another device are not measured
    batch, heads, length, dim = 1, 2, 8, 4
    q = torch.randn(batch, heads, length, dim)
    out = impls["flash_attn"](q, q, q, True)
    assert seen == [((batch, length, heads, dim), True)]  # flash_attn takes (B, L, H, D) ...
    assert torch.equal(out, q * 2)  # ... and its output comes back as (B, H, L, D)


class _BrokenInstall(types.ModuleType):
    def __getattr__(self, name):
        raise OSError("libcudart.so.12: cannot open shared object file")  # a wheel built for another CUDA


@pytest.mark.parametrize("module, says", [(None, False), (types.ModuleType("flash_attn"), True),
                                          (_BrokenInstall("flash_attn"), True)],
                         ids=["not installed", "ImportError", "OSError"])
def test_flash_attn_missing_or_broken_is_left_out(flash_attn_module, capsys, module, says):
    flash_attn_module(module)
    assert "flash_attn" not in gpu_implementations()
    assert "flash_attn" not in gpu_implementations()  # tried once
    err = capsys.readouterr().err
    assert err.count("flash_attn left out") == (1 if says else 0)


class _CompilerError(Exception):
    """Like Triton's CompilationError and OutOfResources: an Exception, not a RuntimeError."""


@pytest.mark.parametrize("error", [RuntimeError("No available kernel. Aborting execution."),
                                   ValueError("backend: 'triton' cannot run this call"),
                                   _CompilerError("out of resource: shared memory")],
                         ids=lambda error: type(error).__name__)
def test_supported_leaves_out_whatever_raises(capsys, error):
    def refuses():
        raise error

    assert sweep.supported("sdpa-cudnn fwd at bfloat16 L=512", refuses) is False
    expected = f"sdpa-cudnn fwd at bfloat16 L=512 left out: {type(error).__name__}: {error}"
    assert expected in capsys.readouterr().err
    assert sweep.supported("sdpa", lambda: None) is True


def test_measure_shape_leaves_out_an_implementation_per_direction(monkeypatch, capsys):
    """One implementation refuses everything, another only the backward: the others are measured."""
    measured = sweep.implementations

    def with_refusals(device, shape):
        impls = measured(device, shape)

        def forward_only(q, k, v, c):
            if torch.is_grad_enabled():
                raise RuntimeError("no backward for this input")
            return impls["sdpa"](q, k, v, c)

        def refuses(q, k, v, c):
            raise ValueError("refused")

        return {"sdpa": impls["sdpa"], "forward_only": forward_only, "refuses": refuses}

    monkeypatch.setattr(sweep, "implementations", with_refusals)
    shape = sweep.Shape(batch=1, heads=1, length=16, head_dim=8, causal=False, dtype=torch.float32)
    rows = sweep.measure_shape(shape, torch.device("cpu"), rounds=1)
    assert sorted((row["backend"], row["direction"]) for row in rows) == [
        ("forward_only", "fwd"), ("sdpa", "fwd"), ("sdpa", "fwd+bwd")]
    assert all(row["speed_vs_reference"] is None for row in rows)
    err = capsys.readouterr().err
    assert "forward_only fwd+bwd at float32 B=1 H=1 L=16 D=8 left out: RuntimeError" in err
    assert err.count("refuses") == 2


def test_check_reports_any_failure_as_a_failing_line(monkeypatch):
    def compiler_fails(inputs, backend):
        raise _CompilerError("out of resource: shared memory, required: 300000")

    monkeypatch.setattr(check.testing, "run_attention", compiler_fails)
    lines = []
    assert not check.run_check(torch.device("cpu"), (torch.float32,), backends=["reference"],
                               printer=lines.append)
    assert all("FAIL: _CompilerError: out of resource" in line for line in lines[1:])


def test_decode_bench_rows_on_a_small_shape():
    from bench import decode_bench

    row = decode_bench.time_row(torch.float32, (1, 4, 2, 1, 64, 16), rounds=3, budget_s=1.0)
    assert row["rounds"] == 3 and row["cpu_us"] > 0 and row["vs_sdpa"] > 0 and row["over_copy"] > 0
    assert "FUSED_ATTN_CPU_DECODE" not in os.environ
    for dtype, appended in itertools.product((torch.float32, torch.bfloat16), (1, 20)):  # bf16: weights rounded per
        # key block (AMX); 20 tokens: a prefill's chunk, causal, through the long-query kernels across cache blocks
        row = decode_bench.kvcache_row(dtype, 3, 1.0, heads_q=4, heads_kv=2, capacity=64, length=40, dim=16,
                                       block_size=8, appended=appended)
        assert row["rounds"] == 3 and row["vs_sdpa"] > 0 and row["paged_vs_dense"] > 0 and row["gathered_vs_paged"] > 0
    for cache_dtype in (torch.int8, torch.float8_e4m3fn):  # checked against the reference before it is timed
        for per_token in (False, True):
            row = decode_bench.quantized_row(cache_dtype, per_token, (1, 4, 2, 1, 64, 16), rounds=3, budget_s=1.0)
            assert row["rounds"] == 3 and all(value > 0 for key, value in row.items() if isinstance(value, float))
    row = decode_bench.depth_row((1, 4, 2, 1, 64, 16), layers=3, rounds=3, budget_s=1.0)
    assert row["rounds"] == 3 and all(value > 0 for value in row.values())


def test_decode_bench_depth_covers_twice_the_last_level_cache():
    from bench import decode_bench

    assert decode_bench.last_level_cache_bytes() >= 0
    assert decode_bench.layers_past_cache(16 << 20, 32 << 20) == 4
    assert decode_bench.layers_past_cache(17 << 20, 32 << 20) == 4  # rounded up: 3 would hold less than twice
    assert decode_bench.layers_past_cache(134 << 20, 32 << 20) == 2  # one layer past the cache still gets a second
    assert decode_bench.layers_past_cache(16 << 20, 0) == 2


def test_call_cost_rows_on_a_small_shape(capsys):
    from bench import call_cost

    threads = torch.get_num_threads()
    row = call_cost.time_row(torch.float32, (1, 2, 4, 8, 8), "cpu 1t", rounds=3, inner=2, budget_s=1.0)
    assert row["rounds"] == 3 and row["fused_us"] > 0 and row["sdpa_us"] > 0 and row["vs_sdpa"] > 0
    assert torch.get_num_threads() == threads  # restored after the one-thread measure
    assert call_cost.main(["--dtypes", "bf16", "--shapes", "tiny", "--rounds", "2", "--inner", "1"]) == 0
    table = capsys.readouterr().out
    assert report.device_model(torch.device("cpu")) in table.splitlines()[0]
    rows = [line for line in table.splitlines() if line.startswith("| bf16")]
    assert [row.split("|")[4].strip() for row in rows] == list(call_cost.MEASURES)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bench_compares_the_same_attention(causal):
    from bench import varlen_bench

    lengths = [5, 17, 9]
    runs = varlen_bench.candidates(torch.float32, lengths, causal, backward=False)
    packed, padded, sdpa = runs["varlen"](), runs["padded"](), runs["sdpa_padded"]()
    for b, chunk in enumerate(packed.split(lengths)):
        torch.testing.assert_close(padded[b, :, :lengths[b]], chunk.transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sdpa[b, :, :lengths[b]], chunk.transpose(0, 1), rtol=1e-5, atol=1e-5)
    for name, run in varlen_bench.candidates(torch.float32, lengths, causal, backward=True).items():
        assert len(run()) == 3, name
    assert varlen_bench.work_ratio([4, 4], causal) == 1.0
    assert varlen_bench.work_ratio([2, 4], False) == (4 * 2 + 4 * 4) / (2 * 2 + 4 * 4)


def test_models_bench_on_a_short_prompt(capsys):
    pytest.importorskip("transformers")
    from bench import models

    assert models.main(["--length", "24", "--new-tokens", "2", "--rounds", "2", "--dtypes", "fp32"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| fp32")]
    assert [row.split("|")[2:4] for row in rows] == [
        [f" {phase} ", f" {name} "] for phase in ("prefill", "decode")
        for name in ("sdpa", "fused_attn", "eager", "sdpa_redirect", "sdpa_plugin")]
    assert all(row.rstrip().endswith("| yes |") for row in rows)
    assert "sdpa_redirect time / sdpa_plugin time" in table


def test_models_bench_runs_gpt_oss_against_eager(capsys):
    pytest.importorskip("transformers")
    from bench import models

    assert models.main(["--model", "gpt-oss", "--length", "24", "--new-tokens", "2", "--rounds", "2",
                        "--dtypes", "fp32"]) == 0
    table = capsys.readouterr().out
    assert "| eager time / this |" in table
    rows = [line for line in table.splitlines() if line.startswith("| fp32")]
    assert [row.split("|")[2:4] for row in rows] == [
        [f" {phase} ", f" {name} "] for phase in ("prefill", "decode") for name in ("eager", "fused_attn")]
    assert all(row.rstrip().endswith("| yes |") for row in rows)


def test_mask_bench_on_a_small_shape(capsys):
    """bench.mask_bench's rows at L=256 (FlexAttention left out: compiling it takes minutes)."""
    from bench import mask_bench

    times, ratios, rounds = mask_bench.measure("prefix_lm", torch.float32, 256, True, rounds=2, budget_s=1.0)
    assert set(times) == {"prefix_lm", "causal"} and rounds == 2 and ratios[0][1] > 0
    candidates, ratios, _ = mask_bench.documents_candidates(256, backward=True)
    assert set(candidates) == {"program", "dense_mask", "sdpa_mask"}
    rows = mask_bench.build_rows(256, rounds=1)
    assert any(row.startswith("| documents(ids) & causal()") for row in rows) and "program memory" in rows[-1]


def test_tile_search_reports_each_failed_config_by_its_first_failing_row():
    """bench.tile_search's order, with a compiler that fails one row at the 64-row tiles (the search against
    Triton's own is in tests/test_triton_compile.py)."""
    pytest.importorskip("triton")
    from bench import tile_search

    compiled = []

    def compile_row(*row, config):
        compiled.append((config.block_m, row[-1]))
        bad = config.block_m == 64 and row[-1] == "b"
        return dict(problems=["spills"] if bad else [], stack_bytes=0, spill_bytes=0)

    rows = [("fwd", "sm_90", "float16", 64, True, False, False, scores) for scores in "abc"]
    found, failed = tile_search.search([(64, 32, 4, 2), (32, 32, 4, 2)], rows, compile_row)
    assert found == (32, 32, 4, 2) and [config for config, _ in failed] == [(64, 32, 4, 2)]
    assert compiled == [(64, "a"), (64, "b"), (32, "a"), (32, "b"), (32, "c")]  # stops at a config's first failure
