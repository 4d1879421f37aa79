"""fused_attn's transformers integration on every family of the installed transformers that takes the
attention interface, each built tiny from its default config by one generic builder
(tests/model_builder.py): its float32 outputs must match eager in float64 by the project's criterion
with fused_attn observed running, or the family be refused with a reason.

A handful of diverse families runs with `make test`. The whole sweep (about 400 families, a quarter
of an hour on two cores) runs only when asked for, `pytest -m slow tests/test_transformers_sweep.py`,
and writes the summary the README quotes (tests/transformers_sweep.md). A family the builder cannot
instantiate or feed is listed there with the reason: a limit of the builder, not a failure."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import model_builder  # noqa: E402

# Failures whose fault is not (yet) fixed here, each with its reason. They raise at the first forward
# (transformers 5.24 has no hook that would let the integration refuse a model at
# set_attn_implementation); none gives a wrong answer.
KNOWN = {
    # Its modules concatenate compressed KV slots and a bias for them onto the mask they are given,
    # assuming eager's 4-D additive mask (it supports neither sdpa's nor flash's): with the key padding
    # build_mask returns, that torch.cat raises (and where the module pads instead, the attention
    # function refuses a mask built for fewer keys than it is given).
    "deepseek_v4": "Tensors must have same number of dimensions",
}

# Causal with GQA, sliding windows and softcap (Gemma2), MoE, an encoder, ModernBERT's bidirectional
# window, PaliGemma (modules that call themselves bidirectional under a causal mask), an
# encoder-decoder with a bidirectional window of another width (T5Gemma), a vision encoder, sinks
# (gpt-oss, and Hunyuan-V4's with its own attention layout).
FAST = ["llama", "gemma2", "qwen2_moe", "bert", "modernbert", "paligemma", "t5gemma", "vit", "gpt_oss", "hy_v4"]


def problem(outcome: model_builder.Outcome) -> str | None:
    """What is wrong with an outcome for the integration, or None."""
    if outcome.family in KNOWN and outcome.status == "mismatched" and KNOWN[outcome.family] in outcome.detail:
        return None
    if outcome.status == "refused":  # by transformers, at set_attn_implementation: the right place
        return None if outcome.detail.startswith("at set_attn_implementation") else str(outcome)
    return None if outcome.status in ("matched", "not buildable", "excluded") else str(outcome)


@pytest.mark.parametrize("family", FAST)
def test_fast_subset(family):
    outcome = model_builder.check_family(family)
    assert outcome.status == "matched", outcome


@pytest.mark.slow
def test_every_family(request):
    if "slow" not in (request.config.option.markexpr or ""):  # `make test` selects no marker
        pytest.skip("the whole sweep runs when asked for: pytest -m slow tests/test_transformers_sweep.py")
    outcomes = model_builder.sweep()
    model_builder.SUMMARY.write_text(model_builder.summary(outcomes))
    problems = [text for text in map(problem, outcomes) if text]
    assert not problems, "\n".join(problems)
