"""`python -m bench.inspect --json`, the static GPU report, run as a test: one row for every kernel
of both backends on every target, and the command's verdict (exit code 0: everything compiled and
fits). The per-kernel judgements are in tests/test_triton_compile.py and tests/test_cuda_compile.py."""

from __future__ import annotations


import pytest

from bench import cuda_report, gpu_binaries, inspect, triton_report


def _expected_backends() -> list[str]:
    """The backends whose tools are installed here: Triton and cuobjdump; nvcc and cuobjdump."""
    expected = []
    try:
        gpu_binaries.find_cuobjdump()
        expected.append("triton")
    except gpu_binaries.ToolMissing:
        pass
    try:
        gpu_binaries.find_cuobjdump(cuda_report.find_nvcc())
        expected.append("cuda")
    except gpu_binaries.ToolMissing:
        pass
    return expected


# (kernel, target) of every row each backend's report has.
BUILDS = {
    "triton": {(k, t) for t in triton_report.TARGETS for k in triton_report.kernels(t)},
    "cuda": {(k, t) for k in cuda_report.KERNELS for t in cuda_report.TARGETS},
}


def test_json_has_a_report_for_every_kernel_and_target(static_gpu_report):
    expected = _expected_backends()
    if not expected:
        pytest.skip("neither Triton's cuobjdump nor nvcc is installed")
    assert not set(expected) & set(static_gpu_report.missing), static_gpu_report.stderr[-4000:]
    assert {row["backend"] for row in static_gpu_report.rows} == set(expected)
    for backend in expected:
        rows = static_gpu_report.of(backend)
        found = {(row["kernel"], row["target"]) for row in rows}
        assert found == BUILDS[backend], backend
    failing = [row for row in static_gpu_report.rows if not row["fits"]]
    assert not failing, [(r["backend"], r["kernel"], r["target"], r["problems"]) for r in failing]
    if len(expected) == len(inspect.SOURCES):  # the command fails when a backend could not be compiled
        assert static_gpu_report.returncode == 0, static_gpu_report.stderr[-4000:]


def test_table_has_a_line_per_row(static_gpu_report):
    table = inspect.format_table(static_gpu_report.rows).splitlines()
    assert len(table) == 1 + len(static_gpu_report.rows)
    assert table[0].split()[:3] == ["backend", "kernel", "target"]


def test_the_report_tests_carry_their_xdist_group(request):
    """The tests that read the report carry the xdist group that sends them to one worker under
    `--dist loadgroup`, marked before xdist's worker reads the markers into the node ids (conftest's hook
    runs first). pytest 9.2 ignores xdist 3.8's rewrite of the node ids (pytest-dev/pytest-xdist#1386),
    so the group does not hold there; the `static_gpu_report` fixture shares one report between the
    workers of a run whatever the distribution."""
    readers = [item for item in request.session.items if "static_gpu_report" in getattr(item, "fixturenames", ())]
    if not readers:  # selected alone (-k)
        pytest.skip("no test that reads the report was collected")
    for item in readers:
        assert [mark.args for mark in item.iter_markers("xdist_group")] == [("static_gpu_report",)], item.nodeid
    if any("@" in item.nodeid for item in readers):  # xdist's rewrite holds: for all of them
        assert all(item.nodeid.endswith("@static_gpu_report") for item in readers)
