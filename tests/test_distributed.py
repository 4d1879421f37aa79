"""Ring attention (fused_attn.distributed) against the single-device definition.

The plans are checked in-process against brute-force visibility. The ring itself runs in 2 and 4
gloo processes spawned per world size; each process runs every case of its world size, rank 0
saves the gathered results, and each case is then checked here by the project's criterion against
the float64 and same-dtype references of the full sequence. Every collective has a timeout and the
parent a deadline, so a failing or stuck rank ends the test with its error instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import ring_bench
from fused_attn import distributed
from fused_attn.testing import Case, Results, check_inputs, random_inputs

COLLECTIVE_TIMEOUT_S = 30.0
PARENT_DEADLINE_S = 90.0


# ---------------------------------------------------------------------------------------------------
# Running functions in a ring of processes
# ---------------------------------------------------------------------------------------------------

def run_in_ring(world: int, function, *args) -> None:
    """function(rank, world, *args) in `world` gloo processes: the first failure is re-raised (the
    other ranks terminated), and the test fails after PARENT_DEADLINE_S instead of hanging."""
    try:
        ring_bench.run_processes(world, function, args, deadline_s=PARENT_DEADLINE_S,
                                 collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    except TimeoutError as error:
        pytest.fail(str(error))


# ---------------------------------------------------------------------------------------------------
# Cases: each one forward and backward, gathered and compared with the full-sequence reference
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RingCase:
    case: Case
    dtype: torch.dtype
    layout: str
    rotation: int = 0  # which of testing.LAYOUTS each full tensor is laid out in
    backend: str | None = None


def _case(length, layout, dtype, rotation=0, backend=None, **features):
    features.setdefault("len_k", length)
    return RingCase(Case(batch=2, len_q=length, dim_qk=16, **features), dtype, layout, rotation, backend)


# Lengths are chosen so that shards (and zigzag's chunks) have odd lengths.
CASES = {
    2: {
        "contiguous_fp32_gqa_padding_lse_grad": _case(14, "contiguous", torch.float32, 0, heads_q=4, heads_kv=2,
                                                      key_padding=True, lse_grad=True, scale=0.3),
        "contiguous_fp32_causal": _case(14, "contiguous", torch.float32, 1, is_causal=True),
        "zigzag_fp32_causal_padding_lse_grad": _case(20, "zigzag", torch.float32, 2, is_causal=True,
                                                     key_padding=True, lse_grad=True),
        "zigzag_bf16_causal_gqa": _case(36, "zigzag", torch.bfloat16, 3, is_causal=True, heads_q=4, heads_kv=1),
        "contiguous_bf16": _case(22, "contiguous", torch.bfloat16, 4, dim_v=8),
        "zigzag_fp32_causal_window_softcap": _case(28, "zigzag", torch.float32, 0, is_causal=True, window=(5, 0),
                                                   softcap=2.0),
        "contiguous_fp64_window": _case(18, "contiguous", torch.float64, 1, window=(3, 4)),
        "zigzag_fp64_hidden_rows": _case(12, "zigzag", torch.float64, 2, key_padding=True, hidden_rows=True),
        "contiguous_fp32_cross_bottom_right": _case(10, "contiguous", torch.float32, 3, len_k=14, is_causal=True,
                                                    causal_alignment="bottom_right", key_padding=True),
        "zigzag_fp32_cross_top_left": _case(12, "zigzag", torch.float32, 4, len_k=20, is_causal=True),
        # Dropout and ALiBi: one call per chunk pair, at its global positions.
        "zigzag_fp32_causal_dropout_alibi_padding": _case(20, "zigzag", torch.float32, 1, is_causal=True,
                                                          dropout_p=0.3, alibi="heads", key_padding=True,
                                                          lse_grad=True),
        "contiguous_bf16_dropout_gqa": _case(22, "contiguous", torch.bfloat16, 2, dropout_p=0.2, heads_q=4,
                                             heads_kv=2),
        "zigzag_fp64_cross_bottom_right_alibi_window_softcap": _case(12, "zigzag", torch.float64, 3, len_k=20,
                                                                     is_causal=True, causal_alignment="bottom_right",
                                                                     window=(6, 0), alibi="batch", softcap=2.0),
        "contiguous_fp32_window_both_sides_alibi_dropout": _case(18, "contiguous", torch.float32, 4, window=(3, 4),
                                                                 alibi="heads", dropout_p=0.25),
        # Each step's backward takes its share of the whole row's softmax on every backend.
        "zigzag_fp64_reference_causal_dropout_alibi": _case(12, "zigzag", torch.float64, 0, "reference",
                                                            is_causal=True, dropout_p=0.2, alibi="heads"),
        "contiguous_fp32_triton_causal_dropout_alibi": _case(10, "contiguous", torch.float32, 1, "triton",
                                                             is_causal=True, dropout_p=0.2, alibi="heads"),
        # Sinks join each row once, after every rank's keys; their gradient summed over the ranks.
        "zigzag_fp32_causal_sinks_gqa_padding_lse_grad": _case(20, "zigzag", torch.float32, 2, is_causal=True,
                                                               sinks=True, heads_q=4, heads_kv=2, key_padding=True,
                                                               lse_grad=True),
        "contiguous_bf16_sinks_window_dropout_alibi": _case(18, "contiguous", torch.bfloat16, 3, window=(3, 4),
                                                            sinks=True, dropout_p=0.2, alibi="heads"),
        "zigzag_fp64_sinks_hidden_rows": _case(12, "zigzag", torch.float64, 4, key_padding=True, hidden_rows=True,
                                               sinks=True),
    },
    4: {
        "zigzag_fp32_causal_gqa_padding_lse_grad": _case(24, "zigzag", torch.float32, 0, is_causal=True,
                                                         heads_q=4, heads_kv=2, key_padding=True, lse_grad=True),
        "contiguous_bf16_causal_window": _case(20, "contiguous", torch.bfloat16, 1, is_causal=True, window=(6, 0)),
        "zigzag_bf16": _case(40, "zigzag", torch.bfloat16, 2),
        "contiguous_fp32_window_both_sides": _case(36, "contiguous", torch.float32, 3, window=(4, 7)),
        "zigzag_fp32_causal_dropout_alibi_gqa": _case(24, "zigzag", torch.float32, 0, is_causal=True, dropout_p=0.2,
                                                      alibi="batch", heads_q=4, heads_kv=2, lse_grad=True),
        "contiguous_fp32_causal_sinks_softcap": _case(20, "contiguous", torch.float32, 1, is_causal=True, sinks=True,
                                                      softcap=2.0, lse_grad=True),
    },
}


def _inputs(name: str, ring_case: RingCase):
    seed = sum(map(ord, name))  # fixed per case: the parent regenerates exactly what the ranks used
    generator = torch.Generator().manual_seed(seed)
    return random_inputs(ring_case.case, ring_case.dtype, ring_case.rotation, generator)


def _run_case(name: str, ring_case: RingCase, rank: int, out_dir: str) -> None:
    inputs = _inputs(name, ring_case)
    layout, case = ring_case.layout, ring_case.case

    def local(tensor, dim=2):
        return None if tensor is None else distributed.shard(tensor, layout, dim=dim)

    q, k, v = (local(t).detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    keywords = inputs.variant_keywords()
    wrt = [q, k, v]
    if inputs.sinks is not None:
        keywords["sinks"] = inputs.sinks.detach().requires_grad_()
        wrt.append(keywords["sinks"])
    # Every rank's generator is seeded alike; rank 0's draw is the ring's seed, the reference's too.
    out, lse = distributed.ring_attention(
        q, k, v, is_causal=case.is_causal, layout=layout, scale=case.scale,
        enable_gqa=case.heads_q != case.heads_kv, key_padding_mask=local(inputs.key_padding_mask, dim=1),
        dropout_p=case.dropout_p, generator=inputs.dropout_generator(), return_lse=True,
        backend=ring_case.backend, **keywords)
    outputs, grads_in = [out], [local(inputs.grad_out)]
    if inputs.grad_lse is not None:
        outputs.append(lse)
        grads_in.append(local(inputs.grad_lse))
    grads = torch.autograd.grad(outputs, wrt, grads_in)
    gathered = [distributed.gather(t, layout) for t in (out, lse, *grads[:3])]
    if inputs.sinks is not None:  # each rank's share of a replicated parameter's gradient, summed
        grad_sinks = grads[3].clone()
        dist.all_reduce(grad_sinks)
        gathered += [None, grad_sinks]
    if rank == 0:
        torch.save(gathered, os.path.join(out_dir, f"{name}.pt"))


def _run_cases(rank: int, world: int, out_dir: str) -> None:
    for name, ring_case in CASES[world].items():
        _run_case(name, ring_case, rank, out_dir)


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """{world: directory of gathered results}, each world's ring run once, on first use."""
    directories = {}

    def results_of(world: int):
        if world not in directories:
            directory = tmp_path_factory.mktemp(f"ring{world}")
            run_in_ring(world, _run_cases, str(directory))
            directories[world] = directory
        return directories[world]

    return results_of


