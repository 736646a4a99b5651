"""What a block's attention leaves alive under a non-reentrant activation checkpoint: nothing but its
output (``auto`` and a kernel with a fused lse twin run :class:`~seqpar.attention.kernel_autograd.Attend`,
whose saved tensors the checkpoint drops), where GuardedLocal's inner graph used to keep q, k, v and
the kernel's output for the whole step; and the gradients after the recompute are the float64
oracle's. Dropout (only sdpa samples it) stays on the local kernel."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from seqpar.attention.kernels import KERNELS, attend
from seqpar.attention.reference import reference_attention
from seqpar.attention.spec import AttnSpec
from seqpar.comm.guard import Guard
from seqpar.testing.memory import LiveMemory


def _block(x: torch.Tensor, spec: AttnSpec, kernel: str) -> torch.Tensor:
    # q, k, v made inside the block, as a decoder layer's projections are: [B, H, S, D]
    return attend(x * 2, x * 3, x.sin(), spec, None, KERNELS[kernel], Guard([], "test"))


def test_a_checkpointed_block_keeps_only_its_output_and_its_gradients_are_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 97, 8, generator=g, dtype=torch.float64, requires_grad=True)  # odd length
    spec = AttnSpec(causal=True)
    with LiveMemory() as mem:
        out = checkpoint(_block, x, spec, "auto", use_reentrant=False)
        assert mem.live_bytes == out.untyped_storage().nbytes()  # q, k, v, the kernel's out and lse: dropped
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, x, dout)
    want_out, _ = reference_attention(*(t.transpose(1, 2) for t in (x * 2, x * 3, x.sin())), causal=True)
    want_out = want_out.transpose(1, 2)  # [B, H, S, D]
    (want,) = torch.autograd.grad(want_out, x, dout)
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.allclose(grad, want, atol=1e-10, rtol=0)


def test_dropout_stays_on_the_local_kernel():
    x = torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    out = _block(x, AttnSpec(causal=True, dropout=0.1), "auto")
    assert type(out.grad_fn).__name__ == "GuardedLocalBackward"
    plain = _block(x, AttnSpec(causal=True), "auto")
    assert type(plain.grad_fn).__name__ == "AttendBackward"
