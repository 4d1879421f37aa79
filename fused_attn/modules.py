"""`MultiheadAttention`, a drop-in for `torch.nn.MultiheadAttention`, `TransformerEncoderLayer`, and
`replace_attention`."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import masks
from .backends import reference
from .dropout import Dropout, next_rng
from .functional import _split_heads, split_heads_attention
from .scores import variant_of


def _attend_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """nn.MultiheadAttention's mask convention (bool True = hidden) -> ours (bool True = attend)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return ~mask
    if not mask.is_floating_point():
        raise TypeError(f"attn_mask: expected a bool or floating mask, got {mask.dtype}")
    return mask.to(dtype)


def _append_key(mask: torch.Tensor | None, visible) -> torch.Tensor | None:
    """Widens a mask by one key (an appended bias or zero key), visible to every query."""
    if mask is None:
        return None
    return F.pad(mask, (0, 1), value=visible if mask.dtype == torch.bool else 0.0)


class MultiheadAttention(nn.MultiheadAttention):
    """`torch.nn.MultiheadAttention` whose attention runs through fused_attn.

    Same constructor, parameters (names, shapes, initialisation: state dicts load both ways),
    forward arguments and return values. Differences: a query that sees no key gives 0 (not NaN);
    `is_causal=True` is honoured without an `attn_mask` (with one, the mask is taken to be causal, as
    the hint says, and the causal kernel runs instead of reading it). `backend` selects a fused_attn
    backend for this module (default: automatic).

    The score variants of `fused_attn.attention` are the module's own, set at construction:
    `causal_alignment`, `window_size`, `softcap` and `alibi_slopes` ((num_heads,) float32, kept as a
    buffer outside the state dict, so state dicts stay those of nn.MultiheadAttention). The weights
    returned with `need_weights` include them.

    In self-attention the three projections are one GEMM into a packed (…, 3E) tensor whose slices
    the kernel reads in place; the kernel writes the merged (…, E) layout the out-projection reads.
    """

    def __init__(self, embed_dim, num_heads, *args, backend: str | None = None,
                 causal_alignment: str = "top_left", window_size=None, softcap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None, **kwargs):
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
        if not isinstance(embed_dim, int) or embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim: expected a multiple of num_heads={num_heads}, got {embed_dim!r}")
        super().__init__(embed_dim, num_heads, *args, **kwargs)
        self.backend = backend
        self.causal_alignment, self.window_size, self.softcap = causal_alignment, window_size, softcap
        # Checked now, as a call of this module's heads would check them, rather than at the first call.
        if isinstance(alibi_slopes, torch.Tensor) and tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(f"alibi_slopes: expected shape (num_heads,) = ({num_heads},), got "
                             f"{tuple(alibi_slopes.shape)}")
        device = alibi_slopes.device if isinstance(alibi_slopes, torch.Tensor) else None
        variant_of(torch.empty(1, num_heads, 0, 0, device=device), causal_alignment, window_size, softcap,
                   alibi_slopes)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)

    def _variant_keywords(self) -> dict:
        """The module's score variant as `attention`'s keywords (defaults for a replaced module)."""
        return dict(causal_alignment=getattr(self, "causal_alignment", "top_left"),
                    window_size=getattr(self, "window_size", None), softcap=getattr(self, "softcap", None),
                    alibi_slopes=getattr(self, "alibi_slopes", None))

    def _project(self, query, key, value):
        """In-projections; self-attention is one GEMM whose (…, 3E) output is sliced, not copied."""
        embed = self.embed_dim
        if not self._qkv_same_embed_dim:
            biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            return (F.linear(query, self.q_proj_weight, biases[0]),
                    F.linear(key, self.k_proj_weight, biases[1]),
                    F.linear(value, self.v_proj_weight, biases[2]))
        weight, bias = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            return F.linear(query, weight, bias).unflatten(-1, (3, embed)).unbind(-2)
        weights = weight.chunk(3)
        biases = (None,) * 3 if bias is None else bias.chunk(3)
        q = F.linear(query, weights[0], biases[0])
        if key is value:
            kv_bias = None if bias is None else bias[embed:]
            k, v = F.linear(key, weight[embed:], kv_bias).unflatten(-1, (2, embed)).unbind(-2)
            return q, k, v
        return q, F.linear(key, weights[1], biases[1]), F.linear(value, weights[2], biases[2])

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        unbatched = query.dim() == 2
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            expected = 2 if unbatched else 3
            if tensor.dim() != expected:
                raise ValueError(f"{name}: expected a {expected}-D tensor (as query), got shape "
                                 f"{tuple(tensor.shape)}")
        batch_dim = 0 if self.batch_first else 1
        if unbatched:
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        seq_dim = 1 - batch_dim
        batch, len_q = query.shape[batch_dim], query.shape[seq_dim]
        for name, tensor, size in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                   ("value", value, self.vdim)):
            if tensor.shape[-1] != size:
                raise ValueError(f"{name}: expected embedding size {size}, got {tensor.shape[-1]}")

        q, k, v = self._project(query, key, value)
        program = masks.as_program(attn_mask)
        if program is not None:
            self._check_program_options(key_padding_mask)
            attn_mask = None
        attn_mask = _attend_mask(attn_mask, q.dtype)
        padding = key_padding_mask
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(*self._one_key(k, batch_dim))], dim=seq_dim)
            v = torch.cat([v, self.bias_v.expand(*self._one_key(v, batch_dim))], dim=seq_dim)
            attn_mask, padding = _append_key(attn_mask, True), _append_key(padding, False)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(self._one_key(k, batch_dim))], dim=seq_dim)
            v = torch.cat([v, v.new_zeros(self._one_key(v, batch_dim))], dim=seq_dim)
            attn_mask, padding = _append_key(attn_mask, True), _append_key(padding, False)
        len_k = k.shape[seq_dim]
        attn_mask = None if is_causal else self._heads_mask(attn_mask, batch, len_q, len_k)
        attn_mask, padding = self._merge_float_padding(attn_mask, padding, q.dtype)

        dropout_p = self.dropout if self.training else 0.0
        options = dict(attn_mask=attn_mask, is_causal=is_causal, key_padding_mask=padding)
        if program is not None:
            options["attn_mask"] = program
            # Weights returned are (N, H, L, S) anyway: their unfused pass takes the program's mask as a tensor.
            attn_mask = program.dense()
        variant = self._variant_keywords()
        weights = None
        if need_weights and dropout_p > 0.0:
            # The weights returned must be the ones (after dropout) that multiplied the values.
            heads = [_split_heads(n, t, self.num_heads, self.batch_first)
                     for n, t in (("query", q), ("key", k), ("value", v))]
            dropout = Dropout(dropout_p, next_rng(q.device))
            out, _, weights = reference.attention(*heads, attn_mask, padding, is_causal, None, dropout,
                                                  return_weights=True, variant=variant_of(heads[0], **variant))
            out = out.permute(0, 2, 1, 3) if self.batch_first else out.permute(2, 0, 1, 3)
            out = out.flatten(2)
        else:
            out = split_heads_attention(q, k, v, self.num_heads, dropout_p=dropout_p,
                                        batch_first=self.batch_first, backend=self.backend, **options, **variant)
            if need_weights:
                weights = self._weights(q, k, **dict(options, attn_mask=attn_mask), variant=variant)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)

        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(batch_dim)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _check_program_options(self, key_padding_mask) -> None:
        """What a mask program given as attn_mask cannot describe: keys the module appends, additive padding."""
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("attn_mask: a mask program is not taken with add_bias_kv or add_zero_attn (the key "
                             "they append lies outside the program's keys); pass the mask as a tensor")
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask: expected a bool mask with a mask program as attn_mask, got "
                            f"{key_padding_mask.dtype}")

    @staticmethod
    def _one_key(tensor, batch_dim):
        """The shape of one extra key for every batch element, in `tensor`'s layout."""
        shape = list(tensor.shape)
        shape[1 - batch_dim] = 1
        return shape

    def _heads_mask(self, attn_mask, batch, len_q, len_k):
        """nn.MultiheadAttention's (L, S) or (N·H, L, S) mask as a (N, H, L, S)-broadcastable view."""
        if attn_mask is None:
            return None
        if attn_mask.dim() == 2:
            expected = (len_q, len_k)
        elif attn_mask.dim() == 3:
            expected = (batch * self.num_heads, len_q, len_k)
        else:
            raise ValueError(f"attn_mask: expected a 2-D (L, S) or 3-D (N·num_heads, L, S) mask, "
                             f"got shape {tuple(attn_mask.shape)}")
        if tuple(attn_mask.shape) != expected:
            raise ValueError(f"attn_mask: expected shape {expected}, got {tuple(attn_mask.shape)}")
        return attn_mask if attn_mask.dim() == 2 else attn_mask.unflatten(0, (batch, self.num_heads))

    @staticmethod
    def _merge_float_padding(attn_mask, padding, dtype):
        """A float key_padding_mask is additive: fold it into the attention mask (as nn does)."""
        if padding is None or padding.dtype == torch.bool:
            return attn_mask, padding
        if not padding.is_floating_point():
            raise TypeError(f"key_padding_mask: expected a bool or floating mask, got {padding.dtype}")
        additive = padding.to(dtype)[:, None, None, :]
        if attn_mask is None:
            return additive, None
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(~attn_mask, float("-inf"))
        return attn_mask + additive, None

    def _weights(self, q, k, attn_mask, is_causal, key_padding_mask, variant):
        """The attention weights (N, H, L, S): a second, unfused pass over the scores."""
        q_heads = _split_heads("query", q, self.num_heads, self.batch_first)
        k_heads = _split_heads("key", k, self.num_heads, self.batch_first)
        scores = reference.masked_scores(q_heads, k_heads, attn_mask, key_padding_mask, is_causal,
                                         variant=variant_of(q_heads, **variant))
        return reference.probabilities(scores)


