"""Hugging Face transformers models on fused_attn (fused_attn.integrations.transformers), built from
small configs with random weights: logits and one training step's gradients against `eager` by the
project's criterion (eager's definition in float64 is exact, eager in the test's dtype sets the
allowed error), and
greedy generation equal to `sdpa`'s (`eager`'s where sdpa refuses the model)."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

transformers = pytest.importorskip("transformers")

import fused_attn  # noqa: E402
from fused_attn import masks, testing  # noqa: E402
from fused_attn.integrations import transformers as fused_transformers  # noqa: E402

NAME = fused_transformers.register()
ORACLE = "float64_oracle"
VOCAB, LENGTH = 96, 14

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, attention_dropout=0.0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=5, **COMMON),
    "gemma2": lambda: transformers.Gemma2Config(num_key_value_heads=1, head_dim=16, sliding_window=5,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                                query_pre_attn_scalar=16, **COMMON),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    # Attention sinks in every layer, sliding-window and full layers alternating, a mixture of experts.
    "gpt_oss": lambda: transformers.GptOssConfig(num_key_value_heads=2, head_dim=16, sliding_window=5,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 layer_types=["sliding_attention", "full_attention"], **COMMON),
}
# What each model's generation is compared with: sdpa refuses softcap and sinks.
GENERATE_BASELINE = {"llama": "sdpa", "mistral": "sdpa", "gemma2": "eager", "gpt2": "sdpa", "gpt_oss": "eager"}


def build(name: str, attn_implementation: str = "eager"):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    # Experts as a loop of matmuls: the grouped products take no float64 (the oracle's dtype).
    experts = dict(experts_implementation="eager") if getattr(config, "num_local_experts", None) else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                          **experts).eval()
    with torch.no_grad():  # sinks around the scores' scale (initialised near 0, they would hardly matter)
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.5)
    return model


def padded_batch(generator, side: str = "left", batch: int = 3, length: int = LENGTH):
    """Token ids and a 2-D attention mask: one row unpadded, the others padded on `side` by different
    amounts."""
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        attention_mask[row, slice(None, row * 3) if side == "left" else slice(length - row * 3, None)] = 0
    return ids, attention_mask


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                     s_aux=None, **kwargs):
    """The float64 oracle: eager's definition on transformers' own bool mask, in float64 throughout,
    with rows that see no key giving 0. (eager itself softmaxes float64 scores in float32, where its
    float64 mask minimum becomes -inf: rows that see no key turn into NaN.) Sinks (`s_aux`, gpt-oss)
    are one more column of the softmax, dropped before the values are weighed."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.einsum("bhid,bhjd->bhij", query.double(), key.double()) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    if s_aux is not None:
        sink = s_aux.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhij,bhjd->bhid", weights, value.double()).to(query.dtype)
    return out.transpose(1, 2), None


transformers.AttentionInterface.register(ORACLE, oracle_attention)
transformers.masking_utils.AttentionMaskInterface.register(
    ORACLE, lambda *args, **kwargs: transformers.masking_utils.sdpa_mask(
        *args, **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False}))


