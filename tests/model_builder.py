"""Tiny random models of the transformers families that take the attention interface, and the check
of fused_attn's integration on each (tests/test_transformers_sweep.py).

One builder for every family: the family's default config, scaled down by rules on its keys (width,
heads, layers, feed-forward, experts, positions, windows, images, vocabulary), its sub-configs
(the text and vision configs of multimodal models) alike; nothing is written per family. A family is
a model type of transformers' auto base-model mapping whose class has `_supports_attention_backend`.

    .venv/bin/python tests/model_builder.py            # the whole sweep; writes tests/transformers_sweep.md
    .venv/bin/python tests/model_builder.py llama bert # some families; prints them only
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

from fused_attn import testing
from fused_attn.integrations import transformers as fused_transformers

NAME = fused_transformers.register()
SUMMARY = Path(__file__).with_name("transformers_sweep.md")

BATCH, LENGTH, PADDING = 3, 14, (0, 2, 3)  # right padding per row; every query sees some key
# Heads of 128, as most real models have (and as some modeling files assume: Qwen2-VL's rotary sections).
VOCAB, HEADS, HEAD_DIM, LAYERS, FFN = 256, 4, 128, 2, 96
WIDTH = HEADS * HEAD_DIM
MAX_PARAMETERS = 250_000_000  # beyond, the three copies (one in float64) need more than a few GB

WIDTH_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "embedding_size", "word_embed_proj_dim"}
HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
             "decoder_attention_heads"}
KV_HEAD_KEYS = {"num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"}
LAYER_KEY = re.compile(r"(num_|n_)?(hidden_|encoder_|decoder_)?layers?|depth")
POSITION_KEYS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length"}
SMALL = {  # key: value, where the default is larger
    "head_dim": HEAD_DIM, "d_kv": HEAD_DIM, "qk_rope_head_dim": HEAD_DIM, "qk_nope_head_dim": HEAD_DIM,
    "v_head_dim": HEAD_DIM, "kv_lora_rank": 64, "q_lora_rank": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "sliding_window": 6, "local_attention": 8,
    "attention_chunk_size": 8, "image_size": 32, "patch_size": 8,
}
FEATURE_KEYS = ("num_mel_bins", "feature_size", "input_feat_per_channel", "num_mel_filters")
FILL = {"head_dim": HEAD_DIM, "num_experts_per_tok": 2}  # where a default config leaves them None
TOKEN_KEY = re.compile(r".*token_(id|index|ids)")


@dataclasses.dataclass
class Outcome:
    family: str
    status: str  # matched, mismatched, not observed, refused, not buildable, excluded
    detail: str = ""
    seconds: float = 0.0


# --- families and configs ------------------------------------------------------------------------


def families() -> list[str]:
    """Every model type of the auto base-model mapping (names only, cheap; `model_class` says
    whether the family takes the attention interface)."""
    return sorted(MODEL_MAPPING_NAMES)


def model_class(family: str):
    names = MODEL_MAPPING_NAMES[family]
    return getattr(transformers, names if isinstance(names, str) else names[0])


def _specials(values, found: set) -> set:
    """The special token ids anywhere in a config dict."""
    for key, value in values.items():
        if isinstance(value, dict):
            _specials(value, found)
        elif TOKEN_KEY.fullmatch(str(key)):
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
                    found.add(token)
    return found


def _layer_indices(values: dict, layers: int, wanted: int) -> list[int]:
    """Which of the default layers to keep: the first, and the first of another type where a per-layer
    list of types says there is one (a sliding layer beside a full one, attention beside mamba);
    else the first `wanted`."""
    for value in (values.get("layer_types"), *values.values()):
        if isinstance(value, list) and len(value) == layers and all(isinstance(v, str) for v in value):
            other = next((i for i, kind in enumerate(value) if kind != value[0]), None)
            if other is not None:
                return [0, other]
    return list(range(min(layers, wanted)))


def _shrink(values: dict, tokens: dict, wanted: int) -> dict:
    """A config dict scaled down by the rules above; nested dicts (sub-configs, rope parameters) alike."""
    layers = next((values[key] for key in ("num_hidden_layers", "num_layers", "n_layer")
                   if isinstance(values.get(key), int)), None)
    keep = _layer_indices(values, layers, wanted) if layers else None
    heads = next((values[key] for key in HEAD_KEYS if isinstance(values.get(key), int)), None)
    out = {}
    for key, value in values.items():
        if key in ("out_features", "out_indices"):  # backbone stages named by layer: the last one
            value = None
        elif keep and isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            # per-layer settings keyed by layer index (Gemma 4's per_layer_config)
            value = {str(new): _shrink(value[k], tokens, wanted) if isinstance(value[k], dict) else value[k]
                     for k in value for new, old in enumerate(keep) if int(k) == old}
        elif isinstance(value, dict):
            value = _shrink(value, tokens, wanted)
        elif TOKEN_KEY.fullmatch(str(key)):
            value = [tokens.get(v, v) for v in value] if isinstance(value, list) else tokens.get(value, value)
        elif keep and isinstance(value, list) and len(value) == layers:
            value = [value[i] for i in keep]
        elif key == "image_size" and isinstance(value, (list, tuple)):
            value = [SMALL["image_size"]] * len(value)
        elif value is None and key in FILL:
            value = FILL[key]
        elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
            value = _shrunk_int(str(key), value, heads, len(keep) if keep else wanted)
        out[key] = value
    return out


def _shrunk_int(key: str, value: int, heads: int | None, layers: int | None) -> int:
    if key in WIDTH_KEYS:
        return min(value, WIDTH)
    if key in HEAD_KEYS:
        return min(value, HEADS)
    if key in KV_HEAD_KEYS:  # keeps MQA, GQA and MHA apart
        return 1 if value == 1 else HEADS if heads is None or value >= heads else 2
    if LAYER_KEY.fullmatch(key):
        return min(value, layers)
    if "intermediate" in key or "ffn" in key or key in ("d_ff", "n_inner"):
        return min(value, FFN)
    if key in POSITION_KEYS:
        return min(value, 128)
    if key == "vocab_size":
        return VOCAB
    return min(value, SMALL.get(key, value))


def tiny_config(family: str, layers: int = LAYERS):
    """The family's default config, scaled down to `layers` layers. Special token ids above the small
    vocabulary are moved to its top, the same id to the same place."""
    values = CONFIG_MAPPING[family]().to_dict()
    large = sorted(token for token in _specials(values, set()) if token >= VOCAB)
    tokens = {token: VOCAB - 1 - i for i, token in enumerate(large)}
    return CONFIG_MAPPING[family].from_dict(_shrink(values, tokens, layers))


# --- inputs and runs ------------------------------------------------------------------------------


def _find(config, key):
    """A config value, or its first sub-config's."""
    if getattr(config, key, None) is not None:
        return getattr(config, key)
    for name in getattr(config, "sub_configs", {}):
        if (value := _find(getattr(config, name, None) or object(), key)) is not None:
            return value
    return None


