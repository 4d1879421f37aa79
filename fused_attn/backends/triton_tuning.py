"""What the Triton autotuners of this process chose.

Every autotuner the triton backend makes (triton_kernels' long-query kernels, triton_decode's split-KV kernel) is
registered here under a name. `choices` lists, for every problem each one has tuned, the config it kept: pointers, a
tensor-descriptor (TMA) variant or a warp-specialized one. `new_tunings` gives the tunings made since an earlier
`snapshot`, with each candidate's time where Triton still holds it, so that a benchmark on a GPU (bench.gpu_check)
can say which variant won and by how much: what a static report compiled without a GPU cannot tell.

Nothing here imports Triton: the names and the autotuners' own attributes (`cache`: tuning key -> the config kept,
`keys`: the argument names of the key, `configs_timings`: the candidates' times of its last tuning) are all it reads.
"""

from __future__ import annotations

import math

_tuners: dict[str, object] = {}

# The constexprs that name a variant rather than a tile; written as words after the tiles.
_VARIANT_SWITCHES = {"DESCRIPTORS": "descriptors", "WARP_SPECIALIZE": "warp_specialized"}


def registered(name: str, tuner):
    """`tuner` (a Triton autotuner), recorded under `name`; returns it."""
    _tuners[name] = tuner
    return tuner


def config_text(config) -> str:
    """A triton.Config as KernelConfig writes itself: its tiles, warps, stages, then the variant's switches."""
    kwargs = dict(config.kwargs)
    parts = [f"{name}={value}" for name, value in kwargs.items() if name not in _VARIANT_SWITCHES]
    parts += [f"warps={config.num_warps}", f"stages={config.num_stages}"]
    return ",".join(parts + [word for name, word in _VARIANT_SWITCHES.items() if kwargs.get(name)])


def choices() -> dict[tuple[str, tuple], str]:
    """{(autotuner name, tuning key): the text of the config it kept} for every problem tuned in this process."""
    return {(name, key): config_text(config) for name, tuner in _tuners.items()
            for key, config in list(tuner.cache.items())}


def snapshot() -> dict:
    """What the autotuners hold now, for `new_tunings`: their choices, and which times each holds (a tuning of a
    single candidate, timed by no one, leaves the last tuning's in place)."""
    return {"choices": choices(),
            "timings": {name: getattr(tuner, "configs_timings", None) for name, tuner in _tuners.items()}}


def _milliseconds(timing) -> float | None:
    """A candidate's time as the autotuner holds it (do_bench's median, alone or first of its quantiles), or None
    where it did not run (Triton times a candidate that fails to compile or launch as infinite)."""
    value = float(timing[0] if isinstance(timing, (list, tuple)) else timing)
    return value if math.isfinite(value) else None


def new_tunings(before: dict) -> list[dict]:
    """The tunings made since `before` (a `snapshot()`): for each, the autotuner, its key by argument name (the
    tensors' dtypes after them), the config kept and its variant. Where the autotuner's times are new and this is
    its only new key, also each candidate's time (ms), the kept one's, and the fastest pointer candidate's."""
    tunings = []
    for name, tuner in _tuners.items():
        new = [(key, config) for key, config in list(tuner.cache.items()) if (name, key) not in before["choices"]]
        held = getattr(tuner, "configs_timings", None)
        timings = held or {}
        timed = len(new) == 1 and held is not before["timings"].get(name)  # Triton replaces the dict when it times
        for key, config in new:
            names = list(tuner.keys) + [f"dtype{i}" for i in range(len(key) - len(tuner.keys))]
            tuning = {"autotuner": name, "key": {n: str(value) for n, value in zip(names, key)},
                      "chosen": config_text(config),
                      "variant": next((word for switch, word in reversed(_VARIANT_SWITCHES.items())
                                       if config.kwargs.get(switch)), "pointers")}
            if timed and config in timings:
                times = {config_text(candidate): _milliseconds(timing) for candidate, timing in timings.items()}
                pointers = [times[config_text(candidate)] for candidate in timings
                            if not any(candidate.kwargs.get(switch) for switch in _VARIANT_SWITCHES)]
                tuning.update(candidates_ms=times, chosen_ms=_milliseconds(timings[config]),
                              fastest_pointers_ms=min((t for t in pointers if t is not None), default=None))
            tunings.append(tuning)
    return tunings