class CallLog:
    """Spies on the integration's calls of fused_attn.attention: each call's keyword arguments and
    query length."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = fused_transformers.functional.attention

        def spy(*args, **kwargs):
            self.calls.append(dict(kwargs, query_length=args[0].shape[2]))
            return original(*args, **kwargs)

        monkeypatch.setattr(fused_transformers.functional, "attention", spy)


def assert_close(actual, exact, same_dtype, dtype, name="logits"):
    error = testing.max_error(actual, exact)
    allowed = testing.allowed_error(name, exact, same_dtype, dtype)
    assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"


def logits_of(model, implementation, dtype, ids, attention_mask):
    model = copy.deepcopy(model).to(dtype)
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_padded_prefill_logits_match_eager(monkeypatch, generator, name, side, dtype):
    model = build(name)
    ids, attention_mask = padded_batch(generator, side)
    exact = logits_of(model, ORACLE, torch.float64, ids, attention_mask)
    same_dtype = logits_of(model, "eager", dtype, ids, attention_mask)
    log = CallLog(monkeypatch)
    actual = logits_of(model, NAME, dtype, ids, attention_mask)
    valid = attention_mask.bool()  # padded positions attend to nothing; their logits are not defined
    assert_close(actual[valid], exact[valid], same_dtype[valid], dtype)
    # One call per layer, causal in-kernel with key padding: no (L_q, L_k) mask was built.
    assert len(log.calls) == model.config.num_hidden_layers
    for call in log.calls:
        assert call["attn_mask"] is None and call["is_causal"] and call["causal_alignment"] == "bottom_right"
        assert call["key_padding_mask"] is not None
    windows = [call["window_size"] for call in log.calls]
    if name == "mistral":
        assert windows == [(4, 0), (4, 0)]
    elif name in ("gemma2", "gpt_oss"):
        assert sorted(windows, key=str) == sorted([(4, 0), None], key=str)
        if name == "gemma2":
            assert all(call["softcap"] == 2.0 for call in log.calls)
    else:
        assert windows == [None, None]
    # gpt-oss's sinks reach the kernels, each layer's own.
    sinks = [call["sinks"] for call in log.calls]
    assert all(sink is not None for sink in sinks) if name == "gpt_oss" else sinks == [None] * len(sinks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches(monkeypatch, generator, name):
    model = build(name)
    ids, attention_mask = padded_batch(generator)
    tokens = {}
    for implementation in (GENERATE_BASELINE[name], NAME):
        model.set_attn_implementation(implementation)
        log = CallLog(monkeypatch)
        tokens[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=8,
                                                min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens[NAME], tokens[GENERATE_BASELINE[name]])
    # Prefill, then one call per layer per new token with a single query against the cache.
    layers = model.config.num_hidden_layers
    assert [call["query_length"] for call in log.calls] == [LENGTH] * layers + [1] * (7 * layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2", "gpt_oss"])
def test_training_step_gradients_match_eager(generator, name, dtype):
    model = build(name).train()
    ids, attention_mask = padded_batch(generator)
    labels = ids.masked_fill(attention_mask == 0, -100)

    def gradients(implementation, dtype):
        trained = copy.deepcopy(model).to(dtype)
        trained.set_attn_implementation(implementation)
        trained(ids, attention_mask=attention_mask, labels=labels).loss.backward()
        return {name: parameter.grad for name, parameter in trained.named_parameters() if parameter.grad is not None}

    exact, same_dtype, actual = gradients(ORACLE, torch.float64), gradients("eager", dtype), gradients(NAME, dtype)
    assert actual.keys() == exact.keys()
    for parameter in exact:
        assert_close(actual[parameter], exact[parameter], same_dtype[parameter], dtype, name=parameter)


def test_training_passes_dropout_to_the_kernels(monkeypatch, generator):
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.25
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    ids, attention_mask = padded_batch(generator)
    log = CallLog(monkeypatch)
    model.train()(ids, attention_mask=attention_mask)
    model.eval()(ids, attention_mask=attention_mask)
    assert [call["dropout_p"] for call in log.calls] == [0.25, 0.25, 0.0, 0.0]


def right_padded_mask() -> torch.Tensor:
    """(3, LENGTH): one row unpadded, two padded at the end by 4 and 9 tokens."""
    attention_mask = torch.ones(3, LENGTH, dtype=torch.long)
    attention_mask[1, -4:] = 0
    attention_mask[2, -9:] = 0
    return attention_mask


def encoded(model, implementation, dtype, ids, attention_mask):
    """An encoder's last hidden state, a copy of `model` in `dtype` on `implementation`."""
    encoder = copy.deepcopy(model).to(dtype)
    encoder.set_attn_implementation(implementation)
    with torch.no_grad():
        return encoder(ids, attention_mask=attention_mask).last_hidden_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bert_with_padding_matches_eager(monkeypatch, generator, dtype):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64,
                                     attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=generator)
    attention_mask = right_padded_mask()
    exact, same_dtype = encoded(model, ORACLE, torch.float64, ids, attention_mask), \
        encoded(model, "eager", dtype, ids, attention_mask)
    log = CallLog(monkeypatch)
    # Padded queries still attend to the unpadded keys, so every position is compared.
    assert_close(encoded(model, NAME, dtype, ids, attention_mask), exact, same_dtype, dtype, name="last_hidden_state")
    assert len(log.calls) == 2 and all(not call["is_causal"] for call in log.calls)
    # The padding reaches the kernels as a (B, 1, 1, L_k) view, never as an (L_q, L_k) mask.
    assert all(call["attn_mask"].shape == (3, 1, 1, LENGTH) for call in log.calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_modernbert_with_padding_matches_eager(monkeypatch, generator, dtype):
    """ModernBERT's local layers attend within a bidirectional sliding window, a mask transformers
    builds with keywords that once reached `sdpa_mask` twice (`allow_is_bidirectional_skip`). Global
    and local layers both run in the kernels: the padding as a (B, 1, 1, L_k) view, the local window
    (|i - j| <= local_attention / 2) as `window_size`."""
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                           num_hidden_layers=3, num_attention_heads=4, global_attn_every_n_layers=2,
                                           local_attention=8, max_position_embeddings=64, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    model = transformers.ModernBertModel(config).eval()
    ids = torch.randint(3, VOCAB, (3, LENGTH), generator=generator)
    attention_mask = right_padded_mask()
    exact, same_dtype = encoded(model, ORACLE, torch.float64, ids, attention_mask), \
        encoded(model, "eager", dtype, ids, attention_mask)
    log = CallLog(monkeypatch)
    actual = encoded(model, NAME, dtype, ids, attention_mask)
    # A padded query of a local layer may see no key (eager then averages the padding): compare the rest.
    valid = attention_mask.bool()
    assert_close(actual[valid], exact[valid], same_dtype[valid], dtype, name="last_hidden_state")
    assert [call["window_size"] for call in log.calls] == [None, (4, 4), None]
    assert all(call["attn_mask"].shape == (3, 1, 1, LENGTH) and not call["is_causal"] for call in log.calls)


@pytest.mark.parametrize("padded", [False, True])
def test_the_mask_not_the_module_says_causal(monkeypatch, generator, padded):
    """PaliGemma's Gemma modules say `is_causal = False` (its config asks for bidirectional attention)
    while PaliGemma builds them a causal mask: eager follows the mask, and so must fused_attn, with
    nothing padded too (where no key padding reaches the kernels)."""
    torch.manual_seed(0)
    config = transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        image_token_index=VOCAB - 1, projection_dim=64)
    model = transformers.PaliGemmaModel(config).eval()
    assert model.language_model.layers[0].self_attn.is_causal is False
    ids = torch.randint(0, VOCAB - 1, (2, LENGTH), generator=generator)
    attention_mask = torch.ones(2, LENGTH, dtype=torch.long)
    attention_mask[1, -3:] = 0 if padded else 1

    def hidden(implementation, dtype):
        copied = copy.deepcopy(model).to(dtype)
        copied.set_attn_implementation(implementation)
        with torch.no_grad():
            return copied(ids, attention_mask=attention_mask).last_hidden_state

    exact, same_dtype = hidden(ORACLE, torch.float64), hidden("eager", torch.float32)
    log = CallLog(monkeypatch)
    assert_close(hidden(NAME, torch.float32), exact, same_dtype, torch.float32, name="last_hidden_state")
    assert len(log.calls) == 2 and all(call["is_causal"] and call["attn_mask"] is None for call in log.calls)
    assert all((call["key_padding_mask"] is not None) == padded for call in log.calls)


