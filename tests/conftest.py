"""Shared test setup.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU tensors; the switch must be
set before any kernel module is imported, hence here. Tests marked `cuda` skip cleanly without a GPU.
"""

import os
import zlib
from collections import defaultdict

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# The cpu kernels fill their scratch with NaN before use, so that a value read before it was written
# reaches the output, which the tests check for NaN.
os.environ.setdefault("FUSED_ATTN_CPU_POISON_SCRATCH", "1")
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# First: xdist's worker reads the xdist_group markers into the node ids (`--dist loadgroup`) in its own
# pytest_collection_modifyitems, which would otherwise run before this one and see no marker at all.
# Then the tests that read the static GPU report go last (a stable sort, the same in every worker): they wait for
# it, and first in the files' order they held both workers idle for minutes while one core compiled it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    mark_unsampled_cases_slow(items)
    for item in items:
        if _reads_static_report(item):
            item.add_marker(STATIC_REPORT_GROUP)
    items.sort(key=_reads_static_report)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# The parametrized tests whose cases the default run (`-m "not slow"`: `make test`, CI) samples, about one in n:
# their cases are one catalogue crossed with dtypes, layouts or backends' variants, each differing from the next in
# one of these, and together they held over 40 % of the suite's time on Zen 3. The sample is the same on every run and
# machine (by a hash of each case's id) and holds every value of every parameter at least once; the other cases are
# marked slow, and `make test-full` runs them all.
SAMPLED_ONE_IN = {
    "test_triton.py::test_descriptor_kernels_match_reference": 4,
    "test_triton.py::test_mask_programs_match_reference": 3,
    "test_triton.py::test_score_variants_match_reference": 3,
    "test_triton.py::test_gradients_bitwise_identical_on_two_runs": 4,
    "test_triton.py::test_decode_kernels_match_reference": 2,
    "test_triton.py::test_sinks_match_reference": 2,
    "test_triton.py::test_padded_keys_are_never_read": 2,
    "test_triton.py::test_public_attention_with_autograd": 2,
    "test_triton.py::test_descriptor_decode_matches_reference": 2,
    "test_triton.py::test_quantized_paged_caches_match_reference": 2,
    "test_cpu.py::test_programs_meet_criterion": 3,
    "test_cpu.py::test_dropout_and_bias_gradient_meet_criterion": 3,
    "test_cpu.py::test_quantized_cache_meets_criterion": 3,
    "test_cpu.py::test_score_variants_meet_criterion": 2,
    "test_cpu.py::test_sinks_meet_criterion": 2,
    "test_varlen.py::test_matches_padded_definition": 3,
    "test_cuda_emulated.py::test_emulated_matches_reference": 2,
    "test_cuda_emulated.py::test_emulated_dropout_and_mask_gradient": 2,
    "test_cuda_emulated.py::test_emulated_large_heads_and_score_variants": 2,
    "test_cuda_emulated.py::test_emulated_sinks_match_reference": 2,
    "test_cuda_emulated.py::test_emulated_decode_kernels_match_reference": 2,
}


def mark_unsampled_cases_slow(items) -> None:
    """Marks slow the cases of SAMPLED_ONE_IN's tests outside their sample. The hash takes about one in n; then every
    value of every parameter (each case of a catalogue, each dtype) that no taken case has takes its first case."""
    cases = defaultdict(list)
    for item in items:
        test = f"{item.path.name}::{item.originalname}"
        if test in SAMPLED_ONE_IN and item.get_closest_marker("slow") is None:
            cases[test].append(item)
    slow = pytest.mark.slow
    for test, members in cases.items():
        taken = [item for item in members if zlib.crc32(item.name.encode()) % SAMPLED_ONE_IN[test] == 0]
        covered = {value for item in taken for value in _parameter_values(item)}
        for item in members:
            if not _parameter_values(item) <= covered:
                taken.append(item)
                covered |= _parameter_values(item)
        kept = {id(item) for item in taken}
        for item in members:
            if id(item) not in kept:
                item.add_marker(slow)


def _parameter_values(item) -> set:
    """(name, repr of value) of each parameter of a collected case."""
    callspec = getattr(item, "callspec", None)
    return {(name, repr(value)) for name, value in callspec.params.items()} if callspec is not None else set()


@pytest.fixture
def generator():
    """A seeded generator per test: fresh random inputs, reproducible failures."""
    return torch.Generator().manual_seed(0x5EED)


# The static GPU report compiles for minutes in a child process of its own. It starts as soon as the
# collected tests are known to need it, so that it compiles beside the tests (mostly one busy thread,
# the interpreter's) instead of after them. Under pytest-xdist every worker collects every test; the
# tests that read the report are meant to run in one worker (the `static_gpu_report` xdist_group,
# `--dist loadgroup`), but pytest 9.2 ignores the node ids xdist 3.8 rewrites for the groups
# (pytest-dev/pytest-xdist#1386), and they spread over the workers. So the workers of one run share one
# report: the first worker to finish collecting starts it, and a thread of that worker leaves it in the
# run's temporary directory, where the `static_gpu_report` fixture of every worker waits for it; the
# report compiles once per run, beside the tests from the start (a worker that waited for it to begin
# compiling would leave a core idle for minutes).
_pending_report = None
_report_writer = None
STATIC_REPORT_GROUP = pytest.mark.xdist_group("static_gpu_report")
_SHARED_REPORT, _SHARED_REPORT_STARTED = "static_gpu_report.json", "static_gpu_report.started"


def _run_directory(config):
    """The directory every xdist worker of this run shares: the parent of each worker's own base."""
    return config._tmp_path_factory.getbasetemp().parent


