"""This process's resident memory from ``/proc/self``: now (VmRSS), the peak (VmHWM), and resetting
the peak to now (``clear_refs``), with ``getrusage`` where ``/proc`` is missing."""

from __future__ import annotations

import re
import resource
import sys


def status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``"VmRSS"``, ``"VmHWM"``), None without /proc."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), flags=re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


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
