"""Tile states of plain mask_mods from index ranges (fused_attn.mask_ranges): never wrong (a tile said empty
sees no pair, a tile said full sees every pair) for random mask_mods built from the operations FlexAttention
mask_mods are written with, exact where a tile is one pair, and what makes a build of a plain mask_mod cost
its partial tiles only."""

from __future__ import annotations

import operator

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fused_attn import mask_ranges, masks
from test_masks import LargestTensor

BATCH, HEADS = 2, 3

# Expressions as nested tuples: numbers (integer and float) and bools over b, h, q_idx, kv_idx and tensors
# indexed by them, as mask_mods read document ids, per-row lengths, per-key values and flags.
constants = st.integers(-60, 60)
divisors = st.integers(-40, 40).filter(bool)
integer_leaves = st.one_of(
    st.sampled_from([("q",), ("kv",), ("b",), ("h",), ("ids_q",), ("ids_kv",), ("ids_b_q",), ("length_b",)]),
    st.tuples(st.just("const"), constants), st.tuples(st.just("ids_q_shifted"), st.integers(0, 50)))


def integer_nodes(children):
    return st.one_of(
        st.tuples(st.sampled_from(["add", "sub", "minimum", "maximum"]), children, children),
        st.tuples(st.sampled_from(["neg", "abs"]), children),
        st.tuples(st.sampled_from(["floordiv", "truncdiv"]), children, divisors),
        st.tuples(st.just("mod"), children, st.integers(1, 40)),
        st.tuples(st.sampled_from(["rsub", "tensor_sub", "mul"]), constants, children),
        st.tuples(st.just("clamp"), children, constants, st.integers(0, 80)),
        st.tuples(st.just("long"), st.tuples(st.just("div"), children, divisors)))


integers = st.recursive(integer_leaves, integer_nodes, max_leaves=6)
floats = st.one_of(st.tuples(st.just("div"), integers, divisors), st.tuples(st.just("float"), integers),
                   st.just(("values_kv",)))
comparisons = st.tuples(st.just("compare"), st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"]),
                        st.one_of(integers, floats), st.one_of(integers, floats))
bool_leaves = st.one_of(comparisons, st.just(("flags_kv",)), st.tuples(st.just("nonzero"), integers))


def bool_nodes(children):
    return st.one_of(
        st.tuples(st.sampled_from(["and", "or", "xor", "logical_and", "logical_or", "eq_bool"]), children, children),
        st.tuples(st.sampled_from(["not", "logical_not"]), children),
        st.tuples(st.just("where_bool"), children, children, children),
        st.tuples(st.just("compare_where"), children, integers, integers, constants))


masks_drawn = st.recursive(bool_leaves, bool_nodes, max_leaves=5)


def tensors(len_q, len_k):
    """The tensors the expressions index, drawn afresh per example."""
    generator = torch.Generator().manual_seed(len_q * 1000 + len_k)
    longest = max(len_q, len_k)
    return {
        "ids": torch.sort(torch.randint(0, 5, (longest,), generator=generator)).values,
        "ids_rows": torch.sort(torch.randint(0, 4, (BATCH, longest), generator=generator), dim=1).values,
        "lengths": torch.randint(0, len_k + 1, (BATCH,), generator=generator),
        "values": torch.randn(len_k, generator=generator),
        "flags": torch.rand(len_k, generator=generator) < 0.7,
    }


