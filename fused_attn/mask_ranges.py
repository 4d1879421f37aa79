"""The tile states of a plain mask_mod found without evaluating its pairs: the function runs once on ranges.

A FlexAttention mask_mod is tensor operations on broadcast index tensors. Called instead with a q_idx and a
kv_idx that stand for whole tiles (per tile, the interval of the indices it holds), each operation gives
what holds over the tile: for a number, an interval holding every value it takes; for a bool, whether it
may be True and whether it may be False. `doc[q_idx] == doc[kv_idx]` so says per tile of a packed batch:
no pair of the tile is equal (the id ranges are disjoint), every pair is (one id on both sides), or either.

The answer only has to be safe, never exact: masks.mask_program evaluates pair by pair every tile found
neither empty nor full, so the program is exact whatever this finds, and each rule below errs only towards
"either". An operation without a rule (or a Python `if` on a tensor) raises `Unsupported`; every pair is
then evaluated instead.
"""

from __future__ import annotations

import numbers

import torch


class Unsupported(Exception):
    """The mask_mod does something these ranges cannot follow."""


class _Abstract:
    """A value over a tile: what a mask_mod's tensor operations receive in place of a tensor."""

    device: torch.device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _apply(getattr(func, "__name__", ""), args, kwargs or {})

    def __bool__(self):
        raise Unsupported("a Python branch on a tensor's value")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: _apply(name, (self, *args), kwargs)

    @property
    def shape(self):
        raise Unsupported("a tensor's shape")


def _operator(name):
    def method(self, *others):
        return _apply(name, (self, *others), {})
    method.__name__ = name
    return method


for _name in ("add", "sub", "mul", "floordiv", "truediv", "mod", "and", "or", "xor", "eq", "ne", "lt", "le", "gt",
              "ge", "radd", "rsub", "rmul", "rfloordiv", "rtruediv", "rmod", "rand", "ror", "rxor", "neg", "abs",
              "invert", "getitem"):
    setattr(_Abstract, f"__{_name}__", _operator(f"__{_name}__"))
_Abstract.__hash__ = object.__hash__


class Interval(_Abstract):
    """Every value lies in [lo, hi] (broadcast tensors); `floating`: the values are not integers."""

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, floating: bool):
        self.lo, self.hi, self.floating = lo, hi, floating
        self.device = lo.device

    @property
    def dtype(self):
        return torch.float32 if self.floating else torch.int64


class Truth(_Abstract):
    """A bool that may be True where `may_true` and may be False where `may_false` (broadcast tensors)."""

    dtype = torch.bool

    def __init__(self, may_true: torch.Tensor, may_false: torch.Tensor):
        self.may_true, self.may_false = may_true, may_false
        self.device = may_true.device


def _lift(value, device):
    """A tensor or a Python number as the abstract value it is exactly."""
    if isinstance(value, _Abstract):
        return value
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        value = torch.as_tensor(value, device=device)
        return Truth(value, ~value)
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and not value.is_complex()):
        value = torch.as_tensor(value, device=device)
        return Interval(value, value, value.is_floating_point())
    raise Unsupported(f"an operand of type {type(value).__name__}")


def _as_interval(value) -> Interval:
    if isinstance(value, Truth):  # False = 0, True = 1
        return Interval((~value.may_false).long(), value.may_true.long(), False)
    return value


def _as_truth(value) -> Truth:
    if isinstance(value, Interval):  # a number as a bool: nonzero
        zero_possible = (value.lo <= 0) & (value.hi >= 0)
        return Truth(~((value.lo == 0) & (value.hi == 0)), zero_possible)
    return value


def _extremes(*values):
    low, high = values[0], values[0]
    for value in values[1:]:
        low, high = torch.minimum(low, value), torch.maximum(high, value)
    return low, high


def _no_nan(*intervals: Interval):
    # NaN compares False both ways: a comparison's "may be False" would miss it.
    for interval in intervals:
        if interval.floating and bool(torch.isnan(interval.lo).any() | torch.isnan(interval.hi).any()):
            raise Unsupported("NaN among the values")


def _add(a: Interval, b: Interval):
    return Interval(a.lo + b.lo, a.hi + b.hi, a.floating or b.floating)


def _sub(a: Interval, b: Interval):
    return Interval(a.lo - b.hi, a.hi - b.lo, a.floating or b.floating)


def _mul(a: Interval, b: Interval):
    return Interval(*_extremes(a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi), a.floating or b.floating)