class ProgramLog:
    """Spies on the mask programs built (fused_attn.masks.mask_program) and fails on the warning that a
    mask was built in full."""

    def __init__(self, monkeypatch):
        self.built = []
        original = fused_transformers.masks.mask_program
        monkeypatch.setattr(fused_transformers.masks, "mask_program",
                            lambda *args, **kwargs: self.built.append(original(*args, **kwargs)) or self.built[-1])
        fused_transformers._note_full_mask.cache_clear()

    @staticmethod
    def read(call) -> masks.MaskProgram | None:
        """The mask program a call of fused_attn.attention read: its attn_mask is the program's BlockMask."""
        mask = call["attn_mask"]
        return masks.program_of_block_mask(mask) if isinstance(mask, BlockMask) else None

    @contextlib.contextmanager
    def no_full_mask(self):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*built in full")
            yield


def packed_position_ids(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(length) for length in lengths])[None]


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_from_position_ids_run_as_one_mask_program(monkeypatch, generator, name):
    """Sequences packed into one row, found from the position ids (no cu_seq_lens): their documents, causal
    within each (in Mistral's sliding window), as one mask program that every layer reads, built once."""
    model = build(name)
    lengths = [100, 150, 50]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=generator)
    position_ids = packed_position_ids(lengths)

    def logits(implementation, dtype):
        packed = copy.deepcopy(model).to(dtype)
        packed.set_attn_implementation(implementation)
        with torch.no_grad():
            return packed(ids, position_ids=position_ids, use_cache=False).logits

    exact, same_dtype = logits(ORACLE, torch.float64), logits("eager", torch.float32)
    log, programs = CallLog(monkeypatch), ProgramLog(monkeypatch)
    with programs.no_full_mask():
        actual = logits(NAME, torch.float32)
    assert_close(actual, exact, same_dtype, torch.float32)
    assert len(programs.built) == 1 and len(log.calls) == model.config.num_hidden_layers
    assert all(programs.read(call) is programs.built[0] and not call["is_causal"] for call in log.calls)
    # Of 3 × 3 tiles, those above the diagonal and that of the last sequence's queries (250..299) against
    # the first 128 keys (the first two sequences') are never visited.
    assert programs.built[0].counts()["empty"] == 4