def _write_shared_report(pending, path) -> None:
    import dataclasses
    import json

    try:
        report = pending.result()
    except Exception as error:  # a hung compiler: the waiting fixtures get the reason, not a hang
        report = dict(rows=[], missing={}, returncode=-1, stderr=f"bench.inspect did not finish: {error!r}")
    else:
        report = dataclasses.asdict(report)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    partial.rename(path)  # whole or absent, for the readers


def _reads_static_report(item) -> bool:
    return "static_gpu_report" in getattr(item, "fixturenames", ())


def _build_emulation_in_background(session) -> None:
    """Starts compiling the CUDA emulation (tests/emulation/build.py, 40 s of one core) in a thread of each worker
    that will run its tests, so that the `emulated` fixture finds it built instead of holding a worker idle for it
    (the compiler's lock serialises the workers; the fixture reports a failed build)."""
    if session.config.option.collectonly or \
            not any("emulated" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    import threading

    from emulation import build  # tests/emulation, the module tests/test_cuda_emulated.py uses

    def compile_quietly():
        try:
            build.load()
        except Exception:  # noqa: BLE001 - the fixture builds again and fails with the reason
            pass

    threading.Thread(target=compile_quietly, daemon=True).start()


def pytest_collection_finish(session):
    global _pending_report, _report_writer
    _build_emulation_in_background(session)
    if session.config.option.collectonly or \
            not any(_reads_static_report(item) for item in session.items):
        return
    from bench import inspect

    if not hasattr(session.config, "workerinput"):  # one process: this session is the run
        _pending_report = inspect.start_json()
        return
    import threading

    shared = _run_directory(session.config)
    try:
        (shared / _SHARED_REPORT_STARTED).touch(exist_ok=False)
    except FileExistsError:  # another worker runs it
        return
    _pending_report = inspect.start_json()
    _report_writer = threading.Thread(target=_write_shared_report, args=(_pending_report, shared / _SHARED_REPORT),
                                      daemon=True)
    _report_writer.start()


def pytest_sessionfinish(session):
    if _report_writer is not None:
        _report_writer.join()  # the other workers may still wait for it
    elif _pending_report is not None:
        _pending_report.cancel()  # a run that stopped before any test needed it


@pytest.fixture(scope="session")
def static_gpu_report(request, tmp_path_factory):
    """`python -m bench.inspect --json` (every Triton and CUDA kernel compiled for sm_80 and sm_90),
    run once per test run in a child process: a bench.inspect.JsonRun. Under pytest-xdist the workers
    share it through a file in the run's own temporary directory, written by the worker that started
    it when its collection finished (pytest_collection_finish)."""
    import json
    import time

    from bench import inspect

    if not hasattr(request.config, "workerinput"):  # one process: this session is the run
        return (_pending_report or inspect.start_json()).result()
    cached = _run_directory(request.config) / _SHARED_REPORT
    deadline = time.monotonic() + 3600  # as PendingJsonRun.result's own limit
    while not cached.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the static GPU report was not written to {cached} within an hour")
        time.sleep(1.0)
    return inspect.JsonRun(**json.loads(cached.read_text()))


@pytest.fixture(scope="session")
def interpreter_remedies():
    """Makes Triton's interpreter compute what the GPU computes, leaving the kernels alone; for every
    test that runs the triton kernels on CPU tensors.

    Faults of the interpreter, each patched inside the interpreter (the same remedies on every
    supported Triton, 3.5 to 3.9: they give what the GPU computes wherever the fault is absent too):
    - `tl.dot` on bf16 operands multiplies their raw uint16 bit patterns; the remedy converts the
      operands to fp32 first (tensor cores: exact products, fp32 accumulation).
    - fp32 -> bf16 conversion truncates the mantissa, where the GPU rounds to nearest even; the
      truncation's bias accumulates (in dS rounded before dQ = dS K it exceeded the error bound).
      The remedy rounds to nearest even, as torch does.
    - Triton 3.5 and 3.6 turn a one-element block into a Python index with `int(array)`, which
      NumPy 2 refuses for arrays of one dimension (a loop bound `tl.minimum(L_K, ...)` is one); 3.7
      squeezes the array first, and so does the remedy.
    Returns counters {"bf16_dots": n, "bf16_casts": n} and the interpreter's own methods.
    """
    counter = {"bf16_dots": 0, "bf16_casts": 0, "create_dot": None, "cast_impl": None}
    try:
        import triton.language as tl
        from triton.runtime import interpreter

        from fused_attn.backends import triton_kernels as tk
    except ImportError:  # no Triton: nothing to patch
        yield counter
        return
    if HAS_CUDA or not tk.interpreting():
        yield counter
        return

    original_dot = counter["create_dot"] = interpreter.InterpreterBuilder.create_dot
    original_cast = counter["cast_impl"] = interpreter.InterpreterBuilder.cast_impl

    def as_float32(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            counter["bf16_dots"] += 1
            a, b = as_float32(a), as_float32(b)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            counter["bf16_casts"] += 1
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original_cast(self, src, dst_type)

    original_patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, *scope):
        original_patch_tensor(tensor, *scope)
        index = lambda self: int(self.handle.data.squeeze())  # noqa: E731
        if scope:  # Triton 3.6 and later undo their patches of triton.language through a scope
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
        patch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
        yield counter


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the forward and backward kernel calls of each backend: {"cpu": [forwards, backwards], ...}."""
    from fused_attn.backends import registry

    counts = {}
    for name in registry.names():
        backend = registry.get(name)
        counts[name] = [0, 0]
        for index, method in enumerate(("forward", "backward")):
            original = getattr(backend, method)

            def counted(*args, _original=original, _count=counts[name], _index=index, **kwargs):
                _count[_index] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(backend, method, counted)
    return counts