def _divide(a: Interval, b: Interval, rounding_mode=None):
    # With the divisor's sign fixed, a / b is monotonic in each operand, and so are floor and trunc of it:
    # the extremes are at the corners.
    if not bool(((b.lo > 0) | (b.hi < 0)).all()):
        raise Unsupported("a divisor that may be 0")
    corners = [torch.div(x, y, rounding_mode=rounding_mode) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    floating = rounding_mode is None or a.floating or b.floating
    return Interval(*_extremes(*corners), floating)


def _remainder(a: Interval, b: Interval):
    if a.floating or b.floating or not bool(((b.lo == b.hi) & (b.lo > 0)).all()):
        raise Unsupported("a remainder other than of integers by a positive constant")
    modulus = b.lo
    one_period = torch.div(a.lo, modulus, rounding_mode="floor") == torch.div(a.hi, modulus, rounding_mode="floor")
    return Interval(torch.where(one_period, a.lo % modulus, 0), torch.where(one_period, a.hi % modulus, modulus - 1),
                    False)


def _neg(a: Interval):
    return Interval(-a.hi, -a.lo, a.floating)


def _abs(a: Interval):
    low = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, torch.zeros_like(a.lo)))
    return Interval(low, torch.maximum(a.lo.abs(), a.hi.abs()), a.floating)


def _minimum(a: Interval, b: Interval):
    return Interval(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi), a.floating or b.floating)


def _maximum(a: Interval, b: Interval):
    return Interval(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi), a.floating or b.floating)


def _less(a: Interval, b: Interval, or_equal: bool) -> Truth:
    _no_nan(a, b)
    if or_equal:
        return Truth(a.lo <= b.hi, a.hi > b.lo)
    return Truth(a.lo < b.hi, a.hi >= b.lo)


def _equal(a: Interval, b: Interval) -> Truth:
    _no_nan(a, b)
    one_value = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    return Truth((a.lo <= b.hi) & (b.lo <= a.hi), ~one_value)


def _not(a: Truth) -> Truth:
    return Truth(a.may_false, a.may_true)


def _and(a: Truth, b: Truth) -> Truth:
    return Truth(a.may_true & b.may_true, a.may_false | b.may_false)


def _or(a: Truth, b: Truth) -> Truth:
    return Truth(a.may_true | b.may_true, a.may_false & b.may_false)


def _xor(a: Truth, b: Truth) -> Truth:
    return Truth((a.may_true & b.may_false) | (a.may_false & b.may_true),
                 (a.may_true & b.may_true) | (a.may_false & b.may_false))


def _where(condition: Truth, a, b):
    both = condition.may_true & condition.may_false
    if isinstance(a, Truth) and isinstance(b, Truth):
        return Truth((condition.may_true & a.may_true) | (condition.may_false & b.may_true),
                     (condition.may_true & a.may_false) | (condition.may_false & b.may_false))
    a, b = _as_interval(a), _as_interval(b)
    lo = torch.where(both, torch.minimum(a.lo, b.lo), torch.where(condition.may_true, a.lo, b.lo))
    hi = torch.where(both, torch.maximum(a.hi, b.hi), torch.where(condition.may_true, a.hi, b.hi))
    return Interval(lo, hi, a.floating or b.floating)


def _converted(value, dtype):
    if dtype == torch.bool:
        return _as_truth(value)
    value = _as_interval(value)
    if dtype.is_floating_point:  # rounding to nearest is monotonic: the bounds stay bounds
        return Interval(value.lo.to(dtype), value.hi.to(dtype), True)
    if dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"a conversion to {dtype}")
    lo, hi = (value.lo.trunc(), value.hi.trunc()) if value.floating else (value.lo, value.hi)  # monotonic too
    if dtype == torch.int32 and bool(((lo < -2**31) | (hi >= 2**31)).any()):
        raise Unsupported("a conversion to int32 that wraps")
    return Interval(lo.to(dtype), hi.to(dtype), False)


def _constant_like(value, fill, dtype):
    device = value.device
    dtype = dtype if dtype is not None else value.dtype
    return _lift(torch.tensor(fill, device=device).to(dtype), device)


