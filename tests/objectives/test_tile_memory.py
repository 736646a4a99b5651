"""Log-probs and entropy never hold more than one vocabulary tile of ``[S, V]`` (issue 36): the
tensors :func:`seqpar.objectives.token_logps_entropy` creates in its forward and backward, counted by
:class:`seqpar.testing.memory.LiveMemory` -- no tensor larger than one ``[T, V]`` tile, one tile
buffer alive at a time (the backward's block of ``T / ROW_BLOCKS`` rows of ``p`` besides it), and a
peak that does not grow with the sequence beyond its ``[S]`` and ``[S, H]`` tensors."""

from __future__ import annotations

import pytest
import torch

from seqpar.batch.tiled_loss import Head
from seqpar.objectives import token_logps_entropy
from seqpar.objectives.tokens import ROW_BLOCKS
from seqpar.testing.memory import LiveMemory

V, H, T = 4096, 8, 64  # a vocabulary tile [T, V] float32 is 1 MiB; a token's [H] row 32 bytes
TILE_BYTES = T * V * 4


def _inputs(rows: int, seq: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seq)
    hidden = torch.randn(rows, seq, H, generator=g, dtype=dtype).requires_grad_()
    head = Head(torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(),
                torch.randn(V, generator=g, dtype=dtype).requires_grad_())
    targets = torch.randint(0, V, (rows, seq), generator=g)
    targets[:, :5] = -100  # a prompt: ignored targets
    a, b = torch.rand(rows, seq, generator=g, dtype=dtype), torch.rand(rows, seq, generator=g, dtype=dtype)
    return hidden, head, targets, a, b


def _non_tile_bytes(n: int) -> int:
    """What the function holds besides its tiles: the weight's and bias's gradients (``[V, H]`` and
    ``[V]``, once as the result and once as autograd's), ``grad_h`` and the hidden states' gradient
    ``[N, H]``, the ``[N]`` outputs, their gradients and the tiles' ``[T]`` rows (float32)."""
    return 4 * (2 * V * H + 2 * V + 2 * n * H + 8 * n + 16 * T)


def _step_memory(rows: int, seq: int, *, temperature: float, grad: bool, tile: int = T,
                 softcap: float | None = None) -> LiveMemory:
    hidden, head, targets, a, b = _inputs(rows, seq)
    head = Head(head.weight, head.bias, softcap=softcap)
    with LiveMemory() as mem, torch.set_grad_enabled(grad):
        logp, ent = token_logps_entropy(hidden, head, targets, temperature=temperature, tile=tile)
        if grad:
            ((logp * a).sum() + (ent * b).sum()).backward()
        del logp, ent
    return mem