def as_function(tree, data):
    """The mask_mod an expression stands for."""
    binary = {"add": operator.add, "sub": operator.sub, "minimum": torch.minimum, "maximum": torch.maximum,
              "and": operator.and_, "or": operator.or_, "xor": operator.xor, "logical_and": torch.logical_and,
              "logical_or": torch.logical_or, "eq_bool": operator.eq}
    compare = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
               "ne": operator.ne}

    def tensor(number_or_tensor):  # a constant leaf as a tensor (mask_mods get no Python numbers from torch ops)
        return torch.tensor(number_or_tensor) if isinstance(number_or_tensor, (int, float)) else number_or_tensor

    def value(node, b, h, q, kv):
        kind, args = node[0], node[1:]
        at = lambda child: value(child, b, h, q, kv)  # noqa: E731
        leaves = {"q": lambda: q, "kv": lambda: kv, "b": lambda: b, "h": lambda: h,
                  "ids_q": lambda: data["ids"][q], "ids_kv": lambda: data["ids"][kv],
                  "ids_b_q": lambda: data["ids_rows"][b, q], "length_b": lambda: data["lengths"][b],
                  "values_kv": lambda: data["values"][kv], "flags_kv": lambda: data["flags"][kv]}
        if kind in leaves:
            return leaves[kind]()
        if kind == "const":
            return torch.tensor(args[0])
        if kind == "ids_q_shifted":  # negative positions wrap, as torch indexing does
            return data["ids"][q - args[0] % len(data["ids"])]
        if kind in binary:
            return binary[kind](at(args[0]), at(args[1]))
        if kind == "compare":
            return compare[args[0]](at(args[1]), at(args[2]))
        if kind == "neg":
            return -at(args[0])
        if kind == "abs":
            return tensor(at(args[0])).abs()
        if kind == "floordiv":
            return at(args[0]) // args[1]
        if kind == "truncdiv":
            return torch.div(tensor(at(args[0])), args[1], rounding_mode="trunc")
        if kind == "div":
            return tensor(at(args[0])) / args[1]
        if kind == "mod":
            return at(args[0]) % args[1]
        if kind == "rsub":
            return args[0] - at(args[1])
        if kind == "tensor_sub":
            return torch.tensor(args[0]) - at(args[1])
        if kind == "mul":
            return at(args[1]) * args[0]
        if kind == "clamp":
            return torch.clamp(tensor(at(args[0])), min=args[1], max=args[1] + args[2])
        if kind == "long":
            return at(args[0]).long()
        if kind == "float":
            return tensor(at(args[0])).float()
        if kind == "nonzero":
            return tensor(at(args[0])).bool()
        if kind in ("not", "logical_not"):
            return ~at(args[0]) if kind == "not" else torch.logical_not(at(args[0]))
        if kind == "where_bool":
            return torch.where(at(args[0]), at(args[1]), at(args[2]))
        if kind == "compare_where":
            return torch.where(at(args[0]), at(args[1]), at(args[2])) <= args[3]
        raise AssertionError(kind)

    def mask_mod(b, h, q_idx, kv_idx):
        seen = value(tree, b, h, q_idx, kv_idx)
        return seen & torch.ones((), dtype=torch.bool)  # a bool tensor whatever the expression's leaves

    return mask_mod


def dense(mask_mod, len_q, len_k):
    b = torch.arange(BATCH).view(-1, 1, 1, 1)
    h = torch.arange(HEADS).view(1, -1, 1, 1)
    q = torch.arange(len_q).view(1, 1, -1, 1)
    kv = torch.arange(len_k).view(1, 1, 1, -1)
    return torch.as_tensor(mask_mod(b, h, q, kv)).expand(BATCH, HEADS, len_q, len_k)


def bounds(length, size):
    lo = torch.arange(0, length, size)
    return lo, torch.clamp(lo + size - 1, max=length - 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=masks_drawn, len_q=st.integers(1, 70), len_k=st.integers(1, 70), size=st.sampled_from([1, 4, 8, 16]))
def test_ranges_never_misjudge_a_tile(tree, len_q, len_k, size):
    mask_mod = as_function(tree, tensors(len_q, len_k))
    seen = dense(mask_mod, len_q, len_k)
    (q_lo, q_hi), (k_lo, k_hi) = bounds(len_q, size), bounds(len_k, size)
    some, every = mask_ranges.tile_truth(mask_mod, BATCH, HEADS, (q_lo[:, None], q_hi[:, None]),
                                         (k_lo[None, :], k_hi[None, :]), torch.device("cpu"))
    some, every = (torch.as_tensor(t).expand(BATCH, HEADS, len(q_lo), len(k_lo)) for t in (some, every))
    padded = torch.nn.functional.pad(seen, (0, (-len_k) % size, 0, (-len_q) % size))
    inside = torch.nn.functional.pad(torch.ones_like(seen), (0, (-len_k) % size, 0, (-len_q) % size))
    tiles = lambda t: t.view(BATCH, HEADS, len(q_lo), size, len(k_lo), size)  # noqa: E731
    truly_some = tiles(padded).any(dim=5).any(dim=3)
    truly_every = tiles(padded | ~inside).all(dim=5).all(dim=3)
    assert not (truly_some & ~some).any(), "a tile said empty sees a pair"
    assert not (every & ~truly_every).any(), "a tile said full hides a pair"
    if size == 1:  # one pair per tile: nothing to over-approximate
        assert torch.equal(some, seen) and torch.equal(every, seen)