def _gather(source: torch.Tensor, index) -> _Abstract:
    """`source[index]` where one index is an Interval: per tile, the least and greatest element its positions
    reach (a sparse table of minima and maxima along that dimension, two look-ups per tile)."""
    if isinstance(source, _Abstract):
        raise Unsupported("indexing a value derived from the indices")
    parts = list(index) if isinstance(index, tuple) else [index]
    where = [i for i, part in enumerate(parts) if isinstance(part, _Abstract)]
    if len(where) != 1 or len(parts) != source.dim() or not isinstance(parts[where[0]], Interval) \
            or parts[where[0]].floating:
        raise Unsupported("an index other than one integer index tensor per dimension")
    axis = where[0]
    positions = parts[axis]
    others = []
    for part in parts[:axis] + parts[axis + 1:]:
        if isinstance(part, bool) or not isinstance(part, (numbers.Integral, torch.Tensor)) or \
                (isinstance(part, torch.Tensor) and (part.is_floating_point() or part.dtype == torch.bool)):
            raise Unsupported("an index other than one integer index tensor per dimension")
        others.append(torch.as_tensor(part, device=source.device))
    values = source.movedim(axis, -1)
    length = values.shape[-1]
    if length == 0:
        raise Unsupported("an empty dimension")
    if source.dtype == torch.bool:
        values = values.to(torch.uint8)
    # Negative positions count from the end, as torch indexing does; ranges across 0 or past the ends
    # (which raise where they are evaluated) are bounded by the whole dimension.
    wrapped = (positions.hi < 0).long() * length
    lo, hi = positions.lo + wrapped, positions.hi + wrapped
    inside = (lo >= 0) & (hi < length)
    lo, hi = torch.where(inside, lo, 0), torch.where(inside, hi, length - 1)
    low, high = _sparse_range_extremes(values, others, lo, hi)
    if source.dtype == torch.bool:
        return Truth(high != 0, low == 0)
    if source.is_complex():
        raise Unsupported("complex values")
    return Interval(low, high, source.is_floating_point())


def _sparse_range_extremes(values, others, lo, hi):
    """(min, max) of values[*others, lo .. hi] (inclusive) along the last dimension."""
    length = values.shape[-1]

    def shifted(table, width):  # table[..., min(i + width, length - 1)]
        return torch.cat([table[..., width:], table[..., -1:].expand(*table.shape[:-1], width)], dim=-1)

    count = hi - lo + 1
    # Only the levels the widest range needs (a tile's 128 positions: 8 of the 14 at 8192).
    widest = int(count.max()) if count.numel() else 1
    minima, maxima = [values], [values]
    width = 1
    while 2 * width <= min(length, widest):  # level k: the extremes of the 2^k values from each position
        minima.append(torch.minimum(minima[-1], shifted(minima[-1], width)))
        maxima.append(torch.maximum(maxima[-1], shifted(maxima[-1], width)))
        width *= 2
    # floor(log2(count)), exact in float64 for counts far beyond any length (2^k - 1 stays below k there).
    level = torch.log2(count.to(torch.float64)).floor().long().clamp(0, len(minima) - 1)
    second = hi - torch.pow(2, level) + 1
    if level.numel() and int(level.min()) == len(minima) - 1:  # one width for every range: read that level alone
        minima, maxima, where = minima[-1], maxima[-1], ()
    else:
        minima, maxima, where = torch.stack(minima), torch.stack(maxima), (level,)
    low = torch.minimum(minima[(*where, *others, lo)], minima[(*where, *others, second)])
    high = torch.maximum(maxima[(*where, *others, lo)], maxima[(*where, *others, second)])
    return low, high


_ARITHMETIC = {"add": _add, "sub": _sub, "mul": _mul, "floor_divide": lambda a, b: _divide(a, b, "floor"),
               "floordiv": lambda a, b: _divide(a, b, "floor"), "truediv": _divide, "true_divide": _divide,
               "remainder": _remainder, "mod": _remainder, "minimum": _minimum, "maximum": _maximum,
               "lt": lambda a, b: _less(a, b, False), "le": lambda a, b: _less(a, b, True),
               "gt": lambda a, b: _less(b, a, False), "ge": lambda a, b: _less(b, a, True),
               "less": lambda a, b: _less(a, b, False), "less_equal": lambda a, b: _less(a, b, True),
               "greater": lambda a, b: _less(b, a, False), "greater_equal": lambda a, b: _less(b, a, True)}
_COMPARISONS = {"lt", "le", "gt", "ge", "less", "less_equal", "greater", "greater_equal"}
_LOGICAL = {"and": _and, "logical_and": _and, "bitwise_and": _and, "or": _or, "logical_or": _or,
            "bitwise_or": _or, "xor": _xor, "logical_xor": _xor, "bitwise_xor": _xor}
_UNARY = {"neg": _neg, "negative": _neg, "abs": _abs, "absolute": _abs}
_CONVERSIONS = {"long": torch.int64, "int": torch.int32, "float": torch.float32, "double": torch.float64,
                "bool": torch.bool}


