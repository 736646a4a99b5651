"""Token mixers seqpar cannot make exact are refused, never run on shards: every causal-LM class the
installed transformers ships is classified (built from its default config on the meta device, so
only its structure is read), the hybrid families by name; the state-space, linear-attention and
short-convolution mixers seqpar handles (issue 13) pass; an unknown recurrent or convolution
module in a custom model is refused by name."""

import warnings

import pytest
import torch
from torch import nn

from seqpar.errors import Refused
from seqpar.integrations.mixers import (
    GATHER,
    HANDLED_MIXERS,
    HEADS,
    STATE,
    check_token_mixers,
    family_of,
    mode_named,
    token_mixers,
    unsupported_mixers,
)
from seqpar.integrations.mixers.views import view_module


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
    "recurrent_gemma": ({}, "RecurrentGemmaRecurrentBlock"),  # RG-LRU: not a mixer seqpar handles
    "minimax": ({}, "'linear_attention'"),  # lightning attention: not handled
    "llama4_text": ({}, "attn_temperature_tuning"),  # its chunked layers are fine, its NoPE scaling is not
    "bart": ({}, "BartForCausalLM.forward takes no position_ids"),
    "whisper": ({}, "takes no position_ids"),
    "roberta": ({}, "padding_idx"),
}
# family -> (overrides, the token-mixer class seqpar makes exact in it): these pass
HANDLED = {
    "qwen3_next": ({}, "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": ({}, "Qwen3_5GatedDeltaNet"),
    "olmo_hybrid": ({}, "OlmoHybridGatedDeltaNet"),
    "kimi_linear": ({}, "KimiLinearDeltaAttention"),
    "jamba": ({}, "JambaMambaMixer"),
    "bamba": ({}, "BambaMixer"),
    "falcon_h1": ({}, "FalconH1Mixer"),
    "nemotron_h": ({}, "NemotronHMamba2Mixer"),
    "zamba2": ({}, "Zamba2MambaMixer"),
    "granitemoehybrid": ({}, "GraniteMoeHybridMambaLayer"),
    "lfm2": ({"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "Lfm2ShortConv"),
}
ATTENTION_ONLY = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3",
                  "deepseek_v3", "gpt2", "gpt_neox", "olmo2", "cohere2", "glm4", "gpt_oss", "starcoder2"]


@pytest.mark.parametrize("family", list(HANDLED))
def test_handled_hybrid_families_pass(family):
    overrides, mixer = HANDLED[family]
    model = _build(family, **overrides)
    assert unsupported_mixers(model) == []
    found = {type(m).__name__ for _, m in token_mixers(model)}
    assert found == {mixer} and mixer in HANDLED_MIXERS, found


class _Tiny(nn.Module):
    """A decoder layer's extra token mixer seqpar has never seen."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.time_mix = mixer

    def forward(self, x):
        return x


@pytest.mark.parametrize("mixer, named", [(nn.GRU(32, 32, batch_first=True), "nn.GRU"),
                                          (nn.Conv1d(32, 32, 3, groups=32), "nn.Conv1d")])
def test_unknown_mixer_in_a_custom_model_is_refused(mixer, named):
    """A Llama with an unknown recurrence / convolution over time in a decoder layer: refused by
    name, even next to mixers seqpar handles (a Bamba), never run on a shard."""
    for family, overrides in (("llama", {}), ("bamba", {})):
        model = _build(family, **overrides)
        model.model.layers[0].extra = _Tiny(mixer)
        with pytest.raises(Refused, match="cannot parallelize") as info:
            check_token_mixers(model)
        assert f"layers.0.extra.time_mix: {named}" in str(info.value), str(info.value)
        assert "not a token mixer seqpar handles" in str(info.value)


def test_a_layer_type_without_a_handled_mixer_is_refused():
    """A Qwen3-Next whose linear-attention layer lost its Gated DeltaNet (swapped for an unknown
    module): the layer type is no longer backed by a mixer seqpar handles."""
    model = _build("qwen3_next")
    layer = next(m for m in model.model.layers if hasattr(m, "linear_attn"))
    assert family_of(layer.linear_attn).modes[:2] == (STATE, HEADS)
    layer.linear_attn = _Tiny(nn.Linear(32, 32))
    with pytest.raises(Refused, match="'linear_attention'") as info:
        check_token_mixers(model)
    assert "has no token mixer seqpar handles" in str(info.value)


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_families_are_refused_naming_the_module(family):
    overrides, named = HYBRIDS[family]
    model = _build(family, **overrides)
    with pytest.raises(Refused, match="cannot parallelize") as info:
        check_token_mixers(model)
    assert named in str(info.value), str(info.value)
    assert "silently wrong" in str(info.value)


def test_chunked_attention_alone_is_accepted():
    """Llama 4 without NoPE temperature tuning: chunked layers are a mask feature seqpar honours."""
    assert unsupported_mixers(_build("llama4_text", attn_temperature_tuning=False)) == []
    with pytest.raises(Refused, match="which layers are chunked"):  # a chunk size without layer types
        check_token_mixers(_build("llama", attention_chunk_size=8))


@pytest.mark.parametrize("family", ATTENTION_ONLY)
def test_attention_only_families_pass(family):
    assert unsupported_mixers(_build(family)) == []


@pytest.mark.heavy  # builds every class (tens of seconds); make test's zoo runs every class end to end
def test_every_causal_lm_class_is_classified():
    """Each class either passes (all its token mixers are attention), is refused with reasons, or
    is refused by decoder_config (no single head count): Refused, never another exception."""
    outcome = {}
    for model_type in _causal_lm_types():
        try:
            model = _build(model_type)
        except Exception:  # a default config transformers itself cannot build
            outcome[model_type] = "unbuildable default config"
            continue
        try:
            outcome[model_type] = "refused" if unsupported_mixers(model) else "attention only"
        except Refused:
            outcome[model_type] = "refused (decoder config)"
    assert len(outcome) == len(_causal_lm_types()) > 150
    for family in HYBRIDS:
        if outcome.get(family) != "unbuildable default config":
            assert outcome[family].startswith("refused"), (family, outcome[family])
    for family in [*ATTENTION_ONLY, *HANDLED]:  # handled token mixers count as mixers seqpar shards
        assert outcome[family] in ("attention only", "unbuildable default config"), (family, outcome[family])
    for family in ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"):  # no attention at all
        assert outcome[family].startswith("refused"), (family, outcome[family])


def test_every_handled_class_has_one_family_whose_modes_end_gathered():
    """Each family declares its classes and run modes; every mode is registered, and the last one
    is the gather that always fits."""
    families = {id(f): f for f in HANDLED_MIXERS.values()}.values()
    assert sum(len(f.classes) for f in families) == len(HANDLED_MIXERS) >= 19
    for family in families:
        assert family.modes[-1] == GATHER, family
        assert all(mode_named(m).name == m for m in family.modes), family
        assert all(HANDLED_MIXERS[c] is family for c in family.classes), family


def test_view_module_reads_the_real_module_and_never_writes_it():
    """A view of an nn.Linear / nn.Conv1d: the sliced weights give the sliced layer's output, the
    gradient reaches the real weight, the real module keeps its parameters, attributes and hooks
    (which do not run on the view), and the view has no instance forward."""
    torch.manual_seed(0)
    lin, conv = nn.Linear(6, 4, bias=False).double(), nn.Conv1d(5, 5, 3, groups=5, bias=True).double()
    calls = []
    lin.register_forward_hook(lambda *_: calls.append("hook"))
    lin.forward = lin.forward  # an instance forward, as seqpar's wrapper sets: not copied
    before = {n: p for n, p in [*lin.named_parameters(), *conv.named_parameters()]}
    part = view_module(lin, {"weight": lin.weight[1:3]})
    cpart = view_module(conv, {"weight": conv.weight[2:4], "bias": conv.bias[2:4]}, in_channels=2, out_channels=2,
                        groups=2)
    x, y = torch.randn(3, 6, dtype=torch.float64), torch.randn(1, 2, 7, dtype=torch.float64)
    assert type(part) is nn.Linear and "forward" not in vars(part) and part.bias is None
    torch.testing.assert_close(part(x), x @ lin.weight[1:3].T, rtol=0, atol=0)
    torch.testing.assert_close(cpart(y), nn.functional.conv1d(y, conv.weight[2:4], conv.bias[2:4], groups=2),
                               rtol=0, atol=0)
    (part(x).sum() + cpart(y).sum()).backward()
    assert calls == [] and lin.weight.grad[[0, 3]].abs().max() == 0 and lin.weight.grad[1:3].abs().min() > 0
    assert conv.bias.grad[[0, 1, 4]].abs().max() == 0 and conv.bias.grad[2:4].abs().min() > 0
    assert {n: p for n, p in [*lin.named_parameters(), *conv.named_parameters()]} == before
    assert (conv.in_channels, conv.groups, lin.weight.shape) == (5, 5, (4, 6))
    assert list(part.parameters()) == [] and dict(part.named_children()) == {}