class TransformerEncoderLayer(nn.TransformerEncoderLayer):
    """`torch.nn.TransformerEncoderLayer` whose self-attention always runs through `self_attn`.

    In inference PyTorch's layer takes a fast path, `torch._transformer_encoder_layer_fwd`, that reads
    `self_attn`'s weights and never calls it; this layer always takes the regular path (the same norms,
    feed-forward block and dropouts as nn's), so a fused `self_attn` runs. Constructed directly, its
    `self_attn` is a fused `MultiheadAttention` (`backend` as there); `replace_attention` gives existing
    nn layers this class. Parameters, state dicts and the forward signature are nn's.

    Nested tensors: `nn.TransformerEncoder` in inference with a `src_key_padding_mask` may hand its
    layers a nested tensor of the unpadded sequences, and returns zeros at the padded positions of
    its output (before its final `norm`). This layer takes that nested tensor, attends on its padded
    form with the padding hidden, and returns a nested tensor of the same sequences, so the encoder
    decides as PyTorch decides, and its output keeps PyTorch's convention exactly. The feed-forward
    block then runs on padded positions too (PyTorch's nested path skips them).

    Where PyTorch's fast path departs from its own regular path, this layer gives the regular path's
    result: a float mask is added to the scores (the fast path treats it as bool, any non-zero value
    hiding its key: pytorch/pytorch#118628), and `is_causal=True` is honoured without a `src_mask`
    (the fast path drops the hint). A query that sees no key gives 0, as `MultiheadAttention` does.
    """

    def __init__(self, *args, backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        _fuse(self.self_attn, backend)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if src.is_nested:
            return self._forward_nested(src, src_mask, src_key_padding_mask, is_causal)
        # The masks go to self_attn as given: it reads bool masks as they are, where nn's layer would
        # first turn them into additive float masks.
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        return self.norm2(x + self._ff_block(x))

    def _forward_nested(self, src, src_mask, src_key_padding_mask, is_causal):
        """A nested (B, L_b, E) batch: padded, attended with the padding hidden, nested again."""
        if src_mask is not None or src_key_padding_mask is not None:
            raise ValueError("src: a nested tensor takes neither src_mask nor src_key_padding_mask "
                             "(its sequences' lengths are its padding)")
        if not self.self_attn.batch_first:
            raise ValueError("src: a nested tensor needs a layer with batch_first=True")
        lengths = [len(sequence) for sequence in src.unbind()]
        padded = src.to_padded_tensor(0.0)
        positions = torch.arange(padded.shape[1], device=padded.device)
        padding = positions >= torch.tensor(lengths, device=padded.device)[:, None]
        out = self.forward(padded, None, padding, is_causal)
        return torch.nested.as_nested_tensor([row[:length] for row, length in zip(out, lengths)])


def _fuse(module: nn.MultiheadAttention, backend: str | None) -> None:
    """Makes an nn.MultiheadAttention a fused one, in place (same object, parameters and hooks)."""
    if module.head_dim * module.num_heads != module.embed_dim:
        raise ValueError(f"model: embed_dim {module.embed_dim} of an attention module is not "
                         f"a multiple of num_heads={module.num_heads}")
    module.__class__ = MultiheadAttention
    module.backend = backend


def replace_attention(model: nn.Module, backend: str | None = None) -> nn.Module:
    """Makes every `nn.MultiheadAttention` in `model` (itself included) a fused one, in place.

    The modules stay the same objects, with the same parameters, buffers and hooks, so optimizers,
    state dicts (keys and shapes are PyTorch's), pickling and references to them are unaffected.
    Returns `model`.

    Every `nn.TransformerEncoderLayer` (exactly that class) becomes a fused_attn
    `TransformerEncoderLayer`, whose forward never takes PyTorch's inference fast path
    (`torch._transformer_encoder_layer_fwd`, which would bypass its attention module): so in `eval()`
    under `no_grad` too, `nn.TransformerEncoder`, `nn.Transformer` and bare layers run the fused
    kernels. Where `nn.TransformerEncoder` would use nested tensors (`enable_nested_tensor` with a
    `src_key_padding_mask`), it still does, and its output is PyTorch's: zeros at the padded positions
    (before its final `norm`), computed values elsewhere. A float `src_mask` is additive, as on
    PyTorch's regular path (its fast path misreads one that is not 0/-inf; see
    `TransformerEncoderLayer`). `nn.TransformerDecoderLayer` has no fast path.

    A subclass of `nn.TransformerEncoderLayer` keeps its class, hence its forward; it gets a warning,
    since whatever reaches nn's forward in inference runs PyTorch's fast path unless
    `torch.backends.mha.set_fastpath_enabled(False)`.
    """
    for module in model.modules():
        if type(module) is nn.TransformerEncoderLayer:
            module.__class__ = TransformerEncoderLayer
        elif isinstance(module, nn.TransformerEncoderLayer) and not isinstance(module, TransformerEncoderLayer):
            warnings.warn(f"model: {type(module).__qualname__} subclasses nn.TransformerEncoderLayer and keeps "
                          f"its forward; in inference nn.TransformerEncoderLayer.forward takes PyTorch's fast "
                          f"path, which bypasses the fused attention (torch.backends.mha.set_fastpath_enabled"
                          f"(False) turns it off)", stacklevel=2)
        if isinstance(module, nn.MultiheadAttention) and not isinstance(module, MultiheadAttention):
            _fuse(module, backend)
    return model
