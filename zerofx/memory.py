"""Bytes measured at run time, independent of the passes: a dispatch mode that follows live storages.

Every tensor an op reads or writes registers its storage; a storage counts until it is freed. ``peak_bytes`` is the
high-water mark of the sum over live storages, sampled after every op (so an op's inputs and outputs count together,
as they coexist). Tensors alive before the block count from the start when passed as ``roots``.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class LiveStorageTracker(TorchDispatchMode):
    def __init__(self, roots=()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        for t in pytree.tree_leaves(roots):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.start_bytes = self.peak_bytes = self.live_bytes

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata not in self._live:
            nbytes = storage.nbytes()
            self._live[ref.cdata] = (ref, nbytes)
            self.live_bytes += nbytes

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t)
        self._sweep()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def __exit__(self, *exc):
        self._sweep()
        return super().__exit__(*exc)
