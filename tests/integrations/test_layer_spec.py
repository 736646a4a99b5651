"""Which window, chunk and sinks a transformers attention layer computes, read from the call, the
config and the modeling file (seqpar.integrations.hf.layer_spec): the facts transformers puts in its
masks, which seqpar suppresses and must therefore read itself."""

import torch

from seqpar.integrations.hf.layer_spec import builds_sliding_masks, layer_options, layer_type


def _attention(model_type, cls_path, **config):
    import importlib

    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, **config)
    module_name, cls_name = cls_path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), cls_name)(cfg, layer_idx=1), cfg


def test_window_from_the_call_wins():
    module, cfg = _attention("mistral", "transformers.models.mistral.modeling_mistral.MistralAttention",
                             sliding_window=7)
    assert layer_options(module, cfg, {"sliding_window": 3}).window == 3
    assert layer_options(module, cfg, {}).window == 7  # the file builds sliding masks from config.sliding_window


def test_window_from_layer_types_when_not_passed():
    """Qwen2-MoE with use_sliding_window: the window lives in the mask, not in the call."""
    module, cfg = _attention("qwen2_moe", "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeAttention",
                             use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=3)
    assert layer_type(module, cfg) == cfg.layer_types[1]
    expected = 5 if cfg.layer_types[1] == "sliding_attention" else None
    assert layer_options(module, cfg, {}).window == expected
    cfg.layer_types = ["full_attention"] * 3
    assert layer_options(module, cfg, {}).window is None  # layer types decide, config.sliding_window alone does not


def test_no_window_when_the_modeling_file_never_builds_one():
    module, cfg = _attention("llama", "transformers.models.llama.modeling_llama.LlamaAttention")
    cfg.sliding_window = 4  # a config field the model never reads
    assert not builds_sliding_masks(module)
    assert layer_options(module, cfg, {}).window is None


def test_chunk_and_sinks():
    module, cfg = _attention("mistral", "transformers.models.mistral.modeling_mistral.MistralAttention")
    cfg.layer_types, cfg.attention_chunk_size = ["full_attention", "chunked_attention"], 6
    opts = layer_options(module, cfg, {})
    assert opts.chunk == 6 and opts.sinks is None
    sinks = torch.zeros(4)
    assert layer_options(module, cfg, {"s_aux": sinks}).sinks is sinks
    module.sinks = torch.nn.Parameter(torch.ones(4))
    assert layer_options(module, cfg, {}).sinks is module.sinks