def test_what_the_ranges_do_not_follow_is_evaluated_pair_by_pair():
    ids = torch.arange(300) // 70
    follows = lambda b, h, q, kv: ids[q] == ids[kv]  # noqa: E731
    bitwise = lambda b, h, q, kv: (q & kv) == 0  # noqa: E731  (no rule for integers' bits)
    dense_index = lambda b, h, q, kv: (ids[:, None] == ids[None, :])[q, kv]  # noqa: E731
    geometry = masks.TileGeometry(300, 300, torch.device("cpu"))
    assert masks.mask_function(follows).tile_states(geometry) is not None
    for unfollowed in (bitwise, dense_index):
        assert masks.mask_function(unfollowed).tile_states(geometry) is None
        with pytest.raises(mask_ranges.Unsupported):
            mask_ranges.tile_truth(unfollowed, 1, 1, geometry.query_bounds(), geometry.key_bounds(), geometry.device)
    for mask_mod in (follows, bitwise, dense_index):
        program = masks.mask_program(mask_mod, len_q=300)
        assert torch.equal(program.dense()[0, 0], dense(mask_mod, 300, 300)[0, 0])


def test_a_plain_document_mask_mod_costs_its_partial_tiles_only():
    length = 4096
    ids = torch.sort(torch.randint(0, 8, (length,), generator=torch.Generator().manual_seed(3))).values

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    with LargestTensor() as spy:
        program = masks.mask_program(document_causal, len_q=length)
    assert spy.largest <= masks.TILES_PER_BATCH * masks.TILE ** 2  # no slice of rows × all keys
    assert torch.equal(program.dense()[0, 0], dense(document_causal, length, length)[0, 0])
    same = masks.mask_program(masks.documents(ids) & masks.causal(), len_q=length).without_band()
    assert torch.equal(program.tiles, same.tiles) and torch.equal(program.bits, same.bits)


NUMBER_RULES = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
                "mod": operator.mod, "truediv": operator.truediv, "minimum": torch.minimum, "maximum": torch.maximum,
                "truncdiv": lambda a, b: torch.div(a, b, rounding_mode="trunc")}
COMPARISON_RULES = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
                    "ne": operator.ne}
intervals = st.tuples(st.integers(-20, 20), st.integers(0, 12)).map(lambda start_width: (start_width[0],
                                                                                          sum(start_width)))


def interval(bounds):
    return mask_ranges.Interval(torch.tensor(bounds[0]), torch.tensor(bounds[1]), floating=False)


@settings(max_examples=400, deadline=None)
@given(rule=st.sampled_from(sorted(NUMBER_RULES) + sorted(COMPARISON_RULES)), a=intervals, b=intervals)
def test_each_rule_holds_every_value_it_stands_for(rule, a, b):
    """Per operation: the interval (or the may-be-True / may-be-False pair) holds the result of every pair of
    values of its operands' intervals; comparisons say exactly which results occur."""
    xs = torch.arange(a[0], a[1] + 1).view(-1, 1)
    ys = torch.arange(b[0], b[1] + 1).view(1, -1)
    if rule in COMPARISON_RULES:
        truth = COMPARISON_RULES[rule](interval(a), interval(b))
        real = COMPARISON_RULES[rule](xs, ys)
        assert bool(truth.may_true) == bool(real.any()) and bool(truth.may_false) == bool((~real).any())
        return
    try:
        result = NUMBER_RULES[rule](interval(a), interval(b))
    except mask_ranges.Unsupported:  # always safe: the pairs are then evaluated
        assert rule in ("floordiv", "mod", "truediv", "truncdiv")
        return
    real = NUMBER_RULES[rule](xs, ys)
    assert bool((real >= result.lo).all()) and bool((real <= result.hi).all())
    if rule != "mod":  # the other rules' bounds are attained
        assert bool((real == result.lo).any()) and bool((real == result.hi).any())


@settings(max_examples=300, deadline=None)
@given(positions=st.tuples(st.integers(-12, 12), st.integers(0, 12)), length=st.integers(1, 12),
       seed=st.integers(0, 2 ** 16))
def test_an_index_range_bounds_the_elements_it_reaches(positions, length, seed):
    lo, hi = positions[0], positions[0] + positions[1]
    values = torch.randint(-50, 50, (3, length), generator=torch.Generator().manual_seed(seed))
    rows = torch.arange(3).view(-1, 1)
    found = values[rows, interval((lo, hi))]
    reached = [p for p in range(lo, hi + 1) if -length <= p < length]
    if len(reached) == hi - lo + 1 and (lo >= 0 or hi < 0):  # valid on one side of 0: a run of elements
        real = values[:, reached]
        assert torch.equal(found.lo.view(-1), real.amin(dim=1)) and torch.equal(found.hi.view(-1), real.amax(dim=1))
    assert bool((found.lo.view(-1, 1) <= values[:, [p % length for p in reached]]).all())
    assert bool((found.hi.view(-1, 1) >= values[:, [p % length for p in reached]]).all())
