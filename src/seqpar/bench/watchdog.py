"""The brake of ``seqpar bench --max-seq``: a thread that ends a worker whose resident set crosses
its cap, before the step takes the machine's memory."""

from __future__ import annotations

import os
import threading

OVER_CAP_EXIT = 86  # a worker's exit code when its watchdog stopped it above the cap


class RssWatchdog:
    """A thread that ends this process (exit code :data:`OVER_CAP_EXIT`) once its resident set
    exceeds ``limit_bytes``: a step far over the cap stops instead of taking the machine's memory.
    It samples every ``interval`` seconds, so a short spike can slip between samples; the verdict
    is the kernel's exact peak (VmHWM) read after the step, and this is the brake."""

    def __init__(self, limit_bytes: int, interval: float = 0.002) -> None:
        self.limit_pages = limit_bytes // os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        with open("/proc/self/statm") as f:
            while not self._stop.wait(interval):
                f.seek(0)
                if int(f.read().split()[1]) > self.limit_pages:
                    os._exit(OVER_CAP_EXIT)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