@pytest.mark.parametrize("world, name", [
    pytest.param(world, name, marks=[pytest.mark.slow] if world == 4 else [])
    for world, cases in CASES.items() for name in cases])
def test_ring_matches_single_device(ring_results, world, name):
    ring_case = CASES[world][name]
    saved = torch.load(ring_results(world) / f"{name}.pt")
    check_inputs(Results(*saved), _inputs(name, ring_case))


# ---------------------------------------------------------------------------------------------------
# Failures end the test, never hang it
# ---------------------------------------------------------------------------------------------------

def _fail_on_one_rank(rank: int, world: int) -> None:
    x = torch.randn(1, 2, 6, 8)
    if rank == 1:
        raise RuntimeError("rank 1 gives up before the ring")
    distributed.ring_attention(x, x, x)  # rank 0 waits for a block that never comes


def test_a_failing_rank_ends_the_test_with_its_error(tmp_path):
    started = time.monotonic()
    # Whichever rank's exit the parent sees first: the failure itself, or the peer that lost it.
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 gives up before the ring|remote worker"):
        run_in_ring(2, _fail_on_one_rank)
    assert time.monotonic() - started < PARENT_DEADLINE_S


# ---------------------------------------------------------------------------------------------------
# Plans, checked in-process against brute-force visibility
# ---------------------------------------------------------------------------------------------------

