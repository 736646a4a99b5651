"""This process's memory: the resident set from ``/proc/self`` -- now (VmRSS), its anonymous part
(:func:`anonymous_rss_mib`), the peak (VmHWM) and resetting the peak to now (``clear_refs``), with
``getrusage`` where ``/proc`` is missing -- and, for telling a leak from an allocator keeping pages,
what the C heap has handed out (:func:`heap_in_use_mib`) and the tensors alive (:func:`live_tensors`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
import resource
import sys
import warnings


def status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``), None without /proc."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), flags=re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def anonymous_rss_mib() -> float | None:
    """The resident pages of this process's own memory, not of files (MiB): ``/proc/self/smaps_rollup``'s
    ``Anonymous`` (a walk of the page tables: exact), else ``/proc/self/status``'s ``RssAnon`` (a
    counter the kernel updates in batches), None without /proc."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            m = re.search(r"^Anonymous:\s+(\d+) kB", f.read(), flags=re.M)
        if m:
            return int(m.group(1)) / 1024
    except OSError:
        pass
    kib = status_kib("RssAnon")
    return None if kib is None else kib / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)


def rss_mib() -> float:
    """The resident set now (MiB)."""
    kib = status_kib("VmRSS")
    if kib is None:  # no /proc: the peak so far is the best available
        kib = _max_rss_kib()
    return kib / 1024


def peak_rss_mib(reset_ok: bool) -> float:
    """The resident peak (MiB) since the last :func:`reset_peak_rss` (``reset_ok``: it worked), else
    since the process started."""
    kib = status_kib("VmHWM") if reset_ok else None
    if kib is None:
        kib = _max_rss_kib()
    return kib / 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_in_use_mib() -> float | None:
    """What the C allocator has handed out and not been given back (MiB): glibc's ``mallinfo2``,
    bytes in use in its arenas plus its mmapped chunks (torch's CPU tensors are among them). Unlike
    the RSS it leaves out freed memory the allocator keeps and pages of shared libraries, so a
    value kept per step shows here and fragmentation does not. None without glibc >= 2.33."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return (info.uordblks + info.hblkhd) / 2**20


def live_tensors() -> tuple[int, float]:
    """The tensors the garbage collector can see alive (count, MiB of their distinct storages): a
    tensor kept per step makes both grow. Walks every tracked object: for samples, not per step."""
    import torch

    seen: dict[int, int] = {}
    count = 0
    with warnings.catch_warnings():  # isinstance() reads torch.distributed's deprecated reduce_op, which warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_sparse or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:  # a tensor subclass or a wrapper without storage
            continue
        count += 1
        seen[storage.data_ptr()] = storage.nbytes()
    return count, sum(seen.values()) / 2**20
