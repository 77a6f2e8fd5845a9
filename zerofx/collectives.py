"""Every collective zerofx issues goes through this module, which records it.

Graph passes insert calls to the functions here; they run PyTorch's functional collectives
(``torch.ops._c10d_functional``), so they are asynchronous until ``wait``, work with gloo and NCCL alike, and are
seen by ``CommDebugMode``. A record holds the kind, the elements of the full buffer, the dtype and the group size;
``purpose`` separates the step's data traffic from small control exchanges (rank agreement, flags).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

_c10d = torch.ops._c10d_functional
_resolve_process_group = torch._C._distributed_c10d._resolve_process_group
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str  # "all_reduce", "all_gather", "reduce_scatter", "broadcast"
    numel: int  # elements of the full buffer (the gathered or the reduced one)
    dtype: torch.dtype
    group_size: int
    purpose: str = "data"  # "data" (parameters, gradients), "scalar" (norms, flags), "buffers" or "control"
    carried: int = 0  # of numel, the last elements: the rank agreement riding along (control, not ``purpose``)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class _Recording(threading.local):
    records: list[CollectiveRecord] | None = None
    before_next: Callable[[], None] | None = None  # awaited just before the next collective is issued


_recording = _Recording()


def before_next_collective(callback: Callable[[], None] | None) -> None:
    """Run ``callback`` just before the next collective issued here (rank agreement), once."""
    _recording.before_next = callback


def settle_pending() -> None:
    """Run a callback no collective has run yet (a step that issued none)."""
    callback, _recording.before_next = _recording.before_next, None
    if callback is not None:
        callback()


@contextlib.contextmanager
def recording():
    """Collect the records of every collective issued inside the block."""
    previous, records = _recording.records, []
    _recording.records = records
    try:
        yield records
    finally:
        _recording.records = previous


def _record(kind: str, tensor: torch.Tensor, numel: int, group_size: int, purpose: str = "data",
            carried: int = 0) -> None:
    if purpose != "control" and not isinstance(tensor, torch._subclasses.FakeTensor):
        settle_pending()
    if _recording.records is not None and not isinstance(tensor, torch._subclasses.FakeTensor):
        _recording.records.append(CollectiveRecord(kind, numel, tensor.dtype, group_size, purpose, carried))


def group_name(group: dist.ProcessGroup | None = None) -> str:
    """The name the functional collectives resolve a process group by (the default group when None)."""
    return (group or dist.group.WORLD).group_name


def all_reduce(tensor: torch.Tensor, op: str, group: str, group_size: int, carried: int = 0) -> torch.Tensor:
    """In place and asynchronous: returns ``tensor`` itself; `wait` on it before reading it. ``op="avg"`` divides
    ``tensor`` first, as DDP's default hook does, so the sum over ranks is the mean. On one rank every collective
    here is the identity. The last ``carried`` elements are not data but the rank agreement riding along
    (``carry_rank_agreement``); the record says so.

    The functional all-reduce would copy its input first (a second copy of a bucket its caller packed already);
    the in-place functional one is not seen by ``CommDebugMode``. So this issues c10d's own all-reduce, which is,
    and registers its work for ``wait_tensor`` as the functional collectives do."""
    if group_size == 1:
        return tensor
    _record("all_reduce", tensor, tensor.numel(), group_size, carried=carried)
    reduce_op = _REDUCE_OPS[_average_first(tensor, op, group_size)]
    work = dist.all_reduce(tensor, reduce_op, group=_resolve_process_group(group), async_op=True)
    if not tensor.is_meta:  # a plan's: wait_tensor's meta kernel would leave it registered
        torch._C._distributed_c10d._register_work(tensor, work)
    return tensor


def all_reduce_scalar(tensor: torch.Tensor, op: str, group: str, group_size: int) -> torch.Tensor:
    """A few elements (a norm, an overflow flag): asynchronous like `all_reduce`, listed apart from the formula's."""
    if group_size == 1:
        return tensor
    _record("all_reduce", tensor, tensor.numel(), group_size, purpose="scalar")
    return _c10d.all_reduce(tensor, op, group)


def broadcast(tensor: torch.Tensor, src: int, group: str, group_size: int) -> torch.Tensor:
    """Asynchronous: `wait` on the result before reading it. Recorded as buffer traffic, apart from the
    parameter and gradient traffic the paper's formulas count."""
    _record("broadcast", tensor, tensor.numel(), group_size, purpose="buffers")
    return _c10d.broadcast(tensor, src, group)