def _visible(parts, len_q, len_k) -> torch.Tensor:
    """How many parts cover each (query, key) score of a step, counting only visible ones."""
    covered = torch.zeros(len_q, len_k, dtype=torch.int64)
    for part in parts:
        i = torch.arange(part.q1 - part.q0)[:, None]
        j = torch.arange(part.k1 - part.k0)[None, :]
        visible = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        if part.left is not None:
            visible &= j - i >= -part.left
        if part.right is not None:
            visible &= j - i <= part.right
        covered[part.q0:part.q1, part.k0:part.k1] += visible
    return covered


def _positions(layout, rank, world, local_length) -> torch.Tensor:
    return torch.cat([torch.arange(c.start, c.start + c.length)
                      for c in distributed.rank_chunks(layout, rank, world, local_length)])


PLAN_SETTINGS = [
    dict(low=None, high=None), dict(low=None, high=0), dict(low=-3, high=0), dict(low=-4, high=6),
    dict(low=None, high=5), dict(low=2, high=9), dict(low=-9, high=-2),
]


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_chunk_pair"])
@pytest.mark.parametrize("layout", distributed.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("lengths", [(6, 6), (10, 10), (6, 14)])
def test_plans_cover_each_visible_score_once(layout, world, lengths, merge):
    """Without merging (ALiBi, dropout), every part also knows where its block starts globally."""
    len_q, len_k = lengths
    for band in PLAN_SETTINGS:
        low, high = band["low"], band["high"]
        for rank in range(world):
            queries = _positions(layout, rank, world, len_q)
            for step in range(world):
                source = (rank - step) % world
                keys = _positions(layout, source, world, len_k)
                distance = keys[None, :] - queries[:, None]
                expected = torch.ones_like(distance, dtype=torch.bool)
                if low is not None:
                    expected &= distance >= low
                if high is not None:
                    expected &= distance <= high
                parts = distributed.plan_step(low, high, distributed.rank_chunks(layout, rank, world, len_q),
                                              distributed.rank_chunks(layout, source, world, len_k), merge)
                assert torch.equal(_visible(parts, len_q, len_k), expected.long()), (band, rank, step)
                for part in parts if not merge else ():
                    # One chunk pair: local rows and keys are consecutive global positions from the starts.
                    assert torch.equal(queries[part.q0:part.q1], torch.arange(part.q_start, part.q_start + part.q1 - part.q0))
                    assert torch.equal(keys[part.k0:part.k1], torch.arange(part.k_start, part.k_start + part.k1 - part.k0))


def test_zigzag_gives_every_rank_the_same_causal_work():
    world, local_length = 4, 8
    work = {}
    for layout in distributed.LAYOUTS:
        work[layout] = []
        for rank in range(world):
            plans = [distributed.plan_step(None, 0, distributed.rank_chunks(layout, rank, world, local_length),
                                           distributed.rank_chunks(layout, (rank - s) % world, world, local_length))
                     for s in range(world)]
            work[layout].append(sum(int(_visible(parts, local_length, local_length).sum()) for parts in plans))
    assert len(set(work["zigzag"])) == 1
    assert work["contiguous"][-1] > 3 * work["contiguous"][0]
    # Zigzag's off-diagonal steps are one kernel call each, its own block one causal call.
    own = distributed.plan_step(None, 0, distributed.rank_chunks("zigzag", 1, world, 8),
                                distributed.rank_chunks("zigzag", 1, world, 8))
    assert own == [distributed.Part(0, 8, 0, 8, None, 0)]
    for source in (0, 2):
        assert len(distributed.plan_step(None, 0, distributed.rank_chunks("zigzag", 1, world, 8),
                                         distributed.rank_chunks("zigzag", source, world, 8))) == 1


# ---------------------------------------------------------------------------------------------------
# Arguments, in a one-process group
# ---------------------------------------------------------------------------------------------------

@pytest.fixture
def one_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.ring_attention(x, x, x)


def test_one_rank_is_the_single_device_call(one_process_group):
    import fused_attn

    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 10, 8, generator=generator) for _ in range(3))
    for layout in distributed.LAYOUTS:
        out, lse = distributed.ring_attention(q, k, v, is_causal=True, layout=layout, return_lse=True)
        expected, expected_lse = fused_attn.attention(q, k, v, is_causal=True, return_lse=True)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(lse, expected_lse)
        assert torch.equal(distributed.gather(distributed.shard(q, layout), layout), q)


