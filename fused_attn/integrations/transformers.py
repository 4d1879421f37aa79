"""fused_attn as a Hugging Face transformers attention implementation.

    from fused_attn.integrations import transformers as fused_transformers

    fused_transformers.register()  # as "fused_attn"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fused_attn")
    # or, on a model already built: model.set_attn_implementation("fused_attn")

`register` installs two functions under one name: the attention function (`AttentionInterface`) and
the mask builder (`AttentionMaskInterface`). transformers builds no mask at all for an
implementation that has no mask builder, so registering the attention function alone would run
padded batches unmasked.

The mask builder keeps masks small. The patterns the kernels compute themselves — causal with its
last query on the last key, with or without a sliding window, and bidirectional, with or without a
sliding window — become key padding, and the mask says which pattern it is, whatever the module's
own `is_causal` says (PaliGemma's Gemma says False under a causal mask):
- causal: (B, L_k) bool, True = attend (a zero-stride row of True when nothing is padded), run as
  bottom-right causal with `window_size=(sliding_window - 1, 0)` and key padding in the kernel; as
  with flash_attention_2, the window comes from the `sliding_window` the module passes.
- bidirectional: a (B, 1, 1, L_k) bool view, run as not causal; in a sliding window (ModernBERT's
  local layers) with `window_size=(w, w)`, `w` the half-width transformers' mask has
  (`config.sliding_window`; modules pass it + 1 as flash_attention_2 wants it, or unchanged).
Every other pattern (custom or/and mask functions, packed sequences found from position ids, chunked
attention, a static cache whose queries do not end on its last slot) is built as transformers builds
it for `sdpa`, a (B, 1, L_q, L_k) bool mask, and read by the kernels.

Passed through: `scaling`, `dropout` (in training), `softcap`, GQA (key/value heads are never
repeated), `position_bias` (added to the scores), decode steps against a cache (the decode kernels
run). Packed sequences given as flash-attn's `cu_seq_lens_q` / `cu_seq_lens_k` (and `max_length_q` /
`max_length_k`) keyword arguments, as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
makes them, run as `fused_attn.attention_varlen`: no key block of another sequence is visited, and the
mask transformers may have built from the position ids is not read. Attention sinks (`s_aux`, one
logit per query head, as gpt-oss passes its `sinks` parameter) run as fused_attn's `sinks`, with their
gradient. Attention weights are not returned (None), as with sdpa.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (AttentionMaskInterface, bidirectional_mask_function, causal_mask_function,
                                        sdpa_mask)

from .. import functional, varlen
from ..backends import registry

DEFAULT_NAME = "fused_attn"


def register(name: str = DEFAULT_NAME, backend: str | None = None) -> str:
    """Registers fused_attn with transformers as `attn_implementation=name` and returns the name.

    `backend` pins a fused_attn backend (a name from `fused_attn.available_backends()`); None chooses
    per call. Registering again under the same name replaces the earlier registration.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if backend is not None and backend not in registry.available_backends():
        raise ValueError(f"backend: expected None or one of {registry.available_backends()}, got {backend!r}")
    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, build_mask)
    return name


# --- masks -------------------------------------------------------------------------------------


