"""benchmarks/bench_rank.py at tiny shapes on the CPU (issue 27): its FLOP count against the model it
times (the matmul weights counted from the built model, not restated) and one run of every strategy
through the one-rank-of-P path (torch's fake process group in this process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rank.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_rank", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_rank"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_rank"]


def test_flops_count_the_built_models_matmuls(bench):
    from seqpar.integrations.models import build_model

    s, seq, p = bench.TINY, 64, 4
    model, _ = build_model("tiny-llama", vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.inter,
                           num_hidden_layers=3, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                           head_dim=s.head_dim)
    layer = model.model.layers[0]
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert bench.layer_params(s) == weights
    tokens = seq / p
    # causal: every query sees (i + 1) keys, 2 matmuls x 2 FLOPs x D per pair and head, backward 2.5x
    pairs = seq * (seq + 1) / 2
    attention = 3.5 * 4 * pairs * s.heads * s.head_dim / p
    assert bench.flops("attention", s, seq, p) == pytest.approx(attention, rel=2 / seq)
    head = model.lm_head.weight.numel()
    step = bench.flops("step", s, seq, p, layers=3)
    assert step == pytest.approx(3 * (6 * weights * tokens + attention) + 6 * head * tokens, rel=2 / seq)


@pytest.mark.parametrize("strategy", ["ulysses", "ring", "hybrid"])
def test_every_strategy_runs_as_one_rank_of_four(bench, strategy):
    for what in ("attention", "layer", "step"):
        m = bench.run_rank(what, bench.TINY, 64, 4, strategy, torch.float32, torch.device("cpu"), rank=1,
                           layers=1, repeats=1)
        # a layer is the difference of two timed models: at tiny shapes it is noise, of either sign
        assert (m["seconds"] > 0 or what == "layer") and m["flops"] == bench.flops(what, bench.TINY, 64, 4, 1)
    assert bench.bytes_per_layer(bench.TINY, 64, 4, strategy, 4) > 0
    assert torch.distributed.is_initialized() is False
