"""A deterministic memory probe: the peak bytes of live tensor storage during a region of code.

Peak RSS depends on the allocator, on the other processes of the machine and on what was freed
before; this counts tensors instead. Inside ``with LiveMemory() as mem:`` every storage that an op
*creates* (any aten op, the backward's included, and the buffers collectives write into) is counted
once, keyed by storage identity so a view never counts twice, and leaves the count when the storage
dies; ``mem.peak_bytes`` is the highest count reached (``live_bytes`` the count now)::

    live bytes
      ^        peak_bytes
      |        ______
      |   ____/      \\____        (storages created in the region and still alive)
      +--------------------------> ops
      enter                 exit

What existed before the region is the baseline and is not counted: an op's output that shares a
storage with one of its inputs (a view, an in-place op, ``out=``) creates nothing. Not seen: memory
a kernel allocates and frees inside one op (its scratch buffers) and storages made outside torch's
dispatcher (``torch.from_numpy``). The count is the same on every run of the same code.
``largest_bytes`` is the largest single storage created in the region (what one tensor ever held).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..compat import TorchDispatchMode, is_traceable_wrapper_subclass

MIB = 2**20


class LiveMemory(TorchDispatchMode):
    """Peak and current bytes of live tensor storage created inside the ``with`` block (see the
    module doc). ``peak_bytes`` / ``live_bytes`` / ``largest_bytes`` stay readable after the block;
    ``reset_peak()`` starts a new peak from the current count."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0  # the largest storage created in the region
        self._sizes: dict[int, int] = {}  # id of a live storage -> its bytes as counted
        self._refs: dict[int, weakref.ref] = {}  # the weak references whose callbacks uncount them
        self._lock = threading.RLock()  # a callback may run inside a locked section (GC) or on another thread

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in _tensors((*args, *kwargs.values()))}
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            storage = t.untyped_storage()
            self._count(storage, new=id(storage) not in inputs)
        return out

    def _count(self, storage: Any, new: bool) -> None:
        key = id(storage)  # stable while the storage lives: torch keeps one Python object per storage
        with self._lock:
            if key in self._sizes:  # seen before: only its size may have changed (resize_, out=)
                self._add(storage.nbytes() - self._sizes[key])
                self._sizes[key] = storage.nbytes()
                self.largest_bytes = max(self.largest_bytes, storage.nbytes())
            elif new:
                self._sizes[key] = storage.nbytes()
                self.largest_bytes = max(self.largest_bytes, storage.nbytes())
                self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._dead(key))
                self._add(storage.nbytes())

    def _dead(self, key: int) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self._add(-self._sizes.pop(key, 0))

    def _add(self, n: int) -> None:
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with self._lock:  # storages alive now are no longer followed (their weak references die here)
            self._refs.clear()
            self._sizes.clear()


def _tensors(values: tuple | list) -> Iterator[Tensor]:
    """The tensors with a storage of their own among ``values`` and inside their lists and tuples
    (aten's arguments and results nest one level: ``cat``'s inputs, a collective's buffers); for a
    wrapper subclass such as DTensor, the tensors it wraps (``__tensor_flatten__``): an op on DTensors
    reaches this mode once, as the DTensor op, and its local ops run with the mode off, so the local
    result is counted here, as the DTensor's. Faster than pytree, which matters: this runs for every op."""
    for x in values:
        if isinstance(x, Tensor):
            if is_traceable_wrapper_subclass(x):
                names, _ = x.__tensor_flatten__()
                yield from _tensors([getattr(x, n) for n in names])
            elif x.layout == torch.strided and x.device.type != "meta":
                yield x
        elif isinstance(x, (tuple, list)):
            yield from _tensors(x)
