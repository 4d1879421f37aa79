"""Checks that fused_attn installs where its GPU users are: a Linux machine whose pip sees PyPI's torch.

On Linux, PyPI's torch is the CUDA build, and it pins the Triton it was built with; a requirement
that contradicts the pin makes `pip install -r requirements.txt`, the first step of `make test` and
`make bench`, impossible there. Machines that serve a CPU build of torch from a local folder never see
that, so this script looks with pip's `--isolated` mode, which ignores the machine's pip configuration
(its local wheel folder and constraints) and sees what a runner sees.

    python3 scripts/check_gpu_install.py           fast: resolve requirements.txt against PyPI
    python3 scripts/check_gpu_install.py --full    also install the CUDA build of torch in a venv,
                                                   build the extension with nvcc, import, run tests

Fast mode (about a minute the first time, seconds once pip's cache holds the metadata) runs pip's
resolver in dry-run mode, as a Linux x86-64 runner would, with an interpreter of each Python version
given: it reads the wheels' metadata, downloads no wheel, installs nothing. It fails when the requirements do not resolve, when the
torch chosen is not the CUDA build, or when the Triton chosen is not the one that torch pins.

Full mode creates (or reuses) a venv with PyPI's CUDA torch and its Triton, copies the source tree
(what git tracks or would track) into it (so the build shares nothing with the checkout's own), builds the extension there with
FUSED_ATTN_BUILD_CUDA=1 (CUDA_HOME from the environment, else /usr/local/cuda), times the build,
checks that `import fused_attn` works without a GPU and that `available_backends()` gives "no CUDA
device" as the reason for both GPU backends (not a build or import failure), then runs the test suite
(the CPU, interpreter, emulated-CUDA and static-report tests; the CUDA-device ones skip).

Only the standard library is used here: the script runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements.txt"
# The resolver: a pinned pip, in a venv of its own per Python version (the machine's pip may be older
# than --report). pip evaluates requirement markers (python_version) for the interpreter it runs in,
# so each version is resolved by an interpreter of that version.
RESOLVER_PIP = "pip==26.3"


def run(command, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(part) for part in command), flush=True)
    return subprocess.run([str(part) for part in command], check=True, **kwargs)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, *packages: str, interpreter: str = sys.executable) -> Path:
    python = venv_python(venv)
    if not python.exists():
        run([interpreter, "-m", "venv", venv])
    if packages:
        run([python, "-m", "pip", "install", "--isolated", "--quiet", "--disable-pip-version-check",
             *packages])
    return python


def isolated_pip(python: Path) -> list:
    """pip as a runner has it: no local wheel folder, no constraints, no extra index."""
    return [python, "-m", "pip", "--isolated", "--disable-pip-version-check"]


# ---------------------------------------------------------------------------------------------------
# Fast: the resolution
# ---------------------------------------------------------------------------------------------------

def find_interpreter(version: str) -> str | None:
    """A Python `version` ("3.10") interpreter on this machine: on PATH, or one of pyenv's."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{version}"),
                  *sorted(str(p) for p in pyenv_root.glob(f"versions/{version}.*/bin/python{version}"))]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def resolve(resolver: Path) -> dict[str, dict]:
    """{normalised name: metadata} of what pip would install from requirements.txt on this platform
    (Linux x86-64) with the resolver's Python, seeing PyPI only: wheels only, as a runner's pip takes."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        run([*isolated_pip(resolver), "install", "--dry-run", "--ignore-installed", "--quiet",
             "--only-binary", ":all:", "--report", report, "-r", REQUIREMENTS])
        items = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"] for item in items}


def pinned_triton(torch_metadata: dict) -> str | None:
    """The Triton release that torch's metadata pins for Linux x86-64, or None."""
    for requirement in torch_metadata.get("requires_dist", []):
        name, _, rest = requirement.partition("==")
        if name.strip() == "triton" and rest:
            return rest.split(";")[0].strip()
    return None


def check_resolution(venvs: Path, python_version: str) -> list[str]:
    """What is wrong with the runner's resolution for `python_version` (empty when nothing is)."""
    interpreter = find_interpreter(python_version)
    if interpreter is None:
        print(f"python {python_version}: no interpreter here, not checked")
        return []
    resolver = ensure_venv(venvs / python_version, RESOLVER_PIP, interpreter=interpreter)
    try:
        chosen = resolve(resolver)
    except subprocess.CalledProcessError:
        return [f"python {python_version}: requirements.txt does not resolve against PyPI (pip's "
                "message above)"]
    torch_metadata = chosen.get("torch")
    if torch_metadata is None:
        return [f"python {python_version}: torch is not among the packages resolved"]
    problems = []
    cuda_libraries = [name for name in chosen if name.startswith("nvidia-")]
    if not cuda_libraries:
        problems.append(f"python {python_version}: torch {torch_metadata['version']} resolved without "
                        "the CUDA libraries: not the CUDA build a runner gets")
    pin = pinned_triton(torch_metadata)
    triton = chosen.get("triton", {}).get("version")
    if pin is not None and triton != pin:
        problems.append(f"python {python_version}: torch pins triton {pin}, the resolution chose {triton}")
    print(f"python {python_version}: torch {torch_metadata['version']} (CUDA build: "
          f"{len(cuda_libraries)} nvidia-* packages), triton {triton} (torch pins {pin}), "
          f"{len(chosen)} packages")
    return problems