def _flat_keys(values: dict):
    for key, value in values.items():
        yield key
        if isinstance(value, dict):
            yield from _flat_keys(value)


def make_inputs(model, config, generator) -> dict:
    """Random inputs by the model's forward signature: token ids (no special token) with right padding,
    decoder ids for encoder-decoders, images at the config's size."""
    parameters = inspect.signature(model.forward).parameters
    inputs = {}
    if "input_ids" in parameters:
        allowed = torch.tensor(sorted(set(range(VOCAB)) - _specials(config.to_dict(), set())))
        inputs["input_ids"] = allowed[torch.randint(0, len(allowed), (BATCH, LENGTH), generator=generator)]
        if "attention_mask" in parameters:
            mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
            for row, padded in enumerate(PADDING):
                mask[row, LENGTH - padded:] = 0
            inputs["attention_mask"] = mask
        if "decoder_input_ids" in parameters:
            inputs["decoder_input_ids"] = inputs["input_ids"].flip(1)
    # Images where they are the main input, or beside text where no image token places them (CLIP's pairs).
    images_in_text = any("image_token" in str(key) for key in _flat_keys(config.to_dict()))
    if model.main_input_name == "pixel_values" or "pixel_values" in parameters and not images_in_text:
        size = _find(config, "image_size") or SMALL["image_size"]
        size = size if isinstance(size, (list, tuple)) else (size, size)
        inputs["pixel_values"] = torch.randn(BATCH, _find(config, "num_channels") or 3, *size, generator=generator)
    if model.main_input_name == "input_values":  # raw audio, half a second at 16 kHz
        inputs["input_values"] = torch.randn(BATCH, 8000, generator=generator)
    if model.main_input_name == "input_features":  # spectrogram frames (Whisper's encoder wants all of them)
        bins = next(filter(None, map(functools.partial(_find, config), FEATURE_KEYS)), 80)
        frames = 2 * _find(config, "max_source_positions") if _find(config, "max_source_positions") else 64
        inputs["input_features"] = torch.randn(BATCH, bins, frames, generator=generator)
    if model.main_input_name not in inputs:
        raise ValueError(f"no generated inputs for its main input {model.main_input_name!r}")
    if "use_cache" in parameters:
        inputs["use_cache"] = False
    return inputs


