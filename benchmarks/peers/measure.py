"""What every system is measured with, alike: one `LiveStorageTracker` for bytes, `CommDebugMode` for collectives.

Model-state bytes are the storages a step touched that are still alive once the step, its batch and its loss are
gone: parameters, gradients, master weights, optimizer state and whatever buffers the system keeps between steps.
The peak is the tracker's high-water mark over the next step, starting from that state. Communication volume is
the ring accounting of `zerofx.stats.ring_volume` over the collectives `CommDebugMode` sees, whichever library
issued them.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from zerofx import CollectiveRecord, LiveStorageTracker
from zerofx.stats import ring_volume

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional


def _numel(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


def _group_size(group) -> int:
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    return dist.ProcessGroup.unbox(group).size()


# op -> (kind, elements of the full buffer from the op's arguments, group size from the op's arguments)
_SIZES = {
    _c10d.allreduce_: ("all_reduce", lambda a: _numel(a[0]), lambda a: _group_size(a[1])),
    _c10d.allreduce_coalesced_: ("all_reduce", lambda a: _numel(a[0]), lambda a: _group_size(a[1])),
    _c10d.broadcast_: ("broadcast", lambda a: _numel(a[0]), lambda a: _group_size(a[1])),
    _c10d._allgather_base_: ("all_gather", lambda a: _numel(a[0]), lambda a: _group_size(a[2])),
    _c10d.allgather_: ("all_gather", lambda a: _numel(a[0]), lambda a: _group_size(a[2])),
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", lambda a: _numel(a[0]), lambda a: _group_size(a[2])),
    _c10d._reduce_scatter_base_: ("reduce_scatter", lambda a: _numel(a[1]), lambda a: _group_size(a[2])),
    _c10d.reduce_scatter_: ("reduce_scatter", lambda a: _numel(a[1]), lambda a: _group_size(a[2])),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", lambda a: _numel(a[1]), lambda a: _group_size(a[2])),
    _funcol.all_reduce: ("all_reduce", lambda a: _numel(a[0]), lambda a: _group_size(a[2])),
    _funcol.broadcast: ("broadcast", lambda a: _numel(a[0]), lambda a: _group_size(a[2])),
    _funcol.all_gather_into_tensor: ("all_gather", lambda a: _numel(a[0]) * a[1], lambda a: a[1]),
    _funcol.all_gather_into_tensor_coalesced: ("all_gather", lambda a: _numel(a[0]) * a[1], lambda a: a[1]),
    _funcol.reduce_scatter_tensor: ("reduce_scatter", lambda a: _numel(a[0]), lambda a: a[2]),
}


class CollectiveSizes(CommDebugMode):
    """`CommDebugMode`, which counts the collectives, also noting each one's full buffer and group size."""

    def __init__(self):
        super().__init__()
        self.records: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and func._overloadpacket in _SIZES:
            kind, numel, group_size = _SIZES[func._overloadpacket]
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            while isinstance(first, (list, tuple)):
                first = first[0]
            self.records.append(CollectiveRecord(kind, numel(args), first.dtype, group_size(args)))
        return out

    def count(self) -> int:
        return self.get_total_counts()


@dataclass
class Measured:
    model_state_bytes: int
    peak_bytes: int
    collectives: int
    comm_elements: float  # ring accounting, elements this rank sends per step
    comm_bytes: float


def measure(step, batch, index: int) -> Measured:
    """Steps ``index`` and ``index + 1`` under one tracker: the first registers what the system keeps between
    steps, the second is measured. Batches are made before the tracker starts, so the data they are cut from is
    not counted, and the first one is dropped before the bytes kept are read."""
    first, second = batch(index), batch(index + 1)
    with LiveStorageTracker() as tracker:
        step(*first).item()
        del first
        gc.collect()
        model_state = sum(tracker.live_by_storage().values())
        tracker.peak_bytes = tracker.live_bytes
        with CollectiveSizes() as comm:
            step(*second).item()
    as_bytes = [CollectiveRecord(r.kind, r.nbytes, torch.uint8, r.group_size) for r in comm.records]
    if comm.count() != len(comm.records):
        raise RuntimeError(f"{comm.count() - len(comm.records)} collective(s) of a kind not sized here: "
                           f"{dict(comm.get_comm_counts())}")
    return Measured(model_state, tracker.peak_bytes, comm.count(), ring_volume(comm.records), ring_volume(as_bytes))


def time_steps(step, batch, indices) -> tuple[list[float], float]:
    """Seconds per step, each step's loss read back so that the step is complete on this rank; the last loss."""
    times, loss = [], float("nan")
    for i in indices:
        x, y = batch(i)
        start = time.perf_counter()
        loss = step(x, y).item()
        times.append(time.perf_counter() - start)
    return times, loss
