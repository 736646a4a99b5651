"""``auto``'s measured kernel choice on CUDA (issue 27 item 3), on the CPU: real CPU lse kernels
(``tiled``, ``flash_cpu``) stand in for the CUDA ones, each advancing a fake clock by its own cost
per call, and the injected timer reads that clock -- so which kernel is "fastest" is set by the
test. Checked: the fastest eligible candidate runs and its result is exactly its own; unverified or
option-incompatible kernels are never timed nor run; a ring call of three layers and its backward
(rank 1 of 4 on torch's fake process group) measures once per shape class, and a second batch not
at all; ``SEQPAR_MEASURE_KERNELS=0`` gives the fixed order; the description names the choices; this
machine's gpu-check record extends the verified set of its own GPU only. The gpu-marked test times
the real CUDA kernels with CUDA events.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from seqpar import compat
from seqpar.attention import kernel_choice, kernels, ring_loop
from seqpar.attention.kernel_choice import MEASURE_ENV, FastestKernel, bucket, eligible, shape_class
from seqpar.attention.kernels import KERNELS, lse_kernel_for
from seqpar.attention.layout import layout_permutation
from seqpar.attention.shard import SeqShard
from seqpar.attention.spec import AttnSpec, LseKernel, MaskInfo

P, N = 4, 6  # ranks, tokens per rank of the ring call


class Clock:
    """A fake clock the candidates advance and the injected timer reads; counts the timings."""

    def __init__(self) -> None:
        self.now, self.timed = 0.0, 0

    def timer(self, fn, device) -> float:
        self.timed += 1
        start = self.now
        fn()
        return self.now - start


class Clocked(LseKernel):
    """A real lse kernel that costs ``cost`` fake seconds per call; counts its calls by entry point."""

    def __init__(self, name: str, base: LseKernel, cost: float, clock: Clock) -> None:
        self.name, self.base, self.cost, self.clock, self.supports = name, base, cost, clock, base.supports
        self.calls: Counter = Counter()

    def _tick(self, what: str) -> None:
        self.clock.now += self.cost
        self.calls[what] += 1

    def forward(self, q, k, v, spec, mask):
        self._tick("forward")
        return self.base.forward(q, k, v, spec, mask)

    def backward(self, dout, q, k, v, out, lse, spec, mask):
        self._tick("backward")
        return self.base.backward(dout, q, k, v, out, lse, spec, mask)

    def fused_forward(self, q, k, v, spec, causal):
        self._tick("fused_forward")
        return self.base.fused_forward(q, k, v, spec, causal)

    def fused_backward(self, dout, q, k, v, out, lse, spec, causal):
        self._tick("fused_backward")
        return self.base.fused_backward(dout, q, k, v, out, lse, spec, causal)


ORDER = ("slow", "no_softcap", "slow_softcap", "quick", "unverified")
VERIFIED = {"slow", "no_softcap", "slow_softcap", "quick"}


def _fastest(costs: dict[str, float] | None = None) -> tuple[FastestKernel, dict[str, Clocked], Clock]:
    """A FastestKernel over clocked CPU kernels: ``no_softcap`` (flash_cpu: no softcap) is the
    fastest of all but ``unverified``; ``quick`` (tiled) the fastest that honours softcap."""
    clock = Clock()
    base = {"slow": "flash_cpu", "no_softcap": "flash_cpu", "slow_softcap": "tiled", "quick": "tiled",
            "unverified": "tiled"}
    costs = costs or {"slow": 5.0, "no_softcap": 0.01, "slow_softcap": 3.0, "quick": 1.0, "unverified": 0.001}
    pool = {n: Clocked(n, KERNELS[b], costs[n], clock) for n, b in base.items()}
    fastest = FastestKernel(pool.__getitem__, lambda device, dtype, spec: eligible(ORDER, VERIFIED, pool, spec),
                            clock.timer)
    return fastest, pool, clock


def _qkv(sq: int = 12, sk: int = 12, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    return (torch.randn(2, heads, sq, dim, generator=g, dtype=torch.float64),
            *(torch.randn(2, kv_heads, sk, dim, generator=g, dtype=torch.float64) for _ in range(2)))


@pytest.fixture(autouse=True)
def _measuring(monkeypatch):
    monkeypatch.delenv(MEASURE_ENV, raising=False)


def test_the_fastest_eligible_kernel_runs_and_its_result_is_its_own():
    fastest, pool, clock = _fastest()
    q, k, v = _qkv()
    causal, capped = AttnSpec(causal=True), AttnSpec(causal=True, softcap=2.0)
    for spec, winner, timed in ((causal, "no_softcap", {"slow", "no_softcap", "slow_softcap", "quick"}),
                                (capped, "quick", {"slow_softcap", "quick"})):
        before = {n: sum(p.calls.values()) for n, p in pool.items()}
        out, lse = fastest.forward(q, k, v, spec, None)
        want = pool[winner].base.forward(q, k, v, spec, None)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])  # the chosen kernel's own output
        ref = KERNELS["reference"].forward(q, k, v, spec, None)
        torch.testing.assert_close(out, ref[0], rtol=0, atol=1e-12)
        ran = {n for n, p in pool.items() if sum(p.calls.values()) > before[n]}
        assert ran == timed  # never the unverified one, nor (softcap) those that cannot honour it
        # one timed call per candidate (the fake timer's), then the real call of the winner
        runs = {n: sum(p.calls.values()) - before[n] for n, p in pool.items() if n in timed}
        assert runs == {n: 1 + (n == winner) for n in timed}
    chosen = {key.options: c.kernel for key, c in fastest.chosen.items()}
    assert chosen == {("causal",): "no_softcap", ("causal", "softcap"): "quick"}
    assert clock.timed == 6


def test_eligible_keeps_the_order_and_drops_unverified_or_incompatible():
    _, pool, _ = _fastest()
    assert eligible(ORDER, VERIFIED, pool, AttnSpec(causal=True, window=3)) == ["slow", "no_softcap", "slow_softcap",
                                                                               "quick"]
    assert eligible(ORDER, VERIFIED, pool, AttnSpec(softcap=1.0, sinks=torch.zeros(4))) == ["slow_softcap", "quick"]
    assert eligible(ORDER, set(), pool, AttnSpec()) == []


def test_auto_on_cuda_measures_only_among_verified_kernels_that_honour_the_options(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_choice.RECORD_ENV, str(tmp_path / "none.json"))
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash"}))
    assert kernels.cuda_candidates(cuda, torch.bfloat16, AttnSpec(causal=True)) == ["cuda_flash"]
    assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True)) == "cuda_flash"  # one: nothing to measure
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash", "cuda_cudnn", "flex"}))
    assert kernels.cuda_candidates(cuda, torch.bfloat16, AttnSpec(causal=True)) == ["cuda_flash", "flex", "cuda_cudnn"]
    assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True, window=8)) == "fastest"
    assert kernels.cuda_candidates(cuda, torch.float16, AttnSpec(softcap=3.0)) == ["flex"]
    assert lse_kernel_for(cuda, torch.float16, AttnSpec(softcap=3.0)) == "flex"
    assert kernels.cuda_candidates(cuda, torch.float64, AttnSpec(causal=True)) == []
    assert kernels.cuda_candidates(torch.device("cpu"), torch.float32, AttnSpec(causal=True)) == []
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash", "flex"}))
    assert kernels.cuda_candidates(cuda, torch.bfloat16, AttnSpec(causal=True)) == ["cuda_flash", "flex"]


def test_the_shape_class():
    q, k, v = _qkv(48, 60)
    key = shape_class(q, k, v, AttnSpec(causal=True, sinks=torch.zeros(4)), "masked", "forward")
    assert (key.sq, key.sk, key.gqa, key.head_dim, key.options) == (64, 64, 2, 8, ("causal",))
    assert key == shape_class(*_qkv(33, 64), AttnSpec(causal=True), "masked", "forward")  # same buckets
    assert key != shape_class(*_qkv(65, 60), AttnSpec(causal=True), "masked", "forward")
    assert key != shape_class(*_qkv(48, 60, heads=2), AttnSpec(causal=True), "masked", "forward")  # GQA 1
    assert key != shape_class(*_qkv(48, 60, dim=16), AttnSpec(causal=True), "masked", "forward")
    assert key != shape_class(q, k, v, AttnSpec(causal=True, window=4), "masked", "forward")
    assert key != shape_class(q, k, v, AttnSpec(causal=True), "fused causal", "forward")
    assert key != shape_class(q, k, v, AttnSpec(causal=True), "masked", "backward")
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8192, 8193)] == [1, 2, 4, 4, 8, 8192, 16384]
    assert str(key) == "cpu float64 causal D=8 GQA=2 Sq<=64 Sk<=64 masked forward"


def _ring_layers(kernel: LseKernel | str, shard: SeqShard, x: torch.Tensor, layers: int = 3) -> torch.Tensor:
    """Three ring attention layers of rank 1 of P over ``shard`` with ``kernel``, and their backward."""
    import torch.distributed as dist

    from seqpar.attention.ring import ring_attention

    y = x
    for _ in range(layers):
        y = ring_attention(y, y[:, :, :2], y[:, :, :2], group=dist.group.WORLD, causal=True, shard=shard,
                           validate=False, kernel=kernel)
    y.sum().backward()
    return y


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_ring_measures_once_per_shape_class_not_per_block_layer_or_batch(layout):
    """Rank 1 of 4: every block class is measured at its first block, forward and backward; the
    other blocks, layers 2 and 3 and a second batch reuse the choice and run only it. (On the fake
    process group the received blocks hold no data: counted here, not compared.)"""
    fastest, pool, clock = _fastest({"slow": 2.0, "no_softcap": 3.0, "slow_softcap": 4.0, "quick": 1.0,
                                     "unverified": 0.0})
    perm = None if layout == "contiguous" else layout_permutation(P * N, P, layout)
    torch.manual_seed(0)
    with compat.fake_process_group(1, P):
        shard = SeqShard((N,) * P, perm)
        _ring_layers(fastest, shard, torch.randn(2, N, 4, 8, dtype=torch.float64, requires_grad=True))
        plans = [p for p in ring_loop.block_plans(shard, AttnSpec(causal=True), 1) if p is not None]
        classes = {(p.fused, bucket(p.rows[1]), bucket(p.cols[1])) for p in plans}
        assert len(classes) < len(plans) or layout == "contiguous"  # zigzag: blocks share a class
        assert len(fastest.chosen) == 2 * len(classes)  # forward and backward of each
        assert clock.timed == 4 * len(fastest.chosen)  # the four verified candidates, once per class
        assert {c.kernel for c in fastest.chosen.values()} == {"quick"}
        _ring_layers(fastest, SeqShard((N,) * P, perm), torch.randn(2, N, 4, 8, dtype=torch.float64,
                                                                   requires_grad=True))  # a new batch
    assert clock.timed == 4 * len(fastest.chosen) and len(fastest.chosen) == 2 * len(classes)
    for name in ("slow", "no_softcap", "slow_softcap"):  # timed once per class, never run for real
        assert sum(pool[name].calls.values()) == len(fastest.chosen)
    assert pool["unverified"].calls == {}
    # the chosen one: its timing per class, then every block of 3 layers x 2 batches, both ways
    assert pool["quick"].calls == Counter({"fused_forward": len(classes) + 6 * len(plans),
                                           "fused_backward": len(classes) + 6 * len(plans)})


def test_attend_with_the_choice_is_exact_forward_and_backward():
    """Masked blocks (padding) through ``attend``: float64 against the reference, out and grads."""
    fastest, _, _ = _fastest()
    q, k, v = (t.requires_grad_(True) for t in _qkv(12, 12))
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :5] = False
    mask, spec = MaskInfo(key_keep=keep), AttnSpec(causal=True, window=6)
    out = kernels.attend(q, k, v, spec, mask, fastest)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = KERNELS["reference"]
    want_out, want_lse = ref.forward(q.detach(), k.detach(), v.detach(), spec, mask)
    want = ref.backward(dout, q.detach(), k.detach(), v.detach(), want_out, want_lse, spec, mask)
    for got, exp in zip((out, *grads), (want_out, *want), strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-12)
    assert sorted(key.direction for key in fastest.chosen) == ["backward", "forward"]
    assert {c.kernel for c in fastest.chosen.values()} == {"no_softcap"}


def test_measurement_off_gives_the_fixed_order_and_keeps_nothing(monkeypatch):
    fastest, pool, clock = _fastest()
    q, k, v = _qkv()
    monkeypatch.setenv(MEASURE_ENV, "0")
    out, _ = fastest.forward(q, k, v, AttnSpec(causal=True), None)
    assert torch.equal(out, KERNELS["flash_cpu"].forward(q, k, v, AttnSpec(causal=True), None)[0])
    assert clock.timed == 0 and not fastest.chosen and pool["slow"].calls == {"forward": 1}
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash", "cuda_cudnn"}))
    assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True)) == "cuda_flash"
    assert "SEQPAR_MEASURE_KERNELS=0" in kernels.describe_kernels()
    monkeypatch.setenv(MEASURE_ENV, "1")
    assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True)) == "fastest"
    fastest.forward(q, k, v, AttnSpec(causal=True), None)
    assert clock.timed == 4 and len(fastest.chosen) == 1


def test_the_description_says_what_was_chosen_and_on_what(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_choice.RECORD_ENV, str(tmp_path / "none.json"))
    fastest, _, _ = _fastest()
    monkeypatch.setitem(KERNELS, "fastest", fastest)
    assert kernels.describe_kernels().splitlines() == [
        "auto on CUDA: verified cuda_flash; of several, it measures each shape class once and runs the fastest"]
    q, k, v = _qkv()
    out, lse = fastest.fused_forward(q, k, v, AttnSpec(causal=True), True)
    fastest.fused_backward(torch.ones_like(out), q, k, v, out, lse, AttnSpec(causal=True), True)
    lines = kernels.describe_kernels().splitlines()
    assert len(lines) == 3
    assert lines[1] == ("  cpu float64 causal D=8 GQA=2 Sq<=16 Sk<=16 fused causal backward: no_softcap (the fastest"
                        " measured: slow 5e+03 ms, no_softcap 10 ms, slow_softcap 3e+03 ms, quick 1e+03 ms)")
    assert lines[2].startswith("  cpu float64 causal D=8 GQA=2 Sq<=16 Sk<=16 fused causal forward: no_softcap")


def test_a_candidate_that_raises_is_not_chosen_and_said(monkeypatch):
    fastest, pool, _ = _fastest()

    def broken(*args, **kwargs):
        raise RuntimeError("no execution plan for this shape")

    monkeypatch.setattr(pool["no_softcap"], "forward", broken)
    q, k, v = _qkv()
    out, _ = fastest.forward(q, k, v, AttnSpec(causal=True), None)
    (choice,) = fastest.chosen.values()
    assert choice.kernel == "quick" and choice.seconds["no_softcap"] is None
    assert choice.failures == {"no_softcap": "RuntimeError: no execution plan for this shape"}
    assert "no_softcap failed: RuntimeError" in str(choice)
    for name in VERIFIED:
        monkeypatch.setattr(pool[name], "forward", broken)
    with pytest.raises(RuntimeError, match="no execution plan"):
        fastest.forward(q, k, v, AttnSpec(causal=True, window=3), None)


def test_no_candidate_is_refused():
    fastest = FastestKernel(KERNELS.__getitem__, lambda device, dtype, spec: [])
    with pytest.raises(ValueError, match="kernel='fastest' has no kernel verified on cpu.*use kernel='auto'"):
        fastest.forward(*_qkv(), AttnSpec(causal=True), MaskInfo())


def test_this_machines_record_extends_the_verified_set_of_its_gpu_only(monkeypatch, tmp_path):
    record = tmp_path / "seqpar" / "gpu_verified.json"
    monkeypatch.setenv(kernel_choice.RECORD_ENV, str(record))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = {"name": "GPU A"}
    monkeypatch.setattr(kernel_choice, "_machine", lambda device: f"{gpu['name']} | torch {torch.__version__}")
    cuda = torch.device("cuda", 0)
    assert kernels.verified_kernels(cuda) == {"cuda_flash"}  # no record yet
    assert kernel_choice.record_verified(["cuda_cudnn"], cuda) == record
    kernel_choice.record_verified(["flex"], cuda)
    assert kernels.verified_kernels(cuda) == {"cuda_flash", "cuda_cudnn", "flex"}
    assert kernels.gpu_verified(cuda) == {"cuda_flash": True, "flex": True, "cuda_cudnn": True}
    assert kernels.gpu_verified() == {"cuda_flash": True, "flex": False, "cuda_cudnn": False}  # the committed set
    assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True)) == "fastest"
    gpu["name"] = "GPU B"  # another GPU model (or torch) than the one the tests passed on
    assert kernels.verified_kernels(cuda) == {"cuda_flash"}
    record.write_text("{not json")
    kernel_choice._read_record.cache_clear()
    with pytest.warns(UserWarning, match="ignoring the GPU record .*rerun `make gpu-check`"):
        assert kernels.verified_kernels(cuda) == {"cuda_flash"}
    kernel_choice._read_record.cache_clear()
    assert kernels.verified_kernels(torch.device("cpu")) == {"cuda_flash"}  # off CUDA no record is read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timing_with_events_and_no_sync_once_a_class_is_known():
    """The measurement on a real GPU: ``cuda_flash`` under two names (so nothing here depends on
    which kernel is faster, and nothing unverified runs) on a bf16 fused causal block -- times
    measured with CUDA events, the result the chosen kernel's own, and a second call of the class
    with CUDA sync errors on -- then through ``attend`` with autograd: the backward is measured
    as its own class, inside the autograd backward."""
    pool = {"flash_a": KERNELS["cuda_flash"], "flash_b": KERNELS["cuda_flash"]}
    fastest = FastestKernel(pool.__getitem__, lambda device, dtype, spec: ["flash_a", "flash_b"])
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    spec = AttnSpec(causal=True)
    out, lse = fastest.fused_forward(q, k, v, spec, True)
    (choice,) = fastest.chosen.values()
    assert set(choice.seconds) == {"flash_a", "flash_b"} and all(s > 0 for s in choice.seconds.values())
    want = KERNELS["cuda_flash"].fused_forward(q, k, v, spec, True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fastest.fused_forward(q, k, v, spec, True)  # the class is known: no timing, no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ins = [t.clone().requires_grad_(True) for t in (q[:, :, :1000], k[:, :, :1000], v[:, :, :1000])]
    kernels.attend(*ins, spec, MaskInfo(), fastest).sum().backward()
    assert sorted((key.block, key.direction) for key in fastest.chosen) == [
        ("fused causal", "forward"), ("masked", "backward"), ("masked", "forward")]
    assert all(torch.isfinite(t.grad).all() for t in ins)
