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
The other patterns made of transformers' own mask functions (`masking_utils`) become one mask program
(fused_attn.masks), built once per forward and given to every layer as a BlockMask (which transformers
passes on as it is, as for flex_attention; its program is kept with it), whose kernels read only the
tiles it keeps: chunked attention (Llama 4's `attention_chunk_size`, chunks starting after each row's left
padding), packed sequences found from position ids (their documents, causal within each), windows and
causal masks whose queries do not end on the last key (offsets of a cache, a static cache), the
`and_masks`/`or_masks` of these with sliding windows, bidirectional windows and blockwise overlays, and
the key padding of the 2-D attention mask. Only a mask function of a model's own (Gemma 4's audio
windows, Nemotron ASR's chunks), a plain causal mask the model asks for as a tensor
(`allow_is_causal_skip=False`: Falcon adds ALiBi to it; a static cache's decode steps) and calls traced
by torch.compile are built as transformers builds them for `sdpa`, a (B, 1, L_q, L_k) bool mask read by
the kernels, with a warning where L_q > 1.

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
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface, masking_utils
from transformers.masking_utils import (AttentionMaskInterface, bidirectional_mask_function, causal_mask_function,
                                        sdpa_mask)

from .. import functional, masks, varlen
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
    warnings.warn("fused_attn: this model's mask is neither a pattern the kernels compute themselves nor made of "
                  "transformers' mask functions, which a mask program describes (a mask function of its own, or "
                  "a causal mask the model asks for as a tensor); it is built in full as for sdpa, "
                  "(B, 1, L_q, L_k), and read by the kernels", stacklevel=3)


# --- mask programs -----------------------------------------------------------------------------


class _Frame(NamedTuple):
    """Where a mask function of transformers is evaluated: the q_idx (1 or B, L_q) and kv_idx (1 or B, L_k)
    it receives for the call's queries and keys, and `offset`, such that kv_idx - q_idx = j - i - offset
    for query i and key j (for pairs of one packed sequence, under remapped positions); `packed`: inside
    the and_masks of packed sequences, whose documents hide every other pair."""

    q: torch.Tensor
    kv: torch.Tensor
    offset: int
    packed: bool = False


def _gather(table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """table[b, indices[b]] per batch row, either of one row broadcast: (1 or B, L)."""
    rows = max(table.shape[0], indices.shape[0])
    return torch.gather(table.expand(rows, -1), 1, indices.to(table.device).expand(rows, -1))


class _Translation:
    """A mask function of transformers.masking_utils as a fused_attn.masks mask, or None for any other
    function; `per_batch` says whether the mask holds rows of its own per batch row."""

    def __init__(self):
        self.per_batch = False

    def __call__(self, mask_function, frame: _Frame):
        if mask_function is causal_mask_function:
            return masks.causal(frame.offset)
        if mask_function is bidirectional_mask_function:
            return masks.sliding_window()  # unbounded on both sides: every key
        if getattr(mask_function, "__module__", None) != masking_utils.__name__:
            return None
        rule = self._RULES.get(getattr(mask_function, "__qualname__", ""))
        if rule is None:
            return None
        try:
            call = inspect.signature(rule).bind(self, frame, **inspect.getclosurevars(mask_function).nonlocals)
        except TypeError:  # a release of transformers whose function closes over other names
            return None
        return rule(*call.args, **call.kwargs)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (1 or B, L), noting whether they hold a row per batch row."""
        self.per_batch |= ids.shape[0] > 1
        return ids

    def _all(self, frame, mask_functions):
        # Remapped positions are read as index differences only where the documents of the packed
        # sequences are and-ed in, hiding the pairs of different sequences.
        if any(_is_packed_part(part) for part in mask_functions):
            frame = frame._replace(packed=True)
        return self._combined(frame, mask_functions, lambda a, b: a & b)

    def _any(self, frame, mask_functions):
        return self._combined(frame, mask_functions, lambda a, b: a | b)

    def _combined(self, frame, mask_functions, combine):
        parts = [self(part, frame) for part in mask_functions]
        if not parts or any(part is None for part in parts):
            return None
        return functools.reduce(combine, parts)

    def _window(self, frame, sliding_window):  # kv_idx > q_idx - sliding_window
        if not isinstance(sliding_window, int) or sliding_window < 1:
            return None
        return masks.sliding_window(sliding_window - 1, None, frame.offset)

    def _bidirectional_window(self, frame, sliding_window):  # |q_idx - kv_idx| <= sliding_window
        if not isinstance(sliding_window, int) or sliding_window < 0:
            return None
        return masks.sliding_window(sliding_window, sliding_window, frame.offset)

    def _chunks(self, frame, chunk_size, left_padding):
        # Chunks start at each row's first token: ids (position - left padding) // chunk_size.
        start = left_padding.view(-1, 1).to(frame.q.device)
        if bool((start == start[:1]).all()):
            start = start[:1]
        return masks.documents(self.rows((frame.q - start) // chunk_size),
                               self.rows((frame.kv - start) // chunk_size))

    def _packed(self, frame, packed_sequence_mask):
        return masks.documents(self.rows(_gather(packed_sequence_mask, frame.q)),
                               self.rows(_gather(packed_sequence_mask, frame.kv)))

    def _remapped(self, frame, mask_function, position_ids):
        if not frame.packed:
            return None
        positions = frame._replace(q=_gather(position_ids, frame.q), kv=_gather(position_ids, frame.kv))
        return self(mask_function, positions)

    def _offsets(self, frame, mask_function, q_offset, kv_offset):
        if not (isinstance(q_offset, int) and isinstance(kv_offset, int)):
            return None
        return self(mask_function, frame._replace(q=frame.q + q_offset, kv=frame.kv + kv_offset,
                                                  offset=frame.offset + q_offset - kv_offset))

    def _padding(self, frame, padding_mask):
        return masks.kept_keys(self.rows(_gather(padding_mask, frame.kv)))

    def _blocks(self, frame, block_sequence_ids):
        # Seen within one block of id >= 0: the ids < 0 of queries and keys are made never to match.
        q, kv = _gather(block_sequence_ids, frame.q), _gather(block_sequence_ids, frame.kv)
        return masks.documents(self.rows(torch.where(q >= 0, q, -1)), self.rows(torch.where(kv >= 0, kv, -2)))

    _RULES = {
        "and_masks.<locals>.and_mask": _all,
        "or_masks.<locals>.or_mask": _any,
        "sliding_window_overlay.<locals>.inner_mask": _window,
        "sliding_window_bidirectional_overlay.<locals>.inner_mask": _bidirectional_window,
        "chunked_overlay.<locals>.inner_mask": _chunks,
        "packed_sequence_mask_function.<locals>.inner_mask": _packed,
        "remap_positions_for_packed_sequence.<locals>.inner_mask": _remapped,
        "add_offsets_to_mask_function.<locals>.inner_mask": _offsets,
        "padding_mask_function.<locals>.inner_mask": _padding,
        "blockwise_overlay.<locals>.inner_mask": _blocks,
    }


def _is_packed_part(mask_function) -> bool:
    return (getattr(mask_function, "__module__", None) == masking_utils.__name__
            and getattr(mask_function, "__qualname__", "") == "packed_sequence_mask_function.<locals>.inner_mask")


def _program(batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset, mask_function, attention_mask,
             device):
    """transformers' mask as a mask program (fused_attn.masks) with the key padding of `attention_mask` in it,
    or None where its function is not one of masking_utils' or torch.compile traces the call (a program
    is built from data-dependent shapes). A tensor offset (a static cache) is read: building the program
    waits for the device anyway."""
    if torch.compiler.is_compiling():
        return None
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    frame = _Frame(q=(torch.arange(q_length, device=device) + q_offset)[None],
                   kv=(torch.arange(kv_length, device=device) + kv_offset)[None], offset=q_offset - kv_offset)
    translation = _Translation()
    mask = translation(mask_function, frame)
    if mask is None:
        return None
    padding = _key_padding(attention_mask, kv_length, kv_offset)
    if padding is not None and not bool(padding.all()):
        mask = mask & masks.kept_keys(translation.rows(padding))
    return masks.mask_program(mask, batch_size if translation.per_batch else None, None, q_length, kv_length,
                              device=device)


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
    # A plain causal mask whose skip was refused is one the model means to change as a tensor (Falcon adds
    # ALiBi to it, Doge a dynamic mask), or a decode step against a static cache: it is built in full.
    if not (_is_causal_pattern(mask_function) and not allow_is_causal_skip):
        program = _program(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                           kwargs.get("device", "cpu"))
        if program is not None:
            # As a BlockMask, which transformers passes on untouched where it would take a MaskProgram for a
            # 2-D mask (a static cache's masks are made before the model's own mask functions run).
            return masks.block_mask_of_program(program)
    if q_length > 1:  # one query row's mask is no larger than key padding
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
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.stride() != (0, 0):
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


def _check_mask_keys(module, key: torch.Tensor, built_for: int) -> None:
    """A mask for the keys it was built for: a module that joined keys of its own afterwards (DeepSeek-V4's
    compressed slots, with a bias for them written for eager's 4-D additive mask) is refused, since what
    those keys may see is not in the mask, and guessing would give a wrong answer."""
    if built_for != key.shape[2]:
        raise NotImplementedError(
            f"attention_mask: {type(module).__name__} attends over {key.shape[2]} keys, but its mask was "
            f"built for {built_for}: the module extends the keys after the mask is built, "
            "for eager's 4-D mask; use attn_implementation='eager' for this model")


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
    if isinstance(attention_mask, BlockMask):
        _check_mask_keys(module, key, attention_mask.seq_lengths[1])
        # Its mask program holds the whole pattern (causality, window, chunks, padding), as eager's mask does.
        mask, is_causal = attention_mask, False
    elif attention_mask is not None and attention_mask.dim() == 2:
        _check_mask_keys(module, key, attention_mask.shape[1])
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
        if isinstance(mask, BlockMask):  # a bias is added to a mask tensor
            mask = masks.program_of_block_mask(mask).dense()
        mask = _with_position_bias(mask, position_bias.to(query.dtype))
    out = functional.attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=bool(is_causal),
                               scale=scaling, enable_gqa=key.shape[1] != query.shape[1],
                               key_padding_mask=key_padding_mask, backend=backend,
                               causal_alignment="bottom_right", window_size=window, softcap=softcap, sinks=sinks)
    return out.transpose(1, 2), None