def _and_parts(mask_function) -> tuple:
    """The functions combined by transformers' `and_masks`, or () for any other function."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return ()
    return tuple(inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ()))


def _is_causal_pattern(mask_function) -> bool:
    """Causal, or causal within a sliding window (whose size the attention call receives)."""
    if mask_function is causal_mask_function:
        return True
    parts = _and_parts(mask_function)
    return (len(parts) == 2 and parts[1] is causal_mask_function
            and getattr(parts[0], "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask")


def _is_bidirectional_pattern(mask_function) -> bool:
    """Bidirectional, or bidirectional within a sliding window (ModernBERT's local layers; the attention
    call receives the window's size)."""
    if mask_function is bidirectional_mask_function:
        return True
    parts = _and_parts(mask_function)
    return (len(parts) == 2 and parts[1] is bidirectional_mask_function
            and getattr(parts[0], "__qualname__", "") == "sliding_window_bidirectional_overlay.<locals>.inner_mask")


def _ends_aligned(q_offset, q_length: int, kv_offset, kv_length: int) -> bool:
    """Whether the last query sits on the last key (bottom-right causal). A tensor offset (a static
    cache) is not read, so that building the mask never waits for the device."""
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        return False
    return q_offset + q_length == kv_offset + kv_length


def _key_padding(attention_mask, kv_length: int, kv_offset: int):
    """The (B, kv_length) slice of transformers' 2-D mask (True = attend) that the keys use."""
    if attention_mask is None:
        return None
    missing = kv_offset + kv_length - attention_mask.shape[-1]
    if missing > 0:  # as transformers: keys past the mask's end are hidden
        attention_mask = torch.nn.functional.pad(attention_mask, (0, missing))
    return attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)


def _attend_all(batch_size: int, kv_length: int, device) -> torch.Tensor:
    """Key padding where nothing is padded: one True broadcast to (B, kv_length), all strides 0, which
    tells the attention function that it need not read it."""
    return torch.ones((), dtype=torch.bool, device=device).expand(batch_size, kv_length)


@functools.cache
def _note_full_mask() -> None:
    warnings.warn("fused_attn: this model's mask pattern is not one the kernels compute themselves (custom or "
                  "packed-sequence masks, chunked attention, or a static cache whose queries do not end on "
                  "its last slot); it is built in full as for sdpa, (B, 1, L_q, L_k), and read by the kernels",
                  stacklevel=3)


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip: bool = True,
               allow_is_bidirectional_skip: bool = False, use_vmap: bool = False, **kwargs):
    """transformers' mask builder for fused_attn (the module docstring says what it returns).

    The keywords that `sdpa_mask` is called with here are all named above, so that none arrives twice
    through `kwargs`: transformers passes `allow_is_bidirectional_skip` for bidirectional masks."""
    if _is_causal_pattern(mask_function) and allow_is_causal_skip and not use_vmap \
            and _ends_aligned(q_offset, q_length, kv_offset, kv_length):
        padding = _key_padding(attention_mask, kv_length, kv_offset)
        if padding is None:
            return _attend_all(batch_size, kv_length, kwargs.get("device", "cpu"))
        if not torch.compiler.is_compiling() and bool(padding.all()):
            return _attend_all(batch_size, kv_length, padding.device)
        return padding
    if _is_bidirectional_pattern(mask_function) and not use_vmap:
        padding = _key_padding(attention_mask, kv_length, kv_offset)
        if padding is None:
            padding = _attend_all(batch_size, kv_length, kwargs.get("device", "cpu"))
        return padding.expand(batch_size, kv_length)[:, None, None, :]
    _note_full_mask()
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap, **kwargs)


# --- attention ---------------------------------------------------------------------------------


@functools.cache
def _warn_no_weights() -> None:
    warnings.warn("fused_attn does not return attention weights (output_attentions=True gives None); "
                  "use attn_implementation='eager' to get them", stacklevel=3)


def _with_position_bias(mask, position_bias):
    """An additive bias on top of a 4-D mask (bool True = attend, or additive)."""
    if mask is None:
        return position_bias
    if mask.dtype == torch.bool:
        return position_bias.masked_fill(~mask, float("-inf"))
    return position_bias + mask


