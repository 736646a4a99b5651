"""The C allocator set up so that a process's resident peak is the peak of what its step holds."""

from __future__ import annotations


def exact_malloc() -> None:
    """Make glibc hand every freed block of 64 KiB or more back to the system at once (a fixed
    ``M_MMAP_THRESHOLD``; by default glibc raises it to 32 MiB as blocks are freed, then keeps
    freed tiles in its heap), so that the resident peak is the peak of what the step holds.

    64 KiB, not 1 MiB: a tiled step's tiles (``[256, I]`` of an MLP, a layer's q/k/v) are mostly
    under 1 MiB, and in the heap their peak depended on the order torch allocates in. With 1 MiB the
    tiny tiled case of ``test_memory_model`` measured 1.10x its estimate under torch 2.13 and
    1.17-1.31x under 2.15 (same tensors, counted); with 64 KiB both give 0.93x, run after run.
    mmap per block costs the measured step some time (~20% on that tiny case), not its memory."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except OSError:  # not glibc: its allocator's own behaviour is what gets measured
        pass
