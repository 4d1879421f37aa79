"""Static GPU report of the `triton` backend, made without a GPU.

Every kernel is compiled at its default configs (forward; backward preprocess, dK/dV and dQ; fp16 and bf16; head dims
64 and 128, and from Triton 3.7 on sm_90 and sm_100 fp32 at 128 and bf16 at 256 (WIDER); causal and not, causal with
dropout, causal with every score variant of fused_attn.scores at once (a sliding window aligned bottom-right, softcap,
ALiBi, attention sinks) with key padding, the same with dropout over a packed batch of sequences (fused_attn.varlen;
the preprocess too), the same with a mask program (fused_attn.masks) without and with dropout (forward, dK/dV, dQ),
and for dK/dV causal with dropout and the gradient of a learned additive bias, alone and with the score variants; the
forward and the split-KV decode kernels over a paged cache of the query's dtype, of int8 and of float8_e4m3fn
(fused_attn.quantization, a scale per stored key; float8_e4m3fn also one per sequence), the decode kernels also plain
and with the score variants, their combine plain and with sinks) for sm_80, sm_90 and sm_100 with Triton's own
compiler and an explicit target (sm_100 takes the configs of sm_90, as a Blackwell device does:
`triton_kernels.arch_of`). The cubins are read with the `cuobjdump` shipped in the Triton wheel:
`--dump-resource-usage` for registers, stack and local memory, `--dump-sass` for local loads/stores (spills) and
tensor-core instructions (HMMA on sm_80, HGMMA — warpgroup MMA — on sm_90, UTCHMMA — Blackwell's tcgen05.mma on
fp16/bf16 operands — on sm_100; tiles whose products have fewer rows than a warpgroup's 64, the decode kernel's 16
query rows and some of the backward's at D = 256, stay warp-level HMMA on both: `tensor_core_prefix`). Shared memory
is Triton's dynamic allocation from the kernel metadata plus any static shared memory. Triton builds capability 9.0
and 10.0 as the architecture-specific sm_90a and sm_100a (wgmma and tcgen05.mma exist only there), as it does on such
a device; each row records the architecture its cubin's SASS names (`cubin_arch`), and a cubin of another architecture
than its target fails the row.

The tensor-descriptor variants (`triton_kernels` DESCRIPTORS: the forward's Q, K, V and O, the backward's Q, K, V,
dO, dQ, dK and dV through `tl.make_tensor_descriptor`) have rows of their own for sm_90 and sm_100, the forward's
plain and warp-specialized ("fwd_desc", "fwd_desc_ws"), the backward's dK/dV and dQ, plain and warp-specialized
too ("bwd_dkdv_desc", "bwd_dq_desc", "bwd_dkdv_desc_ws", "bwd_dq_desc_ws"), and the split-KV decode kernel's, plain
and warp-specialized ("decode_desc", "decode_desc_ws"), over what they serve (no packed batch, no paged cache); they
add the TMA instructions of the SASS (UTMALDG loads and UTMASTG stores must both be there), the
global scratch memory the descriptors take per program, whether Triton split the loop into warp-specialized
partitions (its TTGIR holds `ttg.warp_specialize`) and the warps a launch then takes.

The kernels are specialised exactly as a launch would specialise them (the JIT's own routine, found
by `fused_attn.backends.triton_compat`) for a representative call: (B, L, H, D) tensors as
`split_heads_attention` passes them, without masks, H_q == H_kv.

Compilation needs the kernels built as `triton.jit` functions, not for the interpreter, so `report()`
runs it in a child process with TRITON_INTERPRET unset and TRITON_CACHE_DIR in a temporary directory.

    python -m bench.triton_report            # table
    python -m bench.triton_report --json     # one JSON object per (kernel, target, config)
    python -m bench.triton_report --targets sm_100 --kernels fwd_desc fwd_desc_ws   # a part of it
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from . import gpu_binaries
from .kernel_table import format_table

TARGETS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
TENSOR_CORE_PREFIX = {"sm_80": "HMMA", "sm_90": "HGMMA", "sm_100": "UTCHMMA"}
# The rows of a warpgroup's products (wgmma, tcgen05.mma): a tile with fewer, as the decode kernel's 16 query rows, is
# multiplied by warp-level mma (HMMA) on sm_90 and sm_100 too, still tensor cores.
WARPGROUP_ROWS = 64


def tensor_core_prefix(kernel: str, target: str, config: str) -> str:
    """The tensor-core instruction a build of `kernel` at `config` (its text: "BLOCK_M=..,BLOCK_N=..") must hold on
    `target`: TENSOR_CORE_PREFIX's where its products' rows (the query rows of a tile; dK/dV's key rows) fill a
    warpgroup, HMMA where they do not."""
    blocks = dict(re.findall(r"(BLOCK_[MN])=(\d+)", config))
    rows = int(blocks["BLOCK_N" if base_kernel(kernel) == "bwd_dkdv" else "BLOCK_M"])
    return TENSOR_CORE_PREFIX[target] if rows >= WARPGROUP_ROWS else "HMMA"


def capability(target: str) -> tuple[int, int]:
    """The compute capability of a target: (9, 0) for "sm_90"."""
    return TARGETS[target] // 10, TARGETS[target] % 10


def config_arch(target: str) -> str:
    """The generation whose config table a device of `target` launches with (`triton_kernels.arch_of`)."""
    from fused_attn.backends import triton_kernels as tk

    return tk.arch_of(capability(target))


DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
# Beyond those, on the targets with TMA, as (dtype, head dim): fp32 (products on FMA units, tiles of its own) and the
# widest head dim, from Triton 3.7 on, the oldest release whose builds of them are free of local memory (3.7.1 and 3.8.0
# with tiles of their own: triton_kernels._OLD_RELEASE_DEFAULTS and _FLOAT32_OLD_RELEASE_DEFAULTS); `--dtypes float32
# --head-dims 64 128 256 --wider` compiles the rest (bench/NOTES.md sections 58 and 62).
WIDER = (("float32", 128), ("bfloat16", 256))
WIDER_TARGETS = ("sm_90", "sm_100")
WIDER_FROM = (3, 7)


def wider_shapes() -> tuple[tuple[str, int], ...]:
    """WIDER with the installed Triton from WIDER_FROM on, else none."""
    from fused_attn.backends import triton_compat

    return () if triton_compat.older_than(WIDER_FROM) else WIDER
# The tensor-descriptor variants (triton_kernels.DESCRIPTOR_KERNELS), as report rows of their own, each {name: (the
# kernel, its config's switches)}: the forward at its default config with Q, K, V and O through tensor descriptors
# ("fwd_desc"), and with its key loop warp-specialized too ("fwd_desc_ws"); the dK/dV and dQ kernels with Q, K, V,
# dO and their gradients through descriptors, and with their loops warp-specialized ("bwd_dkdv_desc_ws",
# "bwd_dq_desc_ws"); the split-KV decode kernel with a dense cache's K and V and the splits' outputs through
# descriptors, at its fixed config, and with its key loop warp-specialized ("decode_desc_ws"); compiled for the
# targets with TMA. Their SASS must hold TMA loads (UTMALDG) and stores (UTMASTG).
DESCRIPTOR_VARIANTS = {"fwd_desc": ("fwd", dict(descriptors=True)),
                       "fwd_desc_ws": ("fwd", dict(descriptors=True, warp_specialize=True)),
                       "bwd_dkdv_desc": ("bwd_dkdv", dict(descriptors=True)),
                       "bwd_dkdv_desc_ws": ("bwd_dkdv", dict(descriptors=True, warp_specialize=True)),
                       "bwd_dq_desc": ("bwd_dq", dict(descriptors=True)),
                       "bwd_dq_desc_ws": ("bwd_dq", dict(descriptors=True, warp_specialize=True)),
                       "decode_desc": ("decode", dict(descriptors=True)),
                       "decode_desc_ws": ("decode", dict(descriptors=True, warp_specialize=True))}
DESCRIPTOR_TARGETS = ("sm_90", "sm_100")
WARP_SPECIALIZED_VARIANTS = tuple(name for name, (_, switches) in DESCRIPTOR_VARIANTS.items()
                                  if switches.get("warp_specialize"))
# The operation of Triton's GPU dialect holding the partitions of a warp-specialized loop.
WARP_SPECIALIZE_OP = re.compile(r"\bttg\.warp_specialize\b")
KERNELS = ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "decode", "decode_combine", *DESCRIPTOR_VARIANTS)
# Kernels whose work is matrix products; the preprocess and the decode combine are row-wise reductions.
MATMUL_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "decode", *DESCRIPTOR_VARIANTS)


def kernels(target: str, dtype: str = "float16", head_dim: int = 64) -> tuple[str, ...]:
    """The kernels compiled for `target`: all, but the descriptor variants only where TMA is, with a Triton that
    offers them (triton_compat.tensor_descriptors, warp_specialization), and for what a launch offers them for (no
    fp32: triton_kernels.call_refusals; no warp-specialized loop over head dims above
    triton_kernels.WARP_SPECIALIZED_MAX_HEAD_DIM: warp_specialization_refusal); the decode kernels up to the head dims
    they take (triton_decode.MAX_HEAD_DIM: the long-query kernels run the others)."""
    import torch
    from fused_attn.backends import triton_compat, triton_decode
    from fused_attn.backends import triton_kernels as tk

    offered = [k for k in KERNELS if (k not in DESCRIPTOR_VARIANTS or triton_compat.tensor_descriptors() is None)
               and (k not in WARP_SPECIALIZED_VARIANTS or triton_compat.warp_specialization())]
    block = tk.padded_head_dim(head_dim)
    specializable = tk.warp_specialization_refusal(dict(BLOCK_DQK=block, BLOCK_DV=block)) is None
    described = target in DESCRIPTOR_TARGETS and not tk.call_refusals(getattr(torch, dtype), paged=False, packed=False)
    if head_dim > triton_decode.MAX_HEAD_DIM:
        offered = [k for k in offered if not base_kernel(k).startswith("decode")]
    return tuple(k for k in offered if k not in DESCRIPTOR_VARIANTS or (
        described and (specializable or k not in WARP_SPECIALIZED_VARIANTS)))


# FUSED_ATTN_STATIC_REPORT=sample (what `make test` sets): each (kernel, variant, target) compiled at one of its
# (dtype, head dim) shapes instead of at every one, the shapes taken in turn, so that the sample still meets each
# shape: a fifth of the compilations (the whole report, 880 of them with the CUDA report beside, took 25 CPU minutes of
# the suite's run on this project's 2-core machines). `make test-full` and `make test-triton` compile all of them.
SAMPLE_VARIABLE = "FUSED_ATTN_STATIC_REPORT"


def sampled() -> bool:
    """Whether the report compiles the sample (SAMPLE_VARIABLE=sample) rather than every row (=full, the default)."""
    value = os.environ.get(SAMPLE_VARIABLE, "full")
    if value not in ("full", "sample"):
        raise ValueError(f"{SAMPLE_VARIABLE}: expected full or sample, got {value!r}")
    return value == "sample"


def combinations(targets=tuple(TARGETS), dtypes=DTYPES, head_dims=HEAD_DIMS, only=KERNELS, wider=None, sample=None):
    """(kernel, target, dtype, head dim, causal, dropout, bias_grad, scores) of every report row: each target's
    kernels in `dtypes` at `head_dims`, and on WIDER_TARGETS at the (dtype, head dim) pairs of `wider` too (None:
    `wider_shapes()`); with `sample` (None: `sampled()`), each (kernel, variant) of a target at one of those shapes,
    the i-th of a target's (kernel, variant) pairs at its i-th shape (modulo their number), whichever other targets
    are asked for."""
    wider = wider_shapes() if wider is None else wider
    sample = sampled() if sample is None else sample
    for target in targets:
        shapes = [*itertools.product(dtypes, head_dims), *(wider if target in WIDER_TARGETS else ())]
        rows = [(kernel, target, dtype, head_dim, *variant) for dtype, head_dim in dict.fromkeys(shapes)
                for kernel in kernels(target, dtype, head_dim) if kernel in only for variant in variants(kernel)]
        if not sample:
            yield from rows
            continue
        at_shapes = {}  # (kernel, *variant): its rows, in the order of the shapes
        for row in rows:
            at_shapes.setdefault((row[0], *row[4:]), []).append(row)
        yield from (group[index % len(group)] for index, group in enumerate(at_shapes.values()))


# Kernels launched at a fixed config rather than a default of triton_kernels' tables.
FIXED_CONFIG = "BLOCK_M={block_m},{block_n}warps={warps},stages={stages}"
# (causal, dropout, bias_grad, scores) variants of the kernels with products; the preprocess depends on
# none but the packing. bias_grad (an additive mask whose gradient dK/dV writes) changes the dK/dV kernel
# only; scores True is every score variant at once (window, bottom-right alignment, softcap, ALiBi, sinks)
# and key padding, "packed" every score variant over a packed batch of sequences (fused_attn.varlen), "paged"
# every score variant and key padding over a paged key/value cache (fused_attn.kvcache, the forward only),
# "program" every score variant and key padding with a mask program (fused_attn.masks; HAS_PROGRAM);
# "paged_int8" and "paged_fp8" as "paged" over an 8-bit cache (fused_attn.quantization) with a scale per stored key,
# int8 or float8_e4m3fn (as its bits on sm_80, which has no fp8 type; as that type on sm_90; KV8, TOKEN_SCALES),
# "paged_fp8_seq" float8_e4m3fn with a scale per sequence.
# Sinks change the forward kernels' epilogue and the decode combine only (HAS_SINKS); the backward kernels
# and the split-KV decode kernel take none (they compile as without them).
PACKED = "packed"
PAGED = "paged"
PROGRAM = "program"
PAGED_INT8 = "paged_int8"
PAGED_FP8 = "paged_fp8"
PAGED_FP8_SEQUENCES = "paged_fp8_seq"
# The paged caches: the dtype of their blocks (None: the query's) and their scales' layout.
PAGED_CACHES = {PAGED: (None, None), PAGED_INT8: ("int8", "token"), PAGED_FP8: ("float8_e4m3fn", "token"),
                PAGED_FP8_SEQUENCES: ("float8_e4m3fn", "sequence")}
# Causal, no dropout, every score variant, over a paged cache of each kind.
PAGED_VARIANTS = tuple((True, False, False, cache) for cache in PAGED_CACHES)
PAGE_SIZE = 16  # vLLM's block size: keys of one tile come from several blocks
VARIANTS = ((False, False, False, False), (True, False, False, False), (True, True, False, False),
            (True, False, False, True), (True, True, False, PACKED))
# The kernels that read a mask program (forward, dK/dV, dQ), causal with it, without and with dropout.
PROGRAM_VARIANTS = ((True, False, False, PROGRAM), (True, True, False, PROGRAM))


def base_kernel(kernel: str) -> str:
    """The kernel a report row compiles: a descriptor variant's, or the row's own."""
    return DESCRIPTOR_VARIANTS[kernel][0] if kernel in DESCRIPTOR_VARIANTS else kernel


def variants(kernel: str) -> tuple[tuple[bool, bool, bool, bool | str], ...]:
    if kernel in WARP_SPECIALIZED_VARIANTS:  # what the autotuner offers them for (triton_kernels.warp_specializable)
        return VARIANTS[:2] if base_kernel(kernel) == "decode" else VARIANTS[:3]  # the decode takes no dropout
    if kernel in DESCRIPTOR_VARIANTS:  # what a descriptor serves: no packed batch, no paged cache
        return tuple(v for v in variants(base_kernel(kernel)) if v[3] not in (PACKED, *PAGED_CACHES))
    if kernel == "bwd_dkdv":
        return (*VARIANTS, (True, True, True, False), (True, True, True, True), *PROGRAM_VARIANTS)
    if kernel == "decode":  # no dropout (calls with dropout take the long-query kernels), no packing
        return ((False, False, False, False), (True, False, False, True), *PAGED_VARIANTS)
    if kernel == "decode_combine":  # the score variants: the sinks, the only one the combine reads
        return ((False, False, False, False), (False, False, False, True))
    if kernel == "fwd":
        return (*VARIANTS, *PAGED_VARIANTS, *PROGRAM_VARIANTS)
    if kernel == "bwd_dq":
        return (*VARIANTS, *PROGRAM_VARIANTS)
    return ((False, False, False, False), (False, False, False, PACKED))


def report(targets=tuple(TARGETS), dtypes=DTYPES, head_dims=HEAD_DIMS, only=KERNELS, wider=None,
           timeout=1800) -> list[dict]:
    """One dict per (kernel, target, dtype, head dim, causal, dropout, bias_grad, scores): resources,
    instructions, verdict.

    Keys: backend, kernel, target, dtype, head_dim, causal, dropout, bias_grad, scores, config, cubin_arch (the
    architecture the cubin's SASS names: sm_90a for target sm_90, sm_100a for sm_100), registers, spill_bytes,
    stack_bytes, shared_bytes, tensor_core_instructions ({mnemonic: count}), fits, problems.
    """
    # One child process per target, at the same time (the compilations are independent).
    wider = wider_shapes() if wider is None else wider
    with tempfile.TemporaryDirectory(prefix="fused_attn_triton_cache_") as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=cache, TRITON_DEFAULT_FP_FUSION="1")
        root = Path(__file__).resolve().parent.parent
        children = [subprocess.Popen([sys.executable, "-m", "bench.triton_report", "--json", "--targets", target,
                                      "--dtypes", *dtypes, "--head-dims", *(str(d) for d in head_dims),
                                      "--kernels", *only, "--wider", *(f"{d}:{h}" for d, h in wider)],
                                     env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for target in targets]
        rows = []
        for child in children:
            try:
                stdout, stderr = child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other in children:
                    other.kill()
                raise RuntimeError(f"bench.triton_report took more than {timeout} s") from None
            if child.returncode != 0:
                raise RuntimeError(f"bench.triton_report failed ({child.returncode}):\n{stderr[-4000:]}")
            rows += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        return rows


def _signature(fn, args, constexprs):
    """The signature, constants and attributes a launch with `args` would compile `fn` with."""
    from triton.backends.compiler import BaseBackend

    from fused_attn.backends import triton_compat

    specialize = triton_compat.specializer()
    signature, constants, attrs = {}, {}, {}
    positional = iter(args)
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name], constants[name] = "constexpr", constexprs[name]
            continue
        kind, attribute = specialize(next(positional))
        if kind == "constexpr":  # an integer 1 is specialised into the code
            signature[name], constants[name] = "constexpr", attribute
            continue
        signature[name] = kind
        attrs[(index,)] = BaseBackend.parse_attr(attribute or "")
    return signature, constants, attrs


def _fixed(constexprs, warps, stages, block_n=True):
    """(config text, compile options) of a kernel launched at a fixed config."""
    text = FIXED_CONFIG.format(block_m=constexprs["BLOCK_M"], warps=warps, stages=stages,
                               block_n=f"BLOCK_N={constexprs['BLOCK_N']}," if block_n else "")
    return text, {"num_warps": warps, "num_stages": stages}


def _representative_call(kernel, dtype_name, head_dim, causal, dropout, bias_grad, scores, target):
    """(kernel fn, args, constexprs, fixed config or None, dtype) for one report row on `target`: the preprocess
    and the decode kernels come with their fixed (text, options); the other kernels take their default
    one in `_compile_row`."""
    import torch
    from fused_attn import masks
    from fused_attn.backends import triton_decode
    from fused_attn.backends import triton_kernels as tk
    from fused_attn.dropout import Dropout
    from fused_attn.problem import output_like
    from fused_attn.scores import PLAIN, ScoreVariant

    dtype = getattr(torch, dtype_name)
    batch, heads, length = 2, 4, 256
    packed = scores == PACKED
    # (B, L, H, D) storage viewed as (B, H, L, D): heads split out of (B, L, E) projections; packed,
    # (total, H, D) tensors viewed as (B, H, total, D) with a batch stride of 0, as a launch sees them.
    def tensor():
        if packed:
            return tk.batched(torch.empty(batch * length, heads, head_dim, dtype=dtype), batch)
        return torch.empty(batch, length, heads, head_dim, dtype=dtype).permute(0, 2, 1, 3)
    q, k, v, grad_out = tensor(), tensor(), tensor(), tensor()
    out = tensor() if packed else output_like(q, head_dim, seq_first=False)
    if packed:
        lse = torch.empty(heads, batch * length, dtype=torch.float32).expand(batch, -1, -1)
        delta = torch.empty(heads, batch * length, dtype=torch.float32).expand(batch, -1, -1)
        bounds = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)
        sequences = tk.Sequences(bounds, bounds, length, length)
    else:
        lse = torch.empty(batch, heads, length, dtype=torch.float32)
        delta = torch.empty_like(lse)
        sequences = None
    scale = head_dim ** -0.5
    # A threshold above 2^31, as dropout_p = 0.6 gives: the 64-bit integer argument.
    drop = Dropout(0.6, torch.tensor([2 ** 40 + 7, 3])) if dropout else None
    # A learned (1, H, L, L) bias, broadcast over the batch, and its dense gradient.
    bias = torch.empty(1, heads, length, length, dtype=dtype).expand(batch, -1, -1, -1) if bias_grad else None
    grad_bias = torch.empty(batch, heads, length, length, dtype=dtype) if bias_grad else None
    # Every score variant at once: a bottom-right window, a softcap, ALiBi slopes (B, H_q), sinks (H_q,);
    # with them, key padding and its per-row span of keys.
    variant = (ScoreVariant(bottom_right=True, window_left=128, window_right=0, softcap=30.0,
                            alibi_slopes=torch.empty(batch, heads), sinks=torch.empty(heads)) if scores else PLAIN)
    if scores == PROGRAM:  # tile states shared by the batch and heads (stride 0), as masks.documents' ids (L,) give
        tiles = -(-length // masks.TILE)
        variant = dataclasses.replace(variant,
                                      block_tiles=torch.empty(1, 1, tiles, tiles, dtype=torch.int32).expand(
                                          batch, heads, -1, -1),
                                      block_bits=torch.empty(tiles, masks.TILE, masks.WORDS, dtype=torch.int32))
    padding = torch.zeros(batch, length, dtype=torch.bool) if scores in (True, PROGRAM, *PAGED_CACHES) else None
    pages = None
    if scores in PAGED_CACHES:  # the cache's blocks in a table, as (num_blocks, H, block_size, D) views
        blocks = batch * length // PAGE_SIZE
        cache_name, layout = PAGED_CACHES[scores]
        cache_dtype = getattr(torch, cache_name or dtype_name)
        fp8_type = capability(target) >= tk.FP8_CAPABILITY
        k, v = (tk.cache_blocks(torch.empty(blocks, PAGE_SIZE, heads, head_dim, dtype=cache_dtype), fp8_type)
                for _ in range(2))
        # An 8-bit cache's scales: one per stored key and head, (num_blocks, block_size, H_kv), or per sequence.
        scales = []
        if layout is not None:
            scales = [torch.empty((blocks, PAGE_SIZE, heads) if layout == "token" else (batch, heads))
                      for _ in range(2)]
        pages = tk.Pages(torch.empty(batch, length // PAGE_SIZE, dtype=torch.int32), PAGE_SIZE, *scales)
    if base_kernel(kernel) in triton_decode.KERNELS:  # one query row per head against the keys, in 4 splits
        q1 = q[:, :, :1]
        part_o, part_lse = triton_decode.workspace(q1, k, v, 4)
        if base_kernel(kernel) == "decode":
            args, constexprs = triton_decode.decode_args(q1, k, v, None, padding, causal, scale, variant, 4,
                                                         part_o, part_lse, pages)
            _check_served(kernel, dict(key=k, value=v), pages, None)
            switches = DESCRIPTOR_VARIANTS[kernel][1] if kernel in DESCRIPTOR_VARIANTS else {}
            constexprs.update(DESCRIPTORS=switches.get("descriptors", False),
                              WARP_SPECIALIZE=switches.get("warp_specialize", False))
            fixed = _fixed(constexprs, triton_decode.DECODE_WARPS, triton_decode.DECODE_STAGES)
        else:
            args, constexprs = triton_decode.combine_args(part_o, part_lse, out[:, :, :1], lse[:, :, :1], heads, 4,
                                                          variant)
            fixed = _fixed(constexprs, triton_decode.COMBINE_WARPS, 1, block_n=False)
        return triton_decode.KERNELS[base_kernel(kernel)], args, constexprs, fixed, dtype
    if base_kernel(kernel) == "fwd":
        args, constexprs = tk.forward_args(q, k, v, None, padding, causal, scale, out, lse, drop, variant, sequences,
                                           pages)
        _check_served(kernel, dict(query=q, key=k, value=v, out=out), pages, sequences)
        return tk.KERNELS["fwd"], args, constexprs, None, dtype
    elif kernel == "bwd_preprocess":
        args, constexprs = tk.preprocess_args(out, grad_out, None, delta, sequences)
        return tk.KERNELS[kernel], args, constexprs, _fixed(constexprs, tk.PREPROCESS_WARPS, 1, block_n=False), dtype
    else:
        def gradient(like):  # laid out as a launch lays out its gradients
            return tensor() if packed else torch.empty_like(like)
        base = base_kernel(kernel)
        grads = (gradient(q), gradient(k), gradient(v))
        _check_served(kernel, tk.backward_tensors(q, k, v, grad_out, grads), None, sequences)
        args, constexprs = tk.backward_args(base, q, k, v, bias, padding, causal, scale, grad_out, lse, delta,
                                            grads[1:] if base == "bwd_dkdv" else grads[:1], drop, grad_bias, variant,
                                            sequences)
        return tk.KERNELS[base], args, constexprs, None, dtype


def _check_served(kernel, tensors, pages, sequences):
    """A descriptor variant's row must be of a call the variant serves (`descriptor_refusals`)."""
    from fused_attn.backends import triton_kernels as tk

    if kernel in DESCRIPTOR_VARIANTS and (refusals := tk.descriptor_refusals(tensors, pages, sequences)):
        raise ValueError(f"{kernel}: the representative call is one it cannot serve: {refusals}")


def _inspect(cubin: Path, metadata: dict, target: str, needs_tensor_cores: bool, kernel: str = "fwd",
             config: str = "BLOCK_M=64,BLOCK_N=64") -> dict:
    tool = gpu_binaries.find_cuobjdump()
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout

    def field(name):
        found = re.search(rf"\b{name}:(\d+)", usage)
        return int(found.group(1)) if found else 0

    opcodes = gpu_binaries.SASS_INSTRUCTION.findall(sass)
    built = gpu_binaries.SASS_ARCHITECTURE.search(sass)
    tensor_core, tma = {}, {}
    local_accesses = 0
    for opcode in opcodes:
        base = opcode.split(".")[0]
        if "MMA" in base:  # HMMA, HGMMA, IMMA, and Blackwell's UTC*MMA (tcgen05.mma)
            tensor_core[opcode] = tensor_core.get(opcode, 0) + 1
        if base.startswith("UTMA"):  # the tensor memory accelerator: UTMALDG loads, UTMASTG stores, ...
            tma[base] = tma.get(base, 0) + 1
        if base in ("LDL", "STL"):
            local_accesses += 1
    row = {
        "cubin_arch": built.group(1) if built else None,
        "registers": field("REG"),
        "spill_bytes": field("LOCAL"),
        "stack_bytes": field("STACK"),
        "shared_bytes": int(metadata.get("shared", 0)) + field("SHARED"),
        "tensor_core_instructions": tensor_core,
        "tma_instructions": tma,
        "instructions": len(opcodes),
    }
    problems = gpu_binaries.resource_problems(target, row["spill_bytes"], row["stack_bytes"], row["shared_bytes"],
                                              local_accesses)
    if not opcodes:
        problems.append("no SASS instructions found in the cubin")
    # Triton builds sm_90 and sm_100 as their architecture-specific sm_90a and sm_100a (wgmma, tcgen05.mma).
    if row["cubin_arch"] is None or not re.fullmatch(rf"{target}a?", row["cubin_arch"]):
        problems.append(f"the cubin is built for {row['cubin_arch'] or 'no architecture its SASS names'}, not {target}")
    prefix = tensor_core_prefix(kernel, target, config)
    if needs_tensor_cores and not any(op.split(".")[0] == prefix for op in tensor_core):
        problems.append(f"no {prefix} instructions (found {sorted(tensor_core) or 'none'})")
    if kernel in DESCRIPTOR_VARIANTS and "UTMALDG" not in tma:
        problems.append(f"no TMA loads (UTMALDG; found {sorted(tma) or 'none'})")
    if kernel in DESCRIPTOR_VARIANTS and "UTMASTG" not in tma:
        problems.append(f"no TMA stores (UTMASTG; found {sorted(tma) or 'none'})")
    row["problems"] = problems
    return row


def _compile_row(kernel, target, dtype_name, head_dim, causal, dropout, bias_grad, scores, config=None) -> dict:
    """Compiles one kernel at `config` (a KernelConfig; None: its default, or the fixed config of the preprocess and
    the decode kernels) and inspects it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fused_attn.backends import triton_kernels as tk

    fn, args, constexprs, fixed, dtype = _representative_call(kernel, dtype_name, head_dim, causal,
                                                              dropout, bias_grad, scores, target)
    if fixed is None:
        base = base_kernel(kernel)
        config = config or tk.default_config(base, config_arch(target), tk.padded_head_dim(head_dim), dtype.itemsize,
                                             constexprs)
        config = dataclasses.replace(config, **DESCRIPTOR_VARIANTS[kernel][1] if kernel in DESCRIPTOR_VARIANTS else {})
        constexprs = dict(constexprs, **config.constexprs(base))
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        config_text = str(config)
    else:
        config_text, options = fixed
    row = {"backend": "triton", "kernel": kernel, "target": target, "dtype": dtype_name,
           "head_dim": head_dim, "causal": causal, "dropout": dropout, "bias_grad": bias_grad, "scores": scores,
           "config": config_text}
    signature, constants, attrs = _signature(fn, args, constexprs)
    try:
        compiled = triton.compile(ASTSource(fn, signature, constants, attrs),
                                  target=GPUTarget("cuda", TARGETS[target], 32), options=options)
    except Exception as error:  # a config that does not compile is a reported failure, not a crash
        message = str(error).strip().splitlines()
        return dict(row, cubin_arch=None, registers=0, spill_bytes=0, stack_bytes=0, shared_bytes=0,
                    tensor_core_instructions={}, tma_instructions={}, global_scratch_bytes=0, warp_specialized=False,
                    launch_warps=0, fits=False,
                    problems=[f"does not compile: {type(error).__name__}: {message[-1] if message else ''}"])
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / f"{kernel}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        metadata = {"shared": compiled.metadata.shared}
        # fp32 products in full precision ("ieee", PyTorch's default) run on FMA units by design.
        exact_fp32 = constexprs.get("PRECISION") == "ieee" and dtype_name == "float32"
        row.update(_inspect(cubin, metadata, target, kernel in MATMUL_KERNELS and not exact_fp32, kernel, config_text))
    # Global memory each program needs at launch (tensor descriptors made on the device), from the allocator.
    row["global_scratch_bytes"] = int(getattr(compiled.metadata, "global_scratch_size", 0) or 0)
    # Whether Triton split a loop into warp-specialized partitions (its TTGIR holds the op), and the warps the
    # launch then takes: num_warps plus the partitions'.
    row["warp_specialized"] = WARP_SPECIALIZE_OP.search(compiled.asm.get("ttgir", "")) is not None
    row["launch_warps"] = int(compiled.metadata.num_warps)
    row["fits"] = not row["problems"]
    return row


def _rows(targets, dtypes, head_dims, only=KERNELS, wider=None):
    for kernel, target, *rest in combinations(targets, dtypes, head_dims, only, wider):
        yield _compile_row(kernel, target, *rest)


def _shape(text: str) -> tuple[str, int]:
    """"float32:128" -> ("float32", 128)."""
    dtype, _, head_dim = text.partition(":")
    if dtype not in (*DTYPES, "float32") or not head_dim.isdigit():
        raise argparse.ArgumentTypeError(f"expected DTYPE:HEAD_DIM with DTYPE one of {DTYPES + ('float32',)}, got "
                                         f"{text!r}")
    return dtype, int(head_dim)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="compile here and print one JSON row per line")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=[*DTYPES, "float32"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS),
                        help="only these kernels (each on the targets it is compiled for)")
    parser.add_argument("--wider", nargs="*", type=_shape, metavar="DTYPE:HEAD_DIM",
                        help=f"also these on {', '.join(WIDER_TARGETS)} (default: "
                             f"{' '.join(f'{d}:{h}' for d, h in WIDER)} from Triton "
                             f"{'.'.join(map(str, WIDER_FROM))} on; none if given without one)")
    options = parser.parse_args(argv)
    if options.json:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            parser.error("--json compiles for the GPU: unset TRITON_INTERPRET")
        for row in _rows(options.targets, options.dtypes, options.head_dims, options.kernels, options.wider):
            print(json.dumps(row), flush=True)
        return 0
    rows = report(options.targets, options.dtypes, options.head_dims, options.kernels, options.wider)
    print(format_table(rows))
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
