"""The pieces of the registered attention function (:mod:`seqpar.integrations.hf.attention`), one job
each, called directly: no processes, no model. The function as a whole runs in test_hf*.py, the zoo
and test_compile."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from seqpar.attention.shard import SeqShard
from seqpar.batch.local_batch import BATCH_KWARG, LocalBatch
from seqpar.errors import Refused
from seqpar.integrations.hf.attention import (
    LastBatch,
    batch_of,
    keys_not_sharded,
    layer_call,
    local_kernel,
    refuse_model_mask,
)
from seqpar.integrations.hf.kernel import ModelKernel


def _batch(segments: torch.Tensor | None = None) -> LocalBatch:
    shard = SeqShard((4, 3), None, None, segments)
    return LocalBatch(shard, sp_rank=0, sp_size=2, dp_size=1, denominator=1.0, num_items_in_batch=None,
                      loss_weights=None)


class _Layer(nn.Module):
    def __init__(self, is_causal: bool = True, layer_idx: int = 0) -> None:
        super().__init__()
        self.is_causal, self.layer_idx = is_causal, layer_idx


def test_batch_of_prefers_the_keyword_then_the_pre_hooks_batch():
    mine, caught = _batch(), _batch()
    last = LastBatch()
    last.batch = caught
    assert batch_of({BATCH_KWARG: mine}, last) is mine
    assert batch_of({}, last) is caught
    with pytest.raises(ValueError, match="seqpar.shard_batch"):
        batch_of({}, LastBatch())
    with pytest.raises(ValueError, match="unparallelize"):
        batch_of({BATCH_KWARG: "not a batch"}, LastBatch())


def test_a_models_own_mask_is_refused_none_passes():
    refuse_model_mask(_Layer(), None)
    with pytest.raises(Refused, match="_Layer passes its own attention mask"):
        refuse_model_mask(_Layer(), torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_keys_not_sharded_refuses_an_implementation_it_cannot_find():
    q = torch.zeros(1, 2, 3, 4)
    kv = torch.zeros(1, 2, 5, 4)
    with pytest.raises(Refused, match="'no_such_attention' attention whose keys are not the sharded"):
        keys_not_sharded("no_such_attention", _Layer(), q, kv, kv, None, None, 0.0, {})


def test_keys_not_sharded_runs_the_models_sdpa_locally():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    out, _ = keys_not_sharded("sdpa", _Layer(is_causal=False), q, k, v, None, 0.5, 0.0, {})
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v  # [B, H, S_q, D]
    assert out.shape == (1, 3, 2, 4)  # [B, S_q, H, D]: what transformers expects back
    assert float((out - want.transpose(1, 2)).abs().max()) < 1e-14


def test_layer_call_reads_causal_window_chunk_softcap_and_sinks():
    sinks = torch.zeros(2)
    config = SimpleNamespace(layer_types=["sliding_attention", "chunked_attention"], sliding_window=5,
                             attention_chunk_size=3)
    shard = _batch().shard
    call = layer_call(_Layer(is_causal=False), config, {"softcap": 2.0, "s_aux": sinks}, shard, causal_mask=False)
    assert (call.causal, call.window, call.chunk, call.softcap, call.sinks, call.shard) == (False, 5, None, 2.0,
                                                                                             sinks, shard)
    assert layer_call(_Layer(is_causal=False), config, {}, shard, causal_mask=True).causal  # the model's mask
    assert not layer_call(_Layer(), config, {"is_causal": False}, shard, causal_mask=False).causal  # the call's
    chunked = layer_call(_Layer(layer_idx=1), config, {}, shard, causal_mask=False)
    assert (chunked.window, chunked.chunk, chunked.shard) == (None, 3, shard)


def test_layer_call_turns_a_packed_rows_chunks_into_documents():
    config = SimpleNamespace(layer_types=["chunked_attention"], attention_chunk_size=2)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])  # two documents, original order = layout order
    call = layer_call(_Layer(), config, {}, _batch(segments).shard, causal_mask=False)
    assert call.chunk is None  # the layer runs unchunked on finer segments: chunks counted per document
    ids = call.shard.segments[0].tolist()
    assert [a == b for a, b in zip(ids[:-1], ids[1:], strict=True)] == [True, False, False, True, False, True]


def test_local_kernel_rule():
    layer = _Layer()
    assert local_kernel("tiled", "ulysses", "sdpa", layer) == "tiled"  # asked for: always that one
    assert local_kernel(None, "ring", "sdpa", layer) is None  # ring / hybrid choose an lse kernel
    assert local_kernel(None, "hybrid", "eager", layer) is None
    assert isinstance(local_kernel(None, "ulysses", "sdpa", layer), ModelKernel)  # the model's own
    assert local_kernel(None, "ulysses", "flex_attention", layer) == "auto"  # cannot be wrapped