def all_gather(tensor: torch.Tensor, group: str, group_size: int, purpose: str = "data") -> torch.Tensor:
    """Asynchronous: the result holds every rank's ``tensor``, rank-major (``group_size * numel`` elements).
    ``purpose`` files it in the records ("data": model states; "activations": P_a's checkpoints)."""
    if group_size == 1:
        return tensor
    _record("all_gather", tensor, tensor.numel() * group_size, group_size, purpose)
    return _c10d.all_gather_into_tensor(tensor, group_size, group)


def all_gather_coalesced(tensors: list[torch.Tensor], group: str, group_size: int) -> list[torch.Tensor]:
    """Asynchronous, one collective: output i holds every rank's ``tensors[i]``, rank-major, in a buffer of its own,
    so each can be viewed in place and freed on its own (no packing into one buffer, no copying out)."""
    if group_size == 1:
        return list(tensors)
    _record("all_gather", tensors[0], sum(t.numel() for t in tensors) * group_size, group_size)
    return list(_c10d.all_gather_into_tensor_coalesced(tensors, group_size, group))


def reduce_scatter(tensor: torch.Tensor, op: str, group: str, group_size: int) -> torch.Tensor:
    """Asynchronous: rank r receives the reduction of every rank's r-th chunk. ``op="avg"`` divides ``tensor`` (in
    place) first, as `all_reduce` does."""
    if group_size == 1:
        return tensor
    _record("reduce_scatter", tensor, tensor.numel(), group_size)
    return _c10d.reduce_scatter_tensor(tensor, _average_first(tensor, op, group_size), group_size, group)


# on a group of one rank these return their input itself (a list of them for the coalesced all-gather)
IDENTITY_ON_ONE_RANK = (all_reduce, all_reduce_scalar, all_gather, all_gather_coalesced, reduce_scatter)


def _average_first(tensor: torch.Tensor, op: str, group_size: int) -> str:
    """"avg" as DDP does it: divide in place, then sum."""
    if op == "avg":
        tensor.div_(group_size)
        return "sum"
    return op


def wait(tensor: torch.Tensor, sent=None) -> torch.Tensor:
    """The collective's result, complete. ``sent`` is the collective's input (a tensor or a list of them): the graph
    passes it here so the buffer stays referenced until the collective is done with it, whatever the backend keeps
    alive itself."""
    return _c10d.wait_tensor(tensor) if dist.is_initialized() else tensor


def all_gather_control(value: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Gather one small tensor from every rank (rank agreement, flags): synchronously, or with ``async_op`` the
    result and the work to wait on before reading it."""
    size = dist.get_world_size(group)
    out = torch.empty(size * value.numel(), dtype=value.dtype, device=value.device)
    _record("all_gather", value, out.numel(), size, purpose="control")
    work = dist.all_gather_single(out, value.reshape(-1), group=group, async_op=async_op)
    out = out.view(size, *value.shape)
    return (out, work) if async_op else out


def broadcast_control(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Synchronous in-place broadcast outside the graph (initial state sync)."""
    _record("broadcast", tensor, tensor.numel(), dist.get_world_size(group), purpose="control")
    dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group else src, group=group)


COLLECTIVES = (all_reduce, all_reduce_scalar, broadcast, all_gather, all_gather_coalesced, reduce_scatter)


def gloo_one_worker() -> str:
    """A backend name for ``dist.init_process_group``: gloo with one worker thread instead of torch's two.

    On torch 2.13, each gloo worker thread, after finishing a collective, records it in the group's status
    (``ProcessGroupGloo::runLoop``: ``pgStatus_->lastCompletedWorkName = opTypeToString(...)``) without holding a
    lock. Two collectives finishing at once on the two workers race on that string; for the functional all-gather
    (``ALLGATHER_COALESCED``, a name too long for the string's inline buffer) both threads free the same buffer, and the
    heap is corrupted (``malloc(): unaligned tcache chunk detected``, SIGSEGV). One worker runs the collectives one at a
    time in the order they were issued, which every rank issues alike; they stay asynchronous to the caller."""
    name = "gloo_one_worker"
    if name not in dist.Backend.backend_list:

        def create(store, rank, size, timeout):
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
            options._threads = 1
            return dist.ProcessGroupGloo(store, rank, size, options)

        dist.Backend.register_backend(name, create, devices=["cpu"])
    return name
