"""Local attention kernels: what one rank computes once the collectives have brought it its data.

The contract (layouts, lse, backward) is in :mod:`seqpar.attention.spec`. The registry by name:

=============  =====================================================================================
``auto``       the default: per block, ``sdpa`` where its flag says everything the block hides (no
               padding, no documents, no cut window) and nothing needs lse, else the device's varlen
               lse kernel (:func:`lse_kernel_for`) -- no code path builds an ``S x S`` mask; a block
               autograd records under a guard takes the device's fused lse kernel for ``sdpa``
               (:func:`attend`: what it saves, activation checkpoints can drop)
``flash_cpu``  fused CPU op per document rectangle, with lse (window, chunk)
``cuda_flash`` torch's FlashAttention-2 / memory-efficient CUDA ops per rectangle, with lse
``cuda_cudnn`` ``cuda_flash`` with cuDNN's fused attention for its unmasked / causal tiles
``flex``       FlexAttention, compiled, with a BlockMask from the batch's structure: softcap on CUDA
``fastest``    per shape class, the fastest of the above three that are verified on this GPU, measured
               once per process (:mod:`~seqpar.attention.kernel_choice`): what ``auto`` runs on CUDA
               where more than one is verified (:data:`GPU_VERIFIED`; the others are opt-in by name)
``tiled``      the reference math per tile: every option (softcap), any dtype and device, O(S) memory
``sdpa``       torch's SDPA with its causal flag only (any backend, dropout; no lse); a block that
               needs a mask is refused -- use ``auto``, or ``sdpa_dense`` to accept an ``S x S`` mask
``sdpa_dense`` SDPA with a dense ``[B, 1, Sq, Sk]`` bool mask: what its name says
``reference``  the float64 oracle's math on the whole block (``Sq x Sk`` scores): tests only
=============  =====================================================================================

:func:`attend` makes any kernel differentiable, folds attention sinks into an lse kernel's result
and runs the kernel under a :class:`~seqpar.comm.guard.Guard` (the autograd Functions it applies:
:mod:`seqpar.attention.kernel_autograd`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..comm.guard import Guard
from ..errors import Refused
from .cuda import CudaFlashKernel, CudnnKernel
from .flash_cpu import CpuFlashKernel
from .flex import FlexKernel
from .kernel_autograd import Attend, GuardedLocal, placeholder
from .kernel_choice import MEASURE_ENV, FastestKernel, eligible, measuring, recorded_kernels
from .reference import ReferenceKernel
from .spec import AttnSpec, Kernel, LocalKernel, LseKernel, MaskInfo, check_supported
from .tiled import TiledKernel
from .varlen import mask_flag, plan_mask


class SdpaKernel(LocalKernel):
    """``torch.nn.functional.scaled_dot_product_attention`` with its causal flag only: any backend
    torch picks (flash, memory-efficient, cuDNN on GPU), dropout. Returns no lse, so it serves
    Ulysses but not a ring. A block that needs a mask raises ValueError instead of building one."""

    name = "sdpa"
    supports = frozenset({"window", "chunk", "dropout"})

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        check_supported(self, spec)
        causal = mask_flag(spec, mask, q.shape[2], k.shape[2], q.device)
        if causal is None:
            raise Refused("kernel='sdpa' would need a dense [B, 1, S, S] mask for this block (padding, packed "
                          "documents, bidirectional spans, a window or chunk, or a permuted causal layout): use "
                          "kernel='auto' (a varlen "
                          "kernel, O(S) memory) or kernel='sdpa_dense' to accept the S x S mask")
        return F.scaled_dot_product_attention(q, k, v, dropout_p=spec.dropout, is_causal=causal,
                                              scale=spec.scale_for(q.shape[-1]), enable_gqa=q.shape[1] != k.shape[1])


class DenseSdpaKernel(LocalKernel):
    """SDPA with a dense ``[B or 1, 1, Sq, Sk]`` bool mask where its flag does not suffice: O(S^2)
    memory, as the name says; for dropout on padded / packed rows, and as a peer in benchmarks."""

    name = "sdpa_dense"
    supports = frozenset({"window", "chunk", "dropout"})

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        check_supported(self, spec)
        causal, allowed = plan_mask(spec, mask, q.shape[2], k.shape[2], q.device)
        seen = None if allowed is None else allowed.any(dim=-1, keepdim=True)  # [B or 1, 1, Sq, 1]
        # A row that sees no key would be NaN: let it see everything, then zero it.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if allowed is None else allowed | ~seen,
                                             dropout_p=spec.dropout, is_causal=causal,
                                             scale=spec.scale_for(q.shape[-1]), enable_gqa=q.shape[1] != k.shape[1])
        return out if seen is None else out * seen


class AutoKernel(LocalKernel):
    """``kernel="auto"``: resolved per block by :func:`auto_kernel` inside :func:`attend`."""

    name = "auto"
    supports = frozenset({"window", "softcap", "chunk", "dropout", "sinks"})

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        return attend(q, k, v, spec, mask, self)

    def lse_twin(self, spec: AttnSpec) -> str | None:
        return None if spec.dropout else "auto"  # sdpa or the varlen kernel: the same math; dropout only sdpa samples


class FunctionKernel(LocalKernel):
    """A plain function ``fn(q, k, v, *, spec, mask) -> out`` as a kernel; it reads the spec itself."""

    supports = None

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn, self.name = fn, getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        return self.fn(q, k, v, spec=spec, mask=mask)


def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None, kernel: Kernel,
           guard: Guard | None = None) -> Tensor:
    """Differentiable attention of one block with any kernel; returns ``out [B, H, Sq, Dv]``.

    ``spec.sinks [H]`` (this block's query heads) are folded into an lse kernel's result; a local
    kernel must honour them itself (see :func:`check_supported`). With ``guard`` the kernel's
    forward and backward run under it: a failure gives zeros here and is raised by the guard's fence.
    """
    recording = guard is not None and _tracks_grad(q, k, v, spec.sinks)
    if isinstance(kernel, AutoKernel):
        chosen = KERNELS[auto_kernel(q, spec, mask)]
        kernel = chosen if isinstance(chosen, LseKernel) or not recording else _saveable(kernel, q, spec, chosen)
    elif recording and not isinstance(kernel, LseKernel):
        kernel = _saveable(kernel, q, spec, kernel)
    check_supported(kernel, spec)
    if isinstance(kernel, LseKernel):
        return Attend.apply(q, k, v, spec.sinks, spec, mask, kernel, guard)[0]
    if guard is None:
        return kernel(q, k, v, spec=spec, mask=mask)
    if _tracks_grad(q, k, v, spec.sinks):
        return GuardedLocal.apply(q, k, v, spec.sinks, spec, mask, kernel, guard)
    out = guard.call(kernel, q, k, v, spec=spec, mask=mask)
    return out if out is not None else placeholder(q, v)[0]


def _tracks_grad(*xs: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _saveable(kernel: LocalKernel, q: Tensor, spec: AttnSpec, otherwise: Kernel) -> Kernel:
    """For a block autograd records under a guard: the local kernel's lse twin
    (:meth:`~seqpar.attention.spec.LocalKernel.lse_twin`: ``auto``'s ``sdpa``, a model's plain SDPA;
    the same math, not under dropout) where it is a fused kernel. Its autograd
    (:class:`~seqpar.attention.kernel_autograd.Attend`) saves q, k, v, out and lse through
    ``save_for_backward``, which a non-reentrant activation checkpoint drops and recomputes, where
    :class:`~seqpar.attention.kernel_autograd.GuardedLocal` keeps its inner graph in ``ctx``: under
    ``reduce_memory``'s checkpoints that kept every layer's gathered q, k, v and kernel output for the
    whole step (2.5 layer inputs per layer at benchmarks/bench_alst.py's shape). Without a twin, or
    with only ``tiled`` for it: ``otherwise``."""
    twin = kernel.lse_twin(spec)
    name = fused_lse_kernel(q.device, q.dtype, spec) if twin == "auto" else twin
    return KERNELS[name] if name is not None and isinstance(KERNELS.get(name), LseKernel) else otherwise


KERNELS: dict[str, Kernel] = {
    "auto": AutoKernel(),
    "flash_cpu": CpuFlashKernel(),
    "cuda_flash": CudaFlashKernel(),
    "cuda_cudnn": CudnnKernel(),
    "flex": FlexKernel(),
    "fastest": FastestKernel(lambda name: KERNELS[name], lambda *args: cuda_candidates(*args)),
    "tiled": TiledKernel(),
    "sdpa": SdpaKernel(),
    "sdpa_dense": DenseSdpaKernel(),
    "reference": ReferenceKernel(),
}

_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_warned: set[str] = set()
"""What this process was told once already: a fixed vocabulary ("tiled", "sdpa_dense"), so it stays
this small. Not Python's once-per-location warning registry: every ``warnings.catch_warnings()``
(flex's per call, torch's own) resets that, and the warning would come back per layer."""


GPU_VERIFIED = frozenset({"cuda_flash"})
"""The CUDA kernels that have passed their gpu-marked tests on the project's GPU runs
(``make gpu-check``): ``cuda_flash`` on an H200 with torch 2.11 (2026-11-30), after a fix to its
half-precision backward that only those tests could find. ``flex`` and ``cuda_cudnn`` have not run
on a GPU yet; when their tests pass there, add them here. ``auto`` picks only these (and those this
machine's own ``make gpu-check`` recorded: :func:`verified_kernels`), so a kernel that never ran on
the hardware is opt-in by name and cannot be silently wrong by default."""

CUDA_ORDER = ("cuda_flash", "flex", "cuda_cudnn")
"""The CUDA lse kernels in the order ``auto`` prefers them without measuring."""


def verified_kernels(device: torch.device) -> frozenset[str]:
    """The CUDA kernels verified for ``device``: :data:`GPU_VERIFIED` and this machine's record."""
    return GPU_VERIFIED | recorded_kernels(device)


def gpu_verified(device: torch.device | None = None) -> dict[str, bool]:
    """Each CUDA kernel: has it passed its gpu-marked tests on a GPU (``device``'s, by this
    machine's record, too)?"""
    ok = GPU_VERIFIED if device is None else verified_kernels(device)
    return {name: name in ok for name in CUDA_ORDER}


def cuda_candidates(device: torch.device, dtype: torch.dtype, spec: AttnSpec) -> list[str]:
    """The CUDA lse kernels ``auto`` may run for ``spec`` on ``device`` in ``dtype``: verified there
    and honouring the options, in :data:`CUDA_ORDER`; [] off CUDA or in another dtype."""
    if device.type != "cuda" or dtype not in _CUDA_DTYPES:
        return []
    return eligible(CUDA_ORDER, verified_kernels(device), KERNELS, spec)


def fused_lse_kernel(device: torch.device, dtype: torch.dtype, spec: AttnSpec) -> str | None:
    """:func:`lse_kernel_for`'s fused choices, None where only ``tiled`` is left (nothing said)."""
    if device.type == "cpu" and spec.options() - {"sinks"} <= KERNELS["flash_cpu"].supports:
        return "flash_cpu"
    found = cuda_candidates(device, dtype, spec)
    if found:
        return "fastest" if len(found) > 1 and measuring() else found[0]
    return None


def lse_kernel_for(device: torch.device, dtype: torch.dtype, spec: AttnSpec) -> str:
    """The varlen lse kernel ``auto`` uses on ``device`` for ``spec``: ``flash_cpu`` (CPU); on CUDA
    (float16 / bfloat16 / float32) the verified kernels that honour the options
    (:func:`cuda_candidates`; sinks are folded around any lse kernel): ``fastest`` -- measured per
    shape class -- where there are several, unless ``SEQPAR_MEASURE_KERNELS=0`` (then the first),
    else the one; else ``tiled`` -- said once."""
    choice = fused_lse_kernel(device, dtype, spec)
    if choice is not None:
        return choice
    options = spec.options() - {"sinks"}
    cuda = device.type == "cuda" and dtype in _CUDA_DTYPES
    fused = cuda and options <= KERNELS["cuda_flash"].supports
    flex = cuda and not fused and options <= KERNELS["flex"].supports
    if device.type != "cpu" and "tiled" not in _warned:
        _warned.add("tiled")
        why = ("cuda_flash has not been verified on a GPU yet (make gpu-check; kernel='cuda_flash' opts in)" if fused
               else "flex has not been verified on a GPU yet (make gpu-check; kernel='flex' opts in)" if flex
               else f"no fused attention kernel on {device.type} honours {sorted(options) or dtype}")
        warnings.warn(f"{why}: running 'tiled' (exact, O(S) memory, plain PyTorch per tile: slower than a fused "
                      "kernel)", stacklevel=2)
    return "tiled"


def describe_kernels(device: torch.device | None = None) -> str:
    """In words: which CUDA kernels ``auto`` may run (on ``device``: with this machine's record),
    whether it measures, and per shape class met so far in this process the kernel it chose and
    the times it chose on (``seqpar`` prints it after a benchmark)."""
    ok = [name for name, v in gpu_verified(device).items() if v]
    how = ("measures each shape class once and runs the fastest" if measuring()
           else f"runs the first that honours the options ({MEASURE_ENV}=0)")
    lines = [f"auto on CUDA: verified {', '.join(ok) or 'none'}; of several, it {how}"]
    fastest = KERNELS["fastest"]
    lines += [f"  {line}" for line in (fastest.describe() if isinstance(fastest, FastestKernel) else [])]
    return "\n".join(lines)


def auto_kernel(q: Tensor, spec: AttnSpec, mask: MaskInfo | None, sk: int | None = None) -> str:
    """What ``kernel="auto"`` runs for a block of ``q [B, H, Sq, D]`` against ``sk`` keys (default
    ``Sq``): ``sdpa`` where its flag says everything the block hides and neither sinks nor softcap
    need more, else :func:`lse_kernel_for`. Dropout only ``sdpa`` samples: on a block that needs a
    mask that is ``sdpa_dense`` (an ``S x S`` mask), said once by a warning."""
    sk = q.shape[2] if sk is None else sk
    flag = mask_flag(spec, mask, q.shape[2], sk, q.device)
    if spec.dropout:
        if flag is None and "sdpa_dense" not in _warned:
            _warned.add("sdpa_dense")
            warnings.warn("attention dropout on padded / packed rows (or a cut window) runs on sdpa_dense, which "
                          "builds an S x S mask; set the model's attention dropout to 0 for the O(S) varlen kernels",
                          stacklevel=2)
        return "sdpa" if flag is not None else "sdpa_dense"
    if flag is not None and spec.sinks is None and spec.softcap is None:
        return "sdpa"
    return lse_kernel_for(q.device, q.dtype, spec)


KernelArg = str | Kernel | Callable[..., Tensor]
"""What the attention functions accept as ``kernel``: a name of :data:`KERNELS`, a kernel object,
or a plain function ``fn(q, k, v, *, spec, mask) -> out``."""


def get_kernel(kernel: KernelArg) -> Kernel:
    """A kernel by name (:data:`KERNELS`), a kernel object as it is, or a plain function wrapped in
    :class:`FunctionKernel`. Raises ValueError for anything else."""
    if isinstance(kernel, str):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(KERNELS)}"
                             " or pass a kernel object / callable")
        return KERNELS[kernel]
    if isinstance(kernel, (LseKernel, LocalKernel)):
        return kernel
    if callable(kernel):
        return FunctionKernel(kernel)
    raise ValueError(f"kernel must be a name, a Kernel object or a callable, got {type(kernel).__name__}")


def lse_kernel(kernel: KernelArg, q: Tensor | None = None, spec: AttnSpec | None = None) -> LseKernel:
    """Like :func:`get_kernel`, but the kernel must return lse and have a backward (ring attention);
    ``"auto"`` (with ``q`` and ``spec``) is :func:`lse_kernel_for` q's device."""
    if isinstance(kernel, str) and kernel == "auto" and q is not None and spec is not None:
        kernel = lse_kernel_for(q.device, q.dtype, spec)
    k = get_kernel(kernel)
    if not isinstance(k, LseKernel):
        raise Refused(f"ring attention needs a kernel that returns the log-sum-exp and has a backward;"
                      f" {k.name!r} does not. Use kernel='auto' (flash_cpu on CPU, cuda_flash on CUDA,"
                      " tiled elsewhere)")
    return k
