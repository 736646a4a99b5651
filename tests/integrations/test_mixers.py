"""Token mixers seqpar cannot make exact are refused, never run on shards: every causal-LM class the
installed transformers ships is classified (built from its default config on the meta device, so
only its structure is read), the hybrid families by name."""

import warnings

import pytest
import torch

from seqpar.integrations.mixers import check_token_mixers, unsupported_mixers


def _build(model_type, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **overrides)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config)


def _causal_lm_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# family -> (config overrides that give it its non-attention layers, the module class the refusal names)
HYBRIDS = {
    "qwen3_next": ({}, "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": ({}, "Qwen3_5GatedDeltaNet"),
    "jamba": ({}, "JambaMambaMixer"),
    "bamba": ({}, "BambaMixer"),
    "falcon_h1": ({}, "FalconH1Mixer"),
    "nemotron_h": ({}, "NemotronHMamba2Mixer"),
    "zamba2": ({}, "Zamba2MambaMixer"),
    "granitemoehybrid": ({}, "GraniteMoeHybridMambaLayer"),
    "kimi_linear": ({}, "KimiLinearDeltaAttention"),
    "recurrent_gemma": ({}, "RecurrentGemmaRecurrentBlock"),
    "lfm2": ({"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "Lfm2ShortConv"),
    "minimax": ({}, "'linear_attention'"),
    "llama4_text": ({}, "attn_temperature_tuning"),  # its chunked layers are fine, its NoPE scaling is not
    "bart": ({}, "BartForCausalLM.forward takes no position_ids"),
    "whisper": ({}, "takes no position_ids"),
    "roberta": ({}, "padding_idx"),
}
ATTENTION_ONLY = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3",
                  "deepseek_v3", "gpt2", "gpt_neox", "olmo2", "cohere2", "glm4", "gpt_oss", "starcoder2"]


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_families_are_refused_naming_the_module(family):
    overrides, named = HYBRIDS[family]
    model = _build(family, **overrides)
    with pytest.raises(ValueError, match="cannot parallelize") as info:
        check_token_mixers(model)
    assert named in str(info.value), str(info.value)
    assert "silently wrong" in str(info.value)


def test_chunked_attention_alone_is_accepted():
    """Llama 4 without NoPE temperature tuning: chunked layers are a mask feature seqpar honours."""
    assert unsupported_mixers(_build("llama4_text", attn_temperature_tuning=False)) == []
    with pytest.raises(ValueError, match="which layers are chunked"):  # a chunk size without layer types
        check_token_mixers(_build("llama", attention_chunk_size=8))


@pytest.mark.parametrize("family", ATTENTION_ONLY)
def test_attention_only_families_pass(family):
    assert unsupported_mixers(_build(family)) == []


def test_every_causal_lm_class_is_classified():
    """Each class either passes (all its token mixers are attention), is refused with reasons, or
    is refused by decoder_config (no single head count): a ValueError, never another exception."""
    outcome = {}
    for model_type in _causal_lm_types():
        try:
            model = _build(model_type)
        except Exception:  # a default config transformers itself cannot build
            outcome[model_type] = "unbuildable default config"
            continue
        try:
            outcome[model_type] = "refused" if unsupported_mixers(model) else "attention only"
        except ValueError:
            outcome[model_type] = "refused (decoder config)"
    assert len(outcome) == len(_causal_lm_types()) > 150
    for family in HYBRIDS:
        if outcome.get(family) != "unbuildable default config" and family != "lfm2":  # lfm2's default is all attention
            assert outcome[family].startswith("refused"), (family, outcome[family])
    for family in ATTENTION_ONLY:
        assert outcome[family] == "attention only", (family, outcome[family])
    for family in ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"):  # no attention at all
        assert outcome[family].startswith("refused"), (family, outcome[family])