def llama4(chunk_size: int = 128):
    """A small Llama 4 text model: a chunked layer (RoPE, attention within chunks of `chunk_size`) and a full
    one (no RoPE, temperature tuning), dense feed-forward layers."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        attention_chunk_size=chunk_size, no_rope_layer_interval=2, interleave_moe_layer_step=100)
    assert config.layer_types == ["chunked_attention", "full_attention"]
    return transformers.Llama4ForCausalLM(config).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama4_chunked_attention_runs_as_a_mask_program(monkeypatch, generator, dtype):
    """Llama 4's chunks (start after each row's left padding) over 330 tokens, 3 chunks: the chunked layer
    reads a mask program, the full layer runs causal with key padding."""
    model = llama4()
    ids = torch.randint(0, VOCAB, (2, 330), generator=generator)
    attention_mask = torch.ones(2, 330, dtype=torch.long)
    attention_mask[1, :45] = 0
    exact = logits_of(model, ORACLE, torch.float64, ids, attention_mask)
    same_dtype = logits_of(model, "eager", dtype, ids, attention_mask)
    log, programs = CallLog(monkeypatch), ProgramLog(monkeypatch)
    with programs.no_full_mask():
        actual = logits_of(model, NAME, dtype, ids, attention_mask)
    valid = attention_mask.bool()
    assert_close(actual[valid], exact[valid], same_dtype[valid], dtype)
    assert len(programs.built) == 1
    chunked, full = log.calls
    assert programs.read(chunked) is programs.built[0] and not chunked["is_causal"]
    assert full["attn_mask"] is None and full["is_causal"] and full["key_padding_mask"] is not None


def test_llama4_generation_across_a_chunk_boundary_matches_eager(monkeypatch, generator):
    """Greedy decoding from a left-padded prompt of 120 tokens past the chunk boundary at 128: each step's
    chunked layer reads a mask program of one query row."""
    model = llama4()
    ids = torch.randint(0, VOCAB, (2, 120), generator=generator)
    attention_mask = torch.ones(2, 120, dtype=torch.long)
    attention_mask[1, :17] = 0
    tokens = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        log, programs = CallLog(monkeypatch), ProgramLog(monkeypatch)
        with programs.no_full_mask():
            tokens[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=12,
                                                    min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens[NAME], tokens["eager"])
    assert len(programs.built) == 12  # one per forward, the prefill's and each step's
    assert [call["query_length"] for call in log.calls[::2]] == [120] + [1] * 11


def test_unrecognised_mask_functions_are_built_in_full(generator):
    """A mask function that is not one of transformers' own is built as sdpa builds it, with the warning."""
    def every_other_key(batch_idx, head_idx, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx % 2 == 0)

    fused_transformers._note_full_mask.cache_clear()
    attention_mask = torch.ones(2, 20, dtype=torch.bool)
    attention_mask[0, :3] = False
    with pytest.warns(UserWarning, match="built in full"):
        mask = fused_transformers.build_mask(2, 20, 20, mask_function=every_other_key, attention_mask=attention_mask)
    expected = transformers.masking_utils.sdpa_mask(2, 20, 20, mask_function=every_other_key,
                                                    attention_mask=attention_mask, allow_is_causal_skip=False)
    assert torch.equal(mask, expected)


