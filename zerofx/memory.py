"""Bytes measured at run time, independent of the passes: a dispatch mode that follows live storages.

Every tensor an op reads or writes registers its storage; a storage counts until it is freed. ``peak_bytes`` is the
high-water mark of the sum over live storages, sampled after every op (so an op's inputs and outputs count together,
as they coexist). Tensors alive before the block count from the start when passed as ``roots``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from zerofx.step_graph import Phase, Role, tag


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


class StepProbe(fx.Interpreter):
    """Runs a step graph node by node under a `LiveStorageTracker`: the step's peak, and the bytes of gradient
    storage alive when backward ends (the last backward node, after the last reduce-scatter a stage issues there).

    Which storages hold gradients comes from the graph (nodes backward leaves as gradients, buffers a communication
    pass marks ``grad``); how many bytes they hold comes from the live storages themselves.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        backward = [n for n in gm.graph.nodes if n.op == "call_function" and tag(n) and tag(n).phase == Phase.BACKWARD]
        self._end_of_backward = backward[-1] if backward else None
        self._grad_storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.grad_bytes = 0
        self.peak_bytes = 0

    def run_step(self, inputs: list, roots=()):
        with LiveStorageTracker(roots) as tracker:
            out = self.run(*inputs)
        self.peak_bytes = tracker.peak_bytes
        return out

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        t = tag(n)
        if (t is not None and t.has(Role.GRAD)) or n.meta.get("zerofx_category") == "grad":
            for value in pytree.tree_leaves(result):
                if isinstance(value, torch.Tensor):
                    ref = StorageWeakRef(value.untyped_storage())
                    self._grad_storages[ref.cdata] = (ref, value.untyped_storage().nbytes())
        if n is self._end_of_backward:
            self.grad_bytes = sum(nbytes for ref, nbytes in self._grad_storages.values() if not ref.expired())
        return result


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[StorageWeakRef(t.untyped_storage()).cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())
