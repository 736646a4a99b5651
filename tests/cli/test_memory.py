"""Memory per rank is linear in the sequence, packed or not (issue 10), measured with the
deterministic live-tensor probe (:class:`seqpar.testing.memory.LiveMemory`), not with RSS.

First the probe itself on computations whose byte counts are known exactly; then one process start
at P=2 (a 1-layer tiny Llama, hidden 64, one training step per case, as ``seqpar bench --packing``
measures it) for Ulysses and ring, plain causal rows and rows of 512-token documents, 8k and 16k
tokens: peak(16k) / peak(8k) <= 2.3, packed <= 1.5x plain at 16k, ring's plain peak <= 1.3x Ulysses'.
"""

import pytest
import torch

from seqpar import bench
from seqpar.comm.launch import run_distributed
from seqpar.testing.memory import MIB, LiveMemory

F64 = 8  # bytes


def test_probe_counts_each_new_storage_once_views_and_inplace_nothing():
    before = torch.zeros(1000, dtype=torch.float64)  # the baseline: never counted
    with LiveMemory() as mem:
        a = torch.ones(1000, dtype=torch.float64)  # 8000
        view = a[::2]  # shares a's storage
        a.add_(1)
        before.mul_(2)
        torch.add(a, 1, out=before)  # writes into an existing storage
        b = a + view.sum()  # 8000 + 8 (the sum, freed at once)
        assert mem.live_bytes == 2 * 1000 * F64
        del a
        assert mem.live_bytes == 2 * 1000 * F64  # the view keeps a's storage alive
        del view, b
        assert mem.live_bytes == 0
        c = torch.empty(10, dtype=torch.float64)
        c.resize_(500)  # grows the counted storage
        assert mem.live_bytes == 500 * F64
    assert mem.peak_bytes == 2 * 1000 * F64 + F64


def test_probe_sees_the_backward_and_resets_its_peak():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    with LiveMemory() as mem:
        y = x.exp()  # 8000, saved for the backward
        loss = y.sum()  # 8
        assert mem.peak_bytes == 1000 * F64 + F64
        mem.reset_peak()
        loss.backward()  # the seed gradient (8), grad * y (8000, becomes x.grad)
        assert mem.peak_bytes == 2 * 1000 * F64 + 2 * F64
        del y, loss
        assert mem.live_bytes == 1000 * F64  # x.grad
    assert x.grad is not None


LENS = (8192, 16384)
DOC = 512
CONFIG = '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}'


def _collective_buffers(group: torch.distributed.ProcessGroup) -> dict[str, int]:
    """What the probe counts for one ring hop and for an all-to-all's forward and backward."""
    import seqpar
    from seqpar.comm.p2p import RingShift

    x = torch.randn(1, 64, 4, 8, dtype=torch.float64, requires_grad=True)  # [B, S/P, H, D]
    with LiveMemory() as hop:
        shift = RingShift(group)
        shift.start([x.detach()])
        (got,) = shift.wait()
    with LiveMemory() as a2a:
        y = seqpar.all_to_all(x, scatter_dim=2, gather_dim=1, group=group)  # [B, S, H/P, D]
        after_forward = a2a.live_bytes
        y.sum().backward()
        del y
    return {"hop": hop.peak_bytes, "got": got.untyped_storage().nbytes(), "a2a_out": 2 * 64 * 2 * 8 * F64,
            "a2a_after_forward": after_forward, "a2a_after_backward": a2a.live_bytes,
            "x_grad": x.grad.untyped_storage().nbytes()}


def _peaks(rank: int, world: int) -> dict:
    """Peak live bytes of one training step per (strategy, tokens, document length) on this rank."""
    out: dict = {"collectives": None}
    for strategy in ("ulysses", "ring"):
        case = bench.BenchCase("tiny-llama", CONFIG, world, strategy, max(LENS))
        mesh = bench.mesh_for(case, "cpu")
        if strategy == "ulysses":
            out["collectives"] = _collective_buffers(mesh.get_group("sp"))
        model, opt = bench.prepare(case, mesh, torch.device("cpu"))
        for n in LENS:
            for doc in (0, DOC):
                out[strategy, n, doc] = bench.probe_step(model, opt, mesh, bench.bench_batch(n, doc),
                                                         bench.layout_for(strategy))
    return out


@pytest.fixture(scope="module")
def peaks():
    """Per case, the larger of the two ranks' peaks, in MiB; and rank 0's collective counts."""
    per_rank = run_distributed(_peaks, 2, timeout=300, env={"OMP_NUM_THREADS": "1"})
    merged = {k: max(r[k] for r in per_rank) / MIB for k in per_rank[0] if k != "collectives"}
    return merged, per_rank[0]["collectives"]


@pytest.mark.distributed
def test_probe_counts_collective_buffers(peaks):
    c = peaks[1]
    assert c["hop"] == c["got"] == 64 * 4 * 8 * F64  # the receive buffer of one hop
    assert c["a2a_after_forward"] == c["a2a_out"]  # the output's buffer; the send buffer is gone
    assert c["a2a_after_backward"] == c["x_grad"] == 64 * 4 * 8 * F64


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
@pytest.mark.parametrize("doc", [0, DOC], ids=["plain", "packed"])
def test_peak_grows_linearly_with_the_sequence(peaks, strategy, doc):
    small, large = (peaks[0][strategy, n, doc] for n in LENS)
    assert large / small <= 2.3, f"{strategy} doc_len={doc}: {small:.1f} MiB at {LENS[0]}, {large:.1f} MiB at {LENS[1]}"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_packed_rows_cost_at_most_1_5x_plain(peaks, strategy):
    plain, packed = (peaks[0][strategy, LENS[1], doc] for doc in (0, DOC))
    assert packed <= 1.5 * plain, f"{strategy} at {LENS[1]}: packed {packed:.1f} MiB, plain {plain:.1f} MiB"


@pytest.mark.distributed
@pytest.mark.parametrize("n", LENS)
def test_ring_plain_peak_at_most_1_3x_ulysses(peaks, n):
    ring, ulysses = peaks[0]["ring", n, 0], peaks[0]["ulysses", n, 0]
    assert ring <= 1.3 * ulysses, f"at {n} tokens: ring {ring:.1f} MiB, Ulysses {ulysses:.1f} MiB"
