"""Which backend runs a call: by explicit request, or automatically by device and capability."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch

from ..problem import Problem
from .base import Backend

logger = logging.getLogger("fused_attn")

ENV_VARIABLE = "FUSED_ATTN_BACKEND"

# In order of preference: the first that can run a call on its device is chosen automatically.
_BACKENDS: dict[str, Backend] = {}


class _Requests(threading.local):
    """The requests of the `use_backend` blocks a thread is in, innermost last. Thread-local, as
    torch's own context managers are (`torch.no_grad`, `sdpa_kernel`): a block in one thread leaves
    every other thread's choice alone, and a new thread starts without one. (Not a ContextVar, which
    would follow asyncio tasks too: torch.compile cannot trace ContextVar.get, and reads this.)"""

    def __init__(self):
        self.stack: list[str | None] = [None]


_requested = _Requests()


class BackendError(ValueError):
    """An explicitly requested backend cannot run this call; the message lists every backend's reasons."""


# Automatic choices made so far. A backend's answer for a problem on one of its own devices depends on
# the Problem and on what was found at import only (Backend.refusals), so a choice holds until the
# set of backends changes; it saves the walk through every backend's refusals on each call.
_automatic_choices: dict[Problem, Backend] = {}
_MAX_REMEMBERED = 4096


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    _automatic_choices.clear()
    return backend


def get(name: str) -> Backend:
    """The backend called `name`; a ValueError naming the known ones otherwise."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: expected one of {sorted(_BACKENDS)}, got {name!r}") from None


def names() -> list[str]:
    return list(_BACKENDS)


def available_backends() -> dict[str, str | None]:
    """Every backend and why it cannot run on this machine (None when it can)."""
    return {name: backend.unavailable() for name, backend in _BACKENDS.items()}


@contextlib.contextmanager
def use_backend(name: str | None):
    """Within the block, calls without `backend=` use `name` (None restores automatic choice).

    The request holds for the thread that entered the block, as with torch's own context managers
    (`torch.no_grad`, `sdpa_kernel`); other threads keep their own choice.
    """
    if name is not None:
        get(name)
    _requested.stack.append(name)
    try:
        yield
    finally:
        _requested.stack.pop()


# os.environ's own store, read directly: `os.environ.get` of an unset variable raises and catches a
# KeyError, a microsecond on every call (bench/NOTES.md, section 27).
_ENVIRON_STORE = getattr(os.environ, "_data", None)
_ENVIRON_KEY = os.environ.encodekey(ENV_VARIABLE) if _ENVIRON_STORE is not None else None


def _environment_request() -> str | None:
    if _ENVIRON_STORE is None:
        return os.environ.get(ENV_VARIABLE) or None
    raw = _ENVIRON_STORE.get(_ENVIRON_KEY)
    return None if raw is None else os.environ.decodevalue(raw) or None


def requested_backend(explicit: str | None) -> str | None:
    """The request in force: the argument, else the innermost context manager, else the environment."""
    if explicit is not None:
        return explicit
    if _requested.stack[-1] is not None:
        return _requested.stack[-1]
    return _environment_request()


def reasons(backend: Backend, problem: Problem) -> list[str]:
    unavailable = backend.unavailable()
    if unavailable is not None:
        return [unavailable]
    return backend.refusals(problem)


def _verdict(backend: Backend, problem: Problem) -> str:
    refused = reasons(backend, problem)
    if refused:
        return ", ".join(refused)
    notes = backend.notes(problem)
    return "can run it" + (f" ({', '.join(notes)})" if notes else "")


def explain(problem: Problem) -> dict[str, str]:
    """Each backend's verdict on `problem`: why it cannot run it, or that it can, with what it does differently
    from the kernels' direct path (e.g. an 8-bit cache dequantized into a copy)."""
    return {name: _verdict(backend, problem) for name, backend in _BACKENDS.items()}


def choose(problem: Problem, explicit: str | None = None) -> Backend:
    """The backend for `problem`; BackendError if a requested one cannot run it."""
    name = requested_backend(explicit)
    if name is not None:
        backend = get(name)
        if not reasons(backend, problem):
            return backend
        report = "; ".join(f"{other.name}: {_verdict(other, problem)}" for other in _BACKENDS.values())
        raise BackendError(f"backend: {name!r} cannot run this call. Backends: {report}")
    chosen = _automatic_choices.get(problem)
    if chosen is None:
        chosen = _first_able(problem)
        if len(_automatic_choices) >= _MAX_REMEMBERED:
            _automatic_choices.clear()
        _automatic_choices[problem] = chosen
    return chosen


def _first_able(problem: Problem) -> Backend:
    for backend in _BACKENDS.values():
        if problem.device.type not in backend.devices:
            continue
        refused = reasons(backend, problem)
        if not refused:
            if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
                logger.debug("fused_attn: %s chosen: %s", backend.name, _verdict(backend, problem))
            return backend
        if not torch.compiler.is_compiling():
            logger.debug("fused_attn: %s skipped: %s", backend.name, refused)
    raise BackendError(f"no backend can run this call on {problem.device}")