def test_one_rank_with_dropout_and_alibi_is_the_single_device_call(one_process_group):
    import fused_attn

    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=generator) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25])
    for layout in distributed.LAYOUTS:
        out = distributed.ring_attention(q, k, v, is_causal=True, layout=layout, dropout_p=0.3, alibi_slopes=slopes,
                                         generator=torch.Generator().manual_seed(9))
        expected = fused_attn.attention(q, k, v, is_causal=True, dropout_p=0.3, alibi_slopes=slopes,
                                        generator=torch.Generator().manual_seed(9))
        torch.testing.assert_close(out, expected)


def test_refusals_name_the_argument(one_process_group):
    x = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="dropout_p: expected a number in"):
        distributed.ring_attention(x, x, x, dropout_p=1.5)
    with pytest.raises(ValueError, match="alibi_slopes: expected shape"):
        distributed.ring_attention(x, x, x, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="layout: expected one of"):
        distributed.ring_attention(x, x, x, layout="striped")
    with pytest.raises(ValueError, match="query: layout='zigzag' needs an even local length"):
        distributed.ring_attention(x[:, :, :5], x[:, :, :5], x[:, :, :5], layout="zigzag")
    with pytest.raises(ValueError, match="must be a multiple of 2 for layout='zigzag'"):
        distributed.shard(x[:, :, :5], "zigzag")
    with pytest.raises(ValueError, match="key: expected 2 heads"):
        distributed.ring_attention(x, x[:, :1], x[:, :1])


# ---------------------------------------------------------------------------------------------------
# The benchmark, on a tiny problem
# ---------------------------------------------------------------------------------------------------

def test_ring_bench_measures_time_and_traffic():
    rows = ring_bench.run(worlds=[2], batch=1, heads=2, length=32, head_dim=8, dtypes=["fp32"], causal=[True],
                          layouts=["zigzag"], rounds=2, deadline_s=PARENT_DEADLINE_S)
    assert {row["processes"] for row in rows} == {1, 2}
    ring_row = next(row for row in rows if row["processes"] == 2)
    # Forward: one key/value block (2 heads × 16 rows × 8 × fp32, twice) on each of W - 1 steps.
    assert ring_row["fwd_sent_bytes"] == 2 * 2 * 16 * 8 * 4
    assert ring_row["fwd_ms"] > 0 and ring_row["fwd_bwd_ms"] > 0 and ring_row["bwd_sent_bytes"] > 0
    assert "ring" in ring_bench.format_rows(rows)


def test_ring_bench_takes_dropout_and_alibi():
    rows = ring_bench.run(worlds=[2], batch=1, heads=2, length=16, head_dim=8, dtypes=["fp32"], causal=[True],
                          layouts=["zigzag"], rounds=1, deadline_s=PARENT_DEADLINE_S, dropout_p=0.1, alibi=True)
    assert {(row["processes"], row["dropout_p"], row["alibi"]) for row in rows} == {(1, 0.1, True), (2, 0.1, True)}