def float_outputs(output, prefix="") -> dict[str, torch.Tensor]:
    """Every floating tensor of a model output (nested tuples flattened)."""
    items = output.items() if hasattr(output, "items") else enumerate(output)
    found = {}
    for key, value in items:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found[f"{prefix}{key}"] = value
        elif isinstance(value, (tuple, list)):
            found.update(float_outputs(value, f"{prefix}{key}."))
    return found


def forward(model, implementation, dtype, inputs) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model).to(dtype)
    model.set_attn_implementation(implementation)
    if hasattr(model, "set_experts_implementation"):  # grouped_mm takes no float64
        model.set_experts_implementation("eager")
    inputs = {key: value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value
              for key, value in inputs.items()}
    with torch.no_grad():
        return float_outputs(model(**inputs))


@contextlib.contextmanager
def observed_calls():
    """Counts the integration's calls of fused_attn.attention and attention_varlen."""
    calls = []
    originals = fused_transformers.functional.attention, fused_transformers.varlen.attention_varlen

    def spy(original):
        return lambda *args, **kwargs: calls.append(kwargs) or original(*args, **kwargs)

    fused_transformers.functional.attention, fused_transformers.varlen.attention_varlen = map(spy, originals)
    try:
        yield calls
    finally:
        fused_transformers.functional.attention, fused_transformers.varlen.attention_varlen = originals


def _reason(error: BaseException) -> str:
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else ''}"[:240]