def _packed_forward(query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window, softcap,
                    position_bias, backend, kwargs, sinks=None) -> torch.Tensor:
    """A batch of one holding packed sequences, bounded by flash-attn's cu_seq_lens keywords, as
    attention_varlen. Returns (1, total_q, H_q, D_v)."""
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q: packed sequences come as a batch of one, got a batch of {query.shape[0]}")
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.stride() != (0, 0):
        raise ValueError("cu_seq_lens_q: packed sequences have no padding, but a 2-D attention mask was given")
    if position_bias is not None:
        raise NotImplementedError("position_bias: not supported with packed sequences (cu_seq_lens_q)")
    cu_seqlens_q = kwargs["cu_seq_lens_q"]
    cu_seqlens_k = kwargs.get("cu_seq_lens_k")
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    # Python ints are checked on the device without a synchronisation; anything else is left to the
    # backends to read from the bounds.
    max_q, max_k = (length if isinstance(length, int) else None
                    for length in (kwargs.get("max_length_q"), kwargs.get("max_length_k")))
    window = (sliding_window - 1, 0) if is_causal and sliding_window is not None else None
    out = varlen.attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p=dropout,
                                  is_causal=bool(is_causal), scale=scaling, backend=backend,
                                  causal_alignment="bottom_right", window_size=window, softcap=softcap,
                                  sinks=sinks)
    return out.unsqueeze(0)


def _bidirectional_window(module, sliding_window: int) -> tuple[int, int]:
    """The window of build_mask's bidirectional sliding-window pattern (a mask built in full holds its
    own). transformers builds that mask with `config.sliding_window` keys on each side, while modules
    pass their own `sliding_window`: ModernBERT's that + 1 (flash_attention_2 keeps `sliding_window - 1`
    on each side), T5Gemma's that unchanged. The mask is what eager and sdpa compute: its width is used,
    and flash_attention_2's reading of the module's where its config has no single one."""
    try:
        side = module.config.sliding_window
    except Exception:  # noqa: BLE001 - no config, or one per layer (NeoMME's refuses to answer)
        side = None
    side = side if isinstance(side, int) else sliding_window - 1
    return side, side


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, position_bias: torch.Tensor | None = None,
                      backend: str | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function: query (B, H_q, L_q, D), key and value (B, H_kv, L_k, D),
    `attention_mask` as `build_mask` returns it. Returns ((B, L_q, H_q, D_v), None)."""
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks: (H_q,), the same definition as fused_attn's
    if kwargs.get("output_attentions"):
        _warn_no_weights()
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if kwargs.get("cu_seq_lens_q") is not None:
        return _packed_forward(query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window,
                               softcap, position_bias, backend, kwargs, sinks), None
    key_padding_mask = mask = window = None
    if attention_mask is not None and attention_mask.dim() == 2:
        if attention_mask.shape[1] != key.shape[2]:
            # The module joined keys of its own after the mask was built (DeepSeek-V4's compressed
            # slots, with a bias for them written for eager's 4-D additive mask): what those keys may
            # see is not in the key padding, and guessing would give a wrong answer.
            raise NotImplementedError(
                f"attention_mask: {type(module).__name__} attends over {key.shape[2]} keys, but its mask was "
                f"built for {attention_mask.shape[1]}: the module extends the keys after the mask is built, "
                "for eager's 4-D mask; use attn_implementation='eager' for this model")
        # build_mask's causal pattern, as key padding: causal whatever the module's own flag says
        # (PaliGemma's Gemma says False, its mask is causal).
        is_causal = True
        if attention_mask.stride() != (0, 0):  # zero strides: nothing is padded (_attend_all)
            key_padding_mask = ~attention_mask
    elif attention_mask is not None:
        mask = attention_mask
        if mask.is_floating_point() and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        if not is_causal and sliding_window is not None and mask.shape[-2] == 1 \
                and query.shape[2] == key.shape[2]:
            window = _bidirectional_window(module, sliding_window)
        is_causal = False
    if is_causal and sliding_window is not None:
        window = (sliding_window - 1, 0)
    if position_bias is not None:
        mask = _with_position_bias(mask, position_bias.to(query.dtype))
    out = functional.attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=bool(is_causal),
                               scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                               key_padding_mask=key_padding_mask, backend=backend,
                               causal_alignment="bottom_right", window_size=window, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2), None