def _apply(name: str, args: tuple, kwargs: dict):
    bare = name.strip("_")
    if name.startswith("__r") and bare[1:] in {**_ARITHMETIC, **_LOGICAL}:  # x.__rsub__(y) is y - x
        bare, args = bare[1:], (args[1], args[0], *args[2:])
    if bare == "rsub":  # torch.rsub(x, y) is y - x
        bare, args = "sub", (args[1], args[0], *args[2:])
    if bare == "getitem":
        return _gather(*args)
    device = next(arg.device for arg in args if isinstance(arg, _Abstract))
    if bare in ("eq", "ne", "equal", "not_equal"):
        a, b = (_lift(arg, device) for arg in args)
        if isinstance(a, Truth) and isinstance(b, Truth):
            same = _not(_xor(a, b))
        else:
            same = _equal(_as_interval(a), _as_interval(b))
        return same if bare in ("eq", "equal") else _not(same)
    if bare in ("div", "divide") and len(args) == 2:
        mode = kwargs.pop("rounding_mode", None)
        if kwargs:
            raise Unsupported(f"{name} with {sorted(kwargs)}")
        return _divide(*(_as_interval(_lift(arg, device)) for arg in args), mode)
    if bare in _ARITHMETIC and len(args) == 2 and not kwargs:
        operands = [_lift(arg, device) for arg in args]
        if all(isinstance(operand, Truth) for operand in operands) and bare not in _COMPARISONS:
            raise Unsupported(f"{name} of two bools")  # torch keeps bool + bool a bool, not 0, 1 or 2
        return _ARITHMETIC[bare](*(_as_interval(operand) for operand in operands))
    if bare in _LOGICAL and len(args) == 2 and not kwargs:
        operands = [_lift(arg, device) for arg in args]
        if not all(isinstance(operand, Truth) for operand in operands):
            raise Unsupported(f"{name} of integers")
        return _LOGICAL[bare](*operands)
    if bare in ("invert", "logical_not", "bitwise_not") and len(args) == 1 and not kwargs:
        value = _lift(args[0], device)
        if not isinstance(value, Truth):
            raise Unsupported(f"{name} of integers")
        return _not(value)
    if bare in _UNARY and len(args) == 1 and not kwargs:
        return _UNARY[bare](_as_interval(_lift(args[0], device)))
    if bare == "where" and len(args) == 3 and not kwargs:
        condition, a, b = (_lift(arg, device) for arg in args)
        return _where(_as_truth(condition), a, b)
    if bare in ("clamp", "clip", "clamp_min", "clamp_max"):
        return _clamp(bare, device, *args, **kwargs)
    if bare in _CONVERSIONS and len(args) == 1 and not kwargs:
        return _converted(_lift(args[0], device), _CONVERSIONS[bare])
    if bare in ("to", "type") and len(args) == 2 and isinstance(args[1], torch.dtype):
        return _converted(_lift(args[0], device), args[1])
    if bare in ("to", "type") and not kwargs.keys() - {"dtype", "device", "non_blocking", "copy"} and len(args) == 1:
        dtype = kwargs.get("dtype")
        return _converted(_lift(args[0], device), dtype) if dtype is not None else args[0]
    if bare in ("ones_like", "zeros_like", "full_like") and not kwargs.keys() - {"dtype", "device"}:
        fill = {"ones_like": 1, "zeros_like": 0}.get(bare, args[1] if len(args) > 1 else None)
        if fill is None or isinstance(fill, _Abstract):
            raise Unsupported(f"{name} of a value derived from the indices")
        return _constant_like(args[0], fill, kwargs.get("dtype"))
    raise Unsupported(f"torch operation {name!r}")


def _clamp(name, device, value, min=None, max=None):
    value = _as_interval(_lift(value, device))
    if name == "clamp_max":
        min, max = None, min
    if min is not None:
        value = _maximum(value, _as_interval(_lift(min, device)))
    if max is not None:
        value = _minimum(value, _as_interval(_lift(max, device)))
    return value


def tile_truth(mask_mod, batch: int, heads: int, query_bounds, key_bounds, device):
    """(some, every) of `mask_mod` per tile, bool, broadcastable to (batch, heads, NQ, NK): `some` False only where
    no pair of the tile can be seen, `every` True only where every pair is. The tiles hold queries
    [query_bounds[0], query_bounds[1]] ((NQ, 1) each) and keys [key_bounds[0], key_bounds[1]] ((1, NK) each).
    Raises Unsupported when the mask_mod steps outside what the ranges follow."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q_idx = Interval(*(bound.view(1, 1, -1, 1) for bound in query_bounds), floating=False)
    kv_idx = Interval(*(bound.view(1, 1, 1, -1) for bound in key_bounds), floating=False)
    result = mask_mod(b, h, q_idx, kv_idx)
    if isinstance(result, Interval) or not isinstance(result, (Truth, torch.Tensor, bool)):
        raise Unsupported(f"a mask_mod returning {type(result).__name__}, not a bool")
    result = _lift(result, device)
    if not isinstance(result, Truth):
        raise Unsupported("a mask_mod returning numbers, not bools")
    if result.may_true.dim() > 4 or result.may_false.dim() > 4:
        raise Unsupported("a result with more dimensions than (b, h, q_idx, kv_idx)")
    return result.may_true, ~result.may_false