def check_family(family: str) -> Outcome:
    """Builds the family tiny and runs it with eager (float64: the exact result; float32: the allowed
    error) and with fused_attn in float32, by the project's criterion."""
    start = time.perf_counter()
    outcome = _check(family, LAYERS)
    if outcome.status == "not observed":  # the first layers may hold no attention (RecurrentGemma's)
        outcome = _check(family, LAYERS + 1)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _check(family: str, layers: int) -> Outcome:
    try:
        cls = model_class(family)
    except Exception as error:  # noqa: BLE001 - every failure is a finding of the sweep
        return Outcome(family, "not buildable", f"model class: {_reason(error)}")
    if not getattr(cls, "_supports_attention_backend", False):
        return Outcome(family, "excluded", f"{cls.__name__} does not take the attention interface")
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(family, layers)
            torch.manual_seed(0)
            model = cls(config).eval()
            parameters = sum(parameter.numel() for parameter in model.parameters())
            if parameters > MAX_PARAMETERS:  # what the rules do not reach (a codec's channel lists)
                raise ValueError(f"{parameters / 1e6:.0f}M parameters after scaling down")
            inputs = make_inputs(model, config, generator)
            exact = forward(model, "eager", torch.float64, inputs)
            same_dtype = forward(model, "eager", torch.float32, inputs)
        except Exception as error:  # noqa: BLE001
            return Outcome(family, "not buildable", _reason(error))
        if not exact or not all(torch.isfinite(value).all() for value in exact.values()):
            return Outcome(family, "not buildable", "eager in float64 gives no finite output")
        fused = copy.deepcopy(model).float()
        try:
            fused.set_attn_implementation(NAME)
        except Exception as error:  # noqa: BLE001
            return Outcome(family, "refused", f"at set_attn_implementation: {_reason(error)}")
        if fused.config._attn_implementation != NAME:
            return Outcome(family, "refused", f"at set_attn_implementation: transformers kept "
                           f"{fused.config._attn_implementation!r} ({cls.__name__} cannot set it dynamically)")
        with observed_calls() as calls:
            try:
                actual = forward(fused, NAME, torch.float32, inputs)
            except NotImplementedError as error:
                return Outcome(family, "refused", f"at the first forward: {_reason(error)}")
            except Exception as error:  # noqa: BLE001
                return Outcome(family, "mismatched", f"fused forward raised {_reason(error)}")
    if not calls:
        return Outcome(family, "not observed", "the forward never called fused_attn")
    failures = []
    for key, value in exact.items():
        error = testing.max_error(actual[key], value)
        allowed = testing.allowed_error(key, value, same_dtype[key], torch.float32)
        if not error <= allowed:
            failures.append(f"{key}: error {error:.2e} > allowed {allowed:.2e}")
    if failures:
        return Outcome(family, "mismatched", "; ".join(failures))
    return Outcome(family, "matched", f"{len(calls)} fused calls")


# --- the sweep and its summary ---------------------------------------------------------------------

STATUSES = ("matched", "mismatched", "not observed", "refused", "not buildable")


def sweep(names: list[str] | None = None, report=None) -> list[Outcome]:
    """`check_family` on the families named (all by default), each outcome passed to `report`."""
    transformers.logging.set_verbosity_error()
    outcomes = []
    for family in names or families():
        outcomes.append(check_family(family))
        if report is not None:
            report(outcomes[-1])
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    """The Markdown summary: counts, then every family by outcome with its reason."""
    swept = [outcome for outcome in outcomes if outcome.status != "excluded"]
    by_status = {status: [o for o in swept if o.status == status] for status in STATUSES}
    ran = sum(len(by_status[status]) for status in ("matched", "mismatched", "not observed"))
    minutes = sum(outcome.seconds for outcome in outcomes) / 60
    lines = [f"# fused_attn on transformers {transformers.__version__}: every family that takes the attention "
             "interface", "",
             "Written by the slow sweep (`pytest -m slow tests/test_transformers_sweep.py`, or "
             "`python tests/model_builder.py`): tiny random models from each family's default config, "
             "float32 outputs against eager in float64 by the project's criterion, fused_attn observed "
             f"running. {len(outcomes) - len(swept)} other families of the auto mapping do not take the "
             f"interface. {minutes:.0f} minutes on this machine.", "",
             f"**families: {len(swept)}; run: {ran}; matched: {len(by_status['matched'])}; mismatched: "
             f"{len(by_status['mismatched'])}; ran without calling fused_attn: {len(by_status['not observed'])}; "
             f"refused: {len(by_status['refused'])}; not buildable: {len(by_status['not buildable'])}**", ""]
    for status, listed in by_status.items():
        lines += [f"## {status} ({len(listed)})", ""]
        if status == "matched":
            lines += [", ".join(f"`{outcome.family}`" for outcome in listed), ""]
        elif listed:
            lines += [f"- `{outcome.family}`: {outcome.detail}" for outcome in listed] + [""]
    return "\n".join(lines)


def print_outcome(outcome: Outcome) -> None:
    print(f"{outcome.family:40s} {outcome.status:14s} {outcome.seconds:6.1f}s {outcome.detail}", flush=True)


if __name__ == "__main__":
    results = sweep(sys.argv[1:], print_outcome)
    if not sys.argv[1:]:
        SUMMARY.write_text(summary(results))
        print(f"wrote {SUMMARY}")