@pytest.mark.parametrize("grad", [True, False], ids=["forward+backward", "no_grad (a reference)"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logps_and_entropy_hold_one_vocabulary_tile(grad, temperature):
    rows, seq = 2, 8 * T + 3  # 17 tiles, the last one 6 tokens short: [S, V] would be 17x one tile
    n = rows * seq
    mem = _step_memory(rows, seq, temperature=temperature, grad=grad)
    assert mem.largest_bytes <= TILE_BYTES  # no tensor spans more than one tile's tokens
    assert mem.peak_bytes <= TILE_BYTES + _non_tile_bytes(n)  # one tile's buffer, and no more
    assert n * V * 4 > 6 * mem.peak_bytes  # what the full logits alone would hold, for scale
    # the peak grows with the sequence only by its [S] and [S, H] tensors, never by tiles
    short = _step_memory(rows, T // 2, temperature=temperature, grad=grad)
    assert short.largest_bytes <= TILE_BYTES
    assert mem.peak_bytes - short.peak_bytes <= _non_tile_bytes(n) - _non_tile_bytes(rows * (T // 2))


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain head", "softcapped head"])
@pytest.mark.parametrize("grad", [True, False], ids=["forward+backward", "no_grad"])
def test_a_tile_holds_one_vocabulary_buffer_measured(grad, softcap):
    """Measured, not assumed: doubling the tile grows the peak by what one tile holds at once -- one
    ``[T, V]`` buffer and ``[T]`` vectors in the forward; in the backward also the block of
    ``T / ROW_BLOCKS`` rows of ``p`` (and, with a softcap, of its slope) beside the buffer."""
    rows, seq = 2, 8 * T + 3
    one = _step_memory(rows, seq, temperature=0.7, grad=grad, softcap=softcap).peak_bytes
    two = _step_memory(rows, seq, temperature=0.7, grad=grad, softcap=softcap, tile=2 * T).peak_bytes
    blocks = (1 + (softcap is not None)) / ROW_BLOCKS if grad else 0.0  # [T / ROW_BLOCKS, V] blocks
    vectors = 16 * T * 4  # up to 16 [T] float32 vectors per tile (max, Z, sums, the gradients' rows)
    assert TILE_BYTES * (1 + blocks) <= two - one <= TILE_BYTES * (1 + blocks) + vectors


def test_the_gradients_through_the_in_place_tiles_equal_full_log_softmax():
    """The in-place tile gradient, with only one of the two outputs used (the other's gradient is
    None) and with both, against autograd through the full ``log_softmax`` (float64)."""
    for use in ("logp", "entropy", "both"):
        hidden, head, targets, a, b = _inputs(2, 2 * T + 7, torch.float64)
        logp, ent = token_logps_entropy(hidden, head, targets, temperature=0.7, tile=T)
        loss = {"logp": (logp * a).sum(), "entropy": (ent * b).sum(), "both": (logp * a).sum() + (ent * b).sum()}[use]
        loss.backward()
        got = [t.grad.clone() for t in (hidden, head.weight, head.bias)]
        for t in (hidden, head.weight, head.bias):
            t.grad = None
        full = torch.log_softmax(torch.nn.functional.linear(hidden, head.weight, head.bias) / 0.7, -1)  # [B, S, V]
        ref_logp = full.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
        ref_ent = -(full.exp() * full).sum(-1)
        ref = {"logp": (ref_logp * a).sum(), "entropy": (ref_ent * b).sum(),
               "both": (ref_logp * a).sum() + (ref_ent * b).sum()}[use]
        ref.backward()
        assert float((logp - ref_logp).detach().abs().max()) < 1e-12
        assert float((ent - ref_ent).detach().abs().max()) < 1e-12
        for mine, t in zip(got, (hidden, head.weight, head.bias), strict=True):
            assert float((mine - t.grad).abs().max()) < 1e-11, use


def test_the_default_tile_holds_no_more_than_the_hidden_states_within_its_bounds():
    from seqpar.batch.tiles import MIN_TILE, vocab_tile

    assert vocab_tile(32768, 256, 32000) == 131  # 2 * 131 * 32000 <= 32768 * 256 < 2 * 132 * 32000
    assert vocab_tile(8192, 256, 32000) == MIN_TILE  # a thin shard: the floor, not a 32-token matmul
    assert vocab_tile(10**6, 4096, 32000, cap=512) == 512  # a wide shard: the model's loss_tile caps it
    for tokens, hidden, vocab in ((5000, 512, 32000), (12345, 1024, 151936), (3, 8, 11)):
        t = vocab_tile(tokens, hidden, vocab)
        assert MIN_TILE <= t <= 1024
        assert t in (MIN_TILE, 1024) or 2 * t * vocab <= tokens * hidden < 2 * (t + 1) * vocab


def test_the_default_tile_is_capped_by_the_models_loss_tile():
    import seqpar
    from seqpar.batch.tiles import DEFAULT_LOSS_TILE
    from seqpar.integrations.models import build_model
    from seqpar.objectives.tokens import model_tile

    model, _ = build_model("tiny-llama")
    assert model_tile(model) == DEFAULT_LOSS_TILE  # no switches
    seqpar.reduce_memory(model, loss_tile=96)
    assert model_tile(model) == 96
    seqpar.restore_memory(model)
    assert model_tile(model) == DEFAULT_LOSS_TILE
