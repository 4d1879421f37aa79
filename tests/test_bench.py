"""The benchmark machinery on a tiny problem: rows, ratios, memory, CSV and plot are produced."""

import csv

import torch

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
    assert check.run_check(torch.device("cpu"), (torch.float32,), backends=["reference"], printer=lines.append)
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
