"""`python -m bench.inspect`: the static GPU report, made without a GPU.

Compiles the Triton kernels (every default config, with Triton's compiler and an explicit target) for sm_80,
sm_90 and sm_100 and the CUDA kernels (every shipped template instance, with nvcc) for sm_80 and sm_90, and
prints per kernel: registers, spill bytes, stack, shared memory, tensor-core instruction counts
(HMMA/HGMMA/UTCHMMA) and whether it fits the device.

    python -m bench.inspect            # table
    python -m bench.inspect --json     # one JSON object per (backend, kernel, target, config)

The tests run the JSON form once per test run, shared by pytest-xdist's workers (`start_json`, started
by tests/conftest.py when the collected tests need it, and the `static_gpu_report` fixture) and judge its
rows (tests/test_triton_compile.py, tests/test_cuda_compile.py, tests/test_inspect.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

from . import cuda_report, triton_report
from .kernel_table import format_table

SOURCES = {"triton": triton_report.report, "cuda": cuda_report.report}


def collect(backends=tuple(SOURCES)) -> tuple[list[dict], dict[str, str]]:
    """(rows, {backend: why it could not be compiled}) for the requested backends, compiled at the same
    time (each report's compilers run in child processes)."""
    rows, missing = [], {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(backends) or 1) as pool:
        reports = {backend: pool.submit(SOURCES[backend]) for backend in backends}
    for backend, report in reports.items():
        try:
            rows.extend(report.result())
        except (OSError, RuntimeError) as error:  # a missing compiler or a failed build
            missing[backend] = str(error)
    return rows, missing


@dataclasses.dataclass
class JsonRun:
    """What `python -m bench.inspect --json` printed: its rows, {backend: why it was not compiled}
    (the first line of the reason), its exit code and its stderr."""

    rows: list[dict]
    missing: dict[str, str]
    returncode: int
    stderr: str

    def of(self, backend: str) -> list[dict]:
        return [row for row in self.rows if row["backend"] == backend]


@dataclasses.dataclass
class PendingJsonRun:
    """`python -m bench.inspect --json` running in a child process; `result()` waits for it. Its
    output goes to temporary files, so that the child never waits on a full pipe."""

    process: subprocess.Popen
    stdout: typing.IO[str]
    stderr: typing.IO[str]

    def result(self, timeout: float = 3600) -> JsonRun:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.cancel()
            raise
        self.stdout.seek(0)
        self.stderr.seek(0)
        out, err = self.stdout.read(), self.stderr.read()
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        missing = dict(re.findall(rf"^({'|'.join(SOURCES)}): not compiled: (.*)$", err, re.MULTILINE))
        return JsonRun(rows, missing, self.process.returncode, err)

    def cancel(self) -> None:
        """Stops the child and the compilers it started (its own process group)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_json() -> PendingJsonRun:
    """Starts `python -m bench.inspect --json` in a child process (TRITON_INTERPRET unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-m", "bench.inspect", "--json"], cwd=root, env=env, stdout=stdout,
                               stderr=stderr, text=True, start_new_session=True)
    return PendingJsonRun(process, stdout, stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--backends", nargs="+", choices=tuple(SOURCES), default=tuple(SOURCES))
    args = parser.parse_args(argv)
    rows, missing = collect(args.backends)
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    else:
        print(format_table(rows))
    for backend, why in missing.items():
        print(f"{backend}: not compiled: {why}", file=sys.stderr)
    return 0 if rows and not missing and all(row["fits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