def mask_patterns():
    """transformers' mask functions as its create_*_mask functions combine them, each with build_mask's
    arguments: {name: (batch, L_q, L_k, q_offset, kv_offset, mask_function, attention_mask)}."""
    masking = transformers.masking_utils
    padded = torch.ones(3, 405, dtype=torch.bool)
    padded[1, :37], padded[2, :150] = False, False
    left_padding = (padded.cumsum(-1) == 0).sum(-1)
    position_ids = packed_position_ids([100, 150, 50]).expand(2, -1).clone()
    position_ids[1] = packed_position_ids([220, 80])
    sequences = masking.packed_sequence_mask_function(masking.find_packed_sequence_indices(position_ids))

    def packed(mask_function):
        return masking.and_masks(masking.remap_positions_for_packed_sequence(mask_function, position_ids), sequences)

    blocks = torch.full((2, 300), -1)
    blocks[0, 20:80], blocks[1, 100:260] = 0, 1
    return {
        "chunked_left_padded": (3, 400, 400, 0, 0, masking.chunked_causal_mask_function(128, left_padding),
                                padded[:, :400]),
        "chunked_decode_steps": (3, 5, 405, 400, 0, masking.chunked_causal_mask_function(128, left_padding), padded),
        "sliding_window_cache_offsets": (2, 7, 310, 350, 57, masking.sliding_window_causal_mask_function(250), None),
        "causal_static_cache": (2, 10, 512, torch.tensor(100), 0, masking.causal_mask_function, None),
        "packed_causal": (2, 300, 300, 0, 0, packed(masking.causal_mask_function), None),
        "packed_sliding_window": (2, 300, 300, 0, 0, packed(masking.sliding_window_causal_mask_function(60)), None),
        "packed_chunked": (2, 300, 300, 0, 0,
                           packed(masking.chunked_causal_mask_function(64, torch.zeros(2, dtype=torch.long))), None),
        "packed_bidirectional": (2, 300, 300, 0, 0, masking.and_masks(masking.bidirectional_mask_function,
                                                                      sequences), None),
        "blockwise_or_causal_in_window": (2, 300, 300, 0, 0, masking.and_masks(
            masking.or_masks(masking.causal_mask_function, masking.blockwise_overlay(blocks)),
            masking.sliding_window_overlay(100)), padded[1:, :300]),
        "bidirectional_window_or_causal": (2, 200, 260, 30, 0, masking.or_masks(
            masking.sliding_window_bidirectional_overlay(40), masking.causal_mask_function), None),
        "offsets_and_padding_function": (2, 150, 150, 0, 0, masking.add_offsets_to_mask_function(masking.and_masks(
            masking.causal_mask_function, masking.padding_mask_function(padded[1:, 100:])), 10, 0), None),
    }


@pytest.mark.parametrize("pattern", list(mask_patterns()))
def test_mask_programs_are_the_masks_sdpa_builds(pattern):
    """Each pattern of transformers' mask functions gives a mask program that means exactly the bool
    mask sdpa_mask builds from the same arguments, without a warning."""
    batch, len_q, len_k, q_offset, kv_offset, mask_function, attention_mask = mask_patterns()[pattern]
    arguments = dict(batch_size=batch, q_length=len_q, kv_length=len_k, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block_mask = fused_transformers.build_mask(**arguments)
    expected = transformers.masking_utils.sdpa_mask(**arguments, allow_is_causal_skip=False)
    assert isinstance(block_mask, BlockMask)
    assert torch.equal(masks.program_of_block_mask(block_mask).dense().expand_as(expected), expected)


def test_registration_errors_and_refusals():
    with pytest.raises(ValueError, match="backend"):
        fused_transformers.register(backend="no_such_backend")
    with pytest.raises(ValueError, match="name"):
        fused_transformers.register(name="")
    query = torch.randn(1, 2, 3, 8)
    # A 2-D mask is key padding for the keys it was built for; a module that joins keys of its own
    # afterwards (DeepSeek-V4's compressed slots) is refused, not guessed at.
    with pytest.raises(NotImplementedError, match="attention_mask: Module attends over 3 keys, but its mask "
                                                  "was built for 2"):
        fused_transformers.attention_forward(torch.nn.Module(), query, query, query, torch.ones(1, 2, dtype=torch.bool))


def test_s_aux_runs_as_sinks(generator):
    """gpt-oss's `s_aux` is fused_attn's `sinks`: the same call, the same result and sink gradient."""
    query, key, value = (torch.randn(2, 4, 6, 8, generator=generator) for _ in range(3))
    s_aux = torch.randn(4, generator=generator, requires_grad=True)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fused_transformers.attention_forward(module, query, key, value, None, scaling=0.3, s_aux=s_aux)
    expected = fused_attn.attention(query, key, value, is_causal=True, scale=0.3, sinks=s_aux.detach(),
                                    backend="reference")
    torch.testing.assert_close(out.transpose(1, 2), expected)
    (grad,) = torch.autograd.grad(out.sum(), s_aux)
    sinks = s_aux.detach().requires_grad_()
    (expected_grad,) = torch.autograd.grad(fused_attn.attention(query, key, value, is_causal=True, scale=0.3,
                                                                sinks=sinks, backend="reference").sum(), sinks)
    torch.testing.assert_close(grad, expected_grad)


def test_pinned_backend(monkeypatch, generator):
    name = fused_transformers.register("fused_attn_reference", backend="reference")
    model = build("llama", name)
    log = CallLog(monkeypatch)
    ids, attention_mask = padded_batch(generator)
    with torch.no_grad():
        model(ids, attention_mask=attention_mask)
    assert [call["backend"] for call in log.calls] == ["reference", "reference"]


def test_importing_fused_attn_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, fused_attn; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


def test_from_pretrained_with_the_registered_name(tmp_path, monkeypatch, generator):
    build("mistral").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME).eval()
    assert model.config._attn_implementation == NAME
    log = CallLog(monkeypatch)
    ids, attention_mask = padded_batch(generator)
    with torch.no_grad():
        model(ids, attention_mask=attention_mask)
    assert len(log.calls) == model.config.num_hidden_layers


