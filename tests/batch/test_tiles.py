"""The tile sizes of the tiled MLP and of the vocabulary tiles (:mod:`seqpar.batch.tiles`): pure
rules, and reduce_memory's tiled MLP following the shard when no tile is given."""

from __future__ import annotations

import copy

import torch

import seqpar
from seqpar.batch.tiles import MAX_MLP_TILE, MIN_TILE, mlp_tile_for
from seqpar.integrations.models import build_model
from seqpar.integrations.state import state_of


def test_the_mlp_tile_keeps_its_intermediate_within_the_shards_hidden_states():
    assert mlp_tile_for(4096, 256, 896) == 1170  # 1170 * 896 <= 4096 * 256 < 1171 * 896
    assert mlp_tile_for(100, 256, 896) == MIN_TILE  # a thin shard: the floor
    assert mlp_tile_for(10**6, 4096, 14336) == MAX_MLP_TILE  # a wide shard: the cap
    for tokens, hidden, inter in ((5000, 512, 1792), (12345, 1024, 3584), (3, 8, 11), (16384, 256, 896)):
        t = mlp_tile_for(tokens, hidden, inter)
        assert MIN_TILE <= t <= MAX_MLP_TILE
        assert t in (MIN_TILE, MAX_MLP_TILE) or t * inter <= tokens * hidden < (t + 1) * inter
    assert mlp_tile_for(16384 // 4, 256, 896) < mlp_tile_for(16384, 256, 896)  # sp=4's shard: a smaller tile


def test_reduce_memory_without_a_tile_follows_each_calls_shard_exactly():
    """mlp_tile=None: each call's tile is mlp_tile_for its tokens (tiny-llama: hidden 32, MLP 64, so
    half the tokens, at least 64); loss and gradients equal the untiled model's (float64)."""
    model, _ = build_model("tiny-llama", dtype=torch.float64)
    tiled = seqpar.reduce_memory(copy.deepcopy(model), tiled_loss=False, checkpoint="none")
    assert state_of(tiled).memory.mlp_tile is None
    assert seqpar.memory_switches(tiled)["mlp_tile"].startswith("follows the shard")
    for seq in (300, 90):
        ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
        losses, grads = [], []
        for m in (model, tiled):
            m.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
        tile = mlp_tile_for(seq, 32, 64)
        assert state_of(tiled).memory.context.tiles_run[-1] == -(-seq // tile)  # 2 tiles of 150; 2 of 64 + 26
        assert abs(losses[0] - losses[1]) < 1e-12
        assert float((grads[0] - grads[1]).abs().max()) < 1e-12


def test_an_explicit_mlp_tile_still_holds():
    model, _ = build_model("tiny-llama", dtype=torch.float64)
    seqpar.reduce_memory(model, tiled_loss=False, checkpoint="none", mlp_tile=7)
    ids = torch.randint(0, model.config.vocab_size, (1, 50))
    model(input_ids=ids)
    assert state_of(model).memory.context.tiles_run[-1] == 8  # ceil(50 / 7)
