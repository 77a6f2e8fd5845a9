"""A world of any number of ranks inside one process, from torch.distributed's fake process group.

Every collective on the fake group returns at once without moving data, so a step can be captured, passed through
ZeRO's passes and run on meta tensors as rank 0 of ``world_size`` ranks would. The group lives in a private torch
module (``torch.testing._internal.distributed.fake_pg``); this is the only place that imports it.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zerofx.mesh import DATA_PARALLEL, TENSOR_PARALLEL


@contextlib.contextmanager
def fake_world(world_size: int, tp: int = 1):
    """Within the block this process is rank 0 of ``world_size`` fake ranks; yields the ("dp", "tp") mesh when
    ``tp`` > 1 (``world_size / tp`` data-parallel ranks), else None."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"tp must be a positive int dividing world_size={world_size}, got {tp!r}")
    if dist.is_initialized():
        raise RuntimeError("zerofx.plan runs its own fake world of ranks: call it in a process without a process "
                           "group (before init_process_group or after destroy_process_group)")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield _mesh(world_size, tp)
    finally:
        dist.destroy_process_group()


def _mesh(world_size: int, tp: int) -> DeviceMesh | None:
    if tp == 1:
        return None
    # the device type only picks the backend the fake group stands in for; no tensor is placed by it
    return init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
