"""scripts/check_gpu_install.py without the network: its verdicts on recorded resolutions.

The resolution itself runs in CI (`make check-gpu-install`); here its reading of pip's report is
tested on metadata shaped as pip writes it, so a verdict cannot pass for the wrong reason.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("check_gpu_install", ROOT / "scripts" / "check_gpu_install.py")
check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check)

CUDA_TORCH = {"name": "torch", "version": "2.13.0", "requires_dist": [
    "filelock", "nvidia-cublas==13.1.1.3; platform_system == \"Linux\"",
    "triton==3.7.1; platform_system == \"Linux\"", "numpy; extra == \"opt\""]}
CPU_TORCH = {"name": "torch", "version": "2.13.0+cpu", "requires_dist": ["filelock", "sympy"]}


def resolution(torch_metadata, triton_version, cuda_libraries=True):
    chosen = {"torch": torch_metadata, "numpy": {"name": "numpy", "version": "2.4.6"}}
    if triton_version:
        chosen["triton"] = {"name": "triton", "version": triton_version}
    if cuda_libraries:
        chosen["nvidia-cublas"] = {"name": "nvidia-cublas", "version": "13.1.1.3"}
    return chosen


@pytest.fixture
def resolved(monkeypatch, tmp_path):
    """Makes check_resolution read `chosen` (set through the returned dict) instead of running pip."""
    state = {"chosen": None, "fails": False}
    monkeypatch.setattr(check, "find_interpreter", lambda version: "/usr/bin/python" + version)
    monkeypatch.setattr(check, "ensure_venv", lambda venv, *packages, interpreter: venv / "bin" / "python")

    def resolve(resolver):
        if state["fails"]:
            raise subprocess.CalledProcessError(1, ["pip"])
        return state["chosen"]
    monkeypatch.setattr(check, "resolve", resolve)
    return state


def test_pinned_triton_is_read_from_torch_metadata():
    assert check.pinned_triton(CUDA_TORCH) == "3.7.1"
    assert check.pinned_triton(CPU_TORCH) is None


def test_cuda_torch_with_its_triton_passes(resolved, tmp_path):
    resolved["chosen"] = resolution(CUDA_TORCH, "3.7.1")
    assert check.check_resolution(tmp_path, "3.11") == []


def test_triton_other_than_torch_pins_fails(resolved, tmp_path):
    resolved["chosen"] = resolution(CUDA_TORCH, "3.9.0")
    (problem,) = check.check_resolution(tmp_path, "3.11")
    assert "torch pins triton 3.7.1, the resolution chose 3.9.0" in problem


def test_cpu_torch_is_not_what_a_runner_gets(resolved, tmp_path):
    resolved["chosen"] = resolution(CPU_TORCH, "3.9.0", cuda_libraries=False)
    (problem,) = check.check_resolution(tmp_path, "3.11")
    assert "not the CUDA build" in problem


def test_impossible_resolution_fails_and_names_the_python(resolved, tmp_path):
    resolved["fails"] = True
    (problem,) = check.check_resolution(tmp_path, "3.12")
    assert problem.startswith("python 3.12: requirements.txt does not resolve")


def test_missing_interpreter_is_reported_not_failed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(check, "find_interpreter", lambda version: None)
    assert check.check_resolution(tmp_path, "3.99") == []
    assert "no interpreter here, not checked" in capsys.readouterr().out


def test_find_interpreter_checks_the_version_it_runs():
    import sys

    this = "%d.%d" % sys.version_info[:2]
    found = check.find_interpreter(this)
    assert found is None or subprocess.run([found, "--version"], capture_output=True, text=True,
                                           check=True).stdout.startswith(f"Python {this}")
    assert check.find_interpreter("2.99") is None


def test_source_copy_has_the_tree_and_no_build_products(tmp_path):
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("not run from a git checkout (a copy of the tree, as the full check makes)")
    check.copy_tracked_tree(tmp_path / "src")
    copied = {path.relative_to(tmp_path / "src").as_posix() for path in (tmp_path / "src").rglob("*")
              if path.is_file()}
    assert {"setup.py", "requirements.txt", "csrc/ops.cpp", "fused_attn/__init__.py",
            "scripts/check_gpu_install.py", "fused_attn/backends/triton_compat.py"} <= copied
    assert not any(name.endswith(".so") or name.startswith((".venv", "build/")) for name in copied)


BUILT = ["sm_80", "sm_86", "sm_90", "sm_100", "compute_120", "sm_120"]


@pytest.mark.parametrize("found, expected", [
    ({"cuda": "13.0", "cuda_kernels": True, "architectures": BUILT, "backends": {
        "triton": "no CUDA device (torch 2.13.0+cu130); ...", "cuda": "no CUDA device", "cpu": None,
        "reference": None}}, []),
    ({"cuda": "13.0", "cuda_kernels": True, "architectures": [], "backends": {
        "triton": "no CUDA device", "cuda": "no CUDA device", "cpu": None, "reference": None}},
     ["does not record the architectures"]),
    ({"cuda": "13.0", "cuda_kernels": False, "architectures": [], "backends": {
        "triton": "no CUDA device", "cuda": "the C++ extension fused_attn._C was built without CUDA kernels",
        "cpu": None, "reference": None}}, ["no CUDA kernels", "cuda backend"]),
    ({"cuda": None, "cuda_kernels": False, "architectures": [], "backends": {
        "triton": "triton is not installed", "cuda": "no CUDA device", "cpu": None, "reference": None}},
     ["not a CUDA build", "no CUDA kernels", "triton backend"]),
])
def test_import_verdict(monkeypatch, tmp_path, found, expected):
    import json

    found = dict(found, torch="2.13.0")

    def fake_run(command, **kwargs):
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(found) + "\n", stderr="")
    monkeypatch.setattr(check.subprocess, "run", fake_run)
    problems = check.check_import(Path("python"), tmp_path)
    assert len(problems) == len(expected)
    for problem, words in zip(problems, expected):
        assert words in problem