def test_static_cache_generation_matches_sdpa(monkeypatch, generator):
    """A static cache's queries do not end on its last slot: the prefill's mask is a mask program (the
    decode steps' a (B, 1, 1, L_k) mask, built as the model asks, to be changed as a tensor)."""
    model = build("llama")
    ids, attention_mask = padded_batch(generator)
    tokens = {}
    for implementation in ("sdpa", NAME):
        model.set_attn_implementation(implementation)
        log = CallLog(monkeypatch)
        tokens[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5,
                                                do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(tokens[NAME], tokens["sdpa"])
    layers = model.config.num_hidden_layers
    assert [call["query_length"] for call in log.calls] == [LENGTH] * layers + [1] * (4 * layers)
    assert all(isinstance(call["attn_mask"], BlockMask) for call in log.calls[:layers])
    slots = log.calls[0]["attn_mask"].shape[-1]  # the cache's
    assert all(tuple(call["attn_mask"].shape[-2:]) == (1, slots) for call in log.calls[layers:])


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_triton_kernels_through_the_integration(generator, name):
    """The GPU kernels (here under Triton's interpreter) with the mapping: bottom-right causal, key
    padding, window and softcap."""
    from fused_attn.backends import registry

    if registry.get("triton").unavailable() is not None:
        pytest.skip(registry.get("triton").unavailable())
    implementation = fused_transformers.register("fused_attn_triton", backend="triton")
    model = build(name)
    ids, attention_mask = padded_batch(generator, "right")
    valid = attention_mask.bool()
    exact = logits_of(model, ORACLE, torch.float64, ids, attention_mask)[valid]
    same_dtype = logits_of(model, "eager", torch.float32, ids, attention_mask)[valid]
    actual = logits_of(model, implementation, torch.float32, ids, attention_mask)[valid]
    assert_close(actual, exact, same_dtype, torch.float32)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_packed_sequences_with_flash_attn_keywords_run_as_varlen(monkeypatch, generator, name):
    """cu_seq_lens_q / cu_seq_lens_k (as DataCollatorWithFlattening makes them) against eager on the
    mask transformers builds from the position ids; gradients too."""
    model = build(name).train()
    lengths = [6, 3, LENGTH - 9]
    ids = torch.randint(0, VOCAB, (1, LENGTH), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    cu_seqlens = torch.tensor([0, 6, 9, LENGTH], dtype=torch.int32)
    packed = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max(lengths),
                  max_length_k=max(lengths))
    calls = []
    original = fused_transformers.varlen.attention_varlen
    monkeypatch.setattr(fused_transformers.varlen, "attention_varlen",
                        lambda *args, **kwargs: calls.append(kwargs) or original(*args, **kwargs))

    def run(implementation, dtype, **extra):
        trained = copy.deepcopy(model).to(dtype)
        trained.set_attn_implementation(implementation)
        logits = trained(ids, position_ids=position_ids, use_cache=False, **extra).logits
        logits.square().mean().backward()
        grads = {key: parameter.grad for key, parameter in trained.named_parameters() if parameter.grad is not None}
        return logits.detach(), grads

    (exact, exact_grads), (same, same_grads) = run(ORACLE, torch.float64), run("eager", torch.float32)
    actual, actual_grads = run(NAME, torch.float32, **packed)
    assert len(calls) == model.config.num_hidden_layers
    assert_close(actual, exact, same, torch.float32)
    for parameter in exact_grads:
        assert_close(actual_grads[parameter], exact_grads[parameter], same_grads[parameter], torch.float32,
                     name=parameter)