# ---------------------------------------------------------------------------------------------------
# Full: install, build, import, test
# ---------------------------------------------------------------------------------------------------

def copy_tracked_tree(destination: Path) -> None:
    """The source tree as git sees it: tracked files and new ones not ignored, as they are in the
    working tree (uncommitted edits included); no build products, no venvs."""
    if destination.exists():
        shutil.rmtree(destination)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


IMPORT_CHECK = """
import json, torch, fused_attn
from fused_attn.backends import cuda
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "cuda_kernels": cuda.has_cuda_kernels(), "architectures": cuda.built_architectures(),
                  "backends": fused_attn.available_backends()}))
"""


def check_import(python: Path, source: Path) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([python, "-c", IMPORT_CHECK], cwd=source, env=environment, capture_output=True,
                          text=True)
    if done.returncode != 0:
        return [f"import fused_attn failed:\n{done.stderr[-3000:]}"]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    print("import fused_attn:", json.dumps(found, indent=1))
    problems = []
    if found["cuda"] is None:
        problems.append(f"the venv's torch {found['torch']} is not a CUDA build")
    if not found["cuda_kernels"]:
        problems.append("fused_attn._C has no CUDA kernels")
    elif not found["architectures"]:
        problems.append("fused_attn._C does not record the architectures its CUDA kernels were built for")
    reasons = found["backends"]
    if reasons.get("cpu") is not None or reasons.get("reference") is not None:
        problems.append(f"cpu/reference backends unavailable: {reasons}")
    for name in ("cuda", "triton"):
        if not str(reasons.get(name)).startswith("no CUDA device"):
            problems.append(f"{name} backend: expected 'no CUDA device...', got {reasons.get(name)!r}")
    return problems


def full_check(venv: Path, pytest_args: list[str], run_tests: bool) -> list[str]:
    python = ensure_venv(venv)
    run([*isolated_pip(python), "install", "--quiet", "-r", REQUIREMENTS])
    source = venv / "src"
    copy_tracked_tree(source)
    environment = dict(os.environ, FUSED_ATTN_BUILD_CUDA="1")
    if "CUDA_HOME" not in environment and Path("/usr/local/cuda/include/cuda_runtime.h").is_file():
        environment["CUDA_HOME"] = "/usr/local/cuda"
    arch_list = environment.get("TORCH_CUDA_ARCH_LIST", "the default of setup.py")
    start = time.perf_counter()
    run([*isolated_pip(python), "install", "--quiet", "--no-build-isolation", "--no-deps", "-e", source],
        env=environment)
    build_seconds = time.perf_counter() - start
    print(f"build of fused_attn._C with CUDA kernels for {arch_list}: {build_seconds:.0f} s "
          f"({os.cpu_count()} CPUs, MAX_JOBS={environment.get('MAX_JOBS', 'unset')})")
    problems = check_import(python, source)
    if problems or not run_tests:
        return problems
    tested = subprocess.run([python, "-m", "pytest", "-q", *pytest_args], cwd=source)
    if tested.returncode != 0:
        problems.append(f"the test suite failed in the CUDA-torch venv (pytest exit {tested.returncode})")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also install, build, import and test")
    parser.add_argument("--python-versions", nargs="+", default=["%d.%d" % sys.version_info[:2]],
                        help="runner Python versions to resolve for, each with an interpreter of that "
                             "version found here (default: this one, %(default)s)")
    parser.add_argument("--resolver-venv", type=Path, default=ROOT / ".venv-resolve")
    parser.add_argument("--cuda-venv", type=Path, default=ROOT / ".venv-cuda")
    parser.add_argument("--no-tests", action="store_true", help="full mode: stop after the import check")
    parser.add_argument("pytest_args", nargs="*", default=["tests"],
                        help="full mode: arguments for pytest (default: tests)")
    options = parser.parse_args(argv)

    problems = [problem for version in options.python_versions
                for problem in check_resolution(options.resolver_venv, version)]
    if options.full and not problems:
        problems += full_check(options.cuda_venv, options.pytest_args, not options.no_tests)
    for problem in problems:
        print("FAIL:", problem, file=sys.stderr)
    if not problems:
        print("GPU install check passed" + (" (full)" if options.full else " (resolution)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
