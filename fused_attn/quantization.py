"""8-bit key/value caches (`attention_with_kvcache`): what a stored value means and how a new one is stored.

A cache of `torch.float8_e4m3fn` or `torch.int8` holds each key (and value) as 8-bit values `q` with a
float32 scale, and stands for `q.float() * scale`. The scales come in one of two layouts:

- per (sequence, kv head): one scale for every key of a cache row and head, given by the caller (it
  is the caller's choice of range); a new key is divided by it, rounded to the nearest representable
  value (ties to even) and saturated at the format's largest magnitude;
- per (token, kv head): one scale per stored key and head, written with it when the key is appended:
  the key's largest magnitude over its head dim divided by the format's largest magnitude (1 for a
  key of zeros), so that the key's largest element is stored at full range.

The kernels that read such a cache (`Backend.reads_quantized_cache`) dequantize each value where it
is loaded; the others run on the dequantized copy, `dequantize(...)` in the query's dtype.
"""

from __future__ import annotations

import torch

# The 8-bit formats a cache may have, and the largest magnitude each represents.
LARGEST = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
CACHE_DTYPES = tuple(LARGEST)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in LARGEST


def token_scales(new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-token scales of keys or values `new` (..., D) stored as `dtype`: float32 (...)."""
    largest = new.detach().abs().amax(dim=-1).float()
    return torch.where(largest > 0, largest / LARGEST[dtype], torch.ones_like(largest))


def quantize(new: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`new` (..., D) as `dtype` under `scale` (...): new / scale, rounded to nearest (ties to even), saturated."""
    largest = LARGEST[dtype]
    scaled = (new.float() / scale[..., None]).clamp(-largest, largest)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What 8-bit `stored` (..., D) stands for under `scale` (...), as `dtype`."""
    return (stored.float() * scale[..., None]).to(dtype)
