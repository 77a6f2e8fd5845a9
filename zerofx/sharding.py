"""How a parameter is split across N ranks: flattened, padded to a multiple of N, rank r owns the r-th chunk.

Why per parameter and flat rather than DeepSpeed's flat buckets or FSDP2's dim-0 rows: every rank's shard of a
parameter has the same shape, so the optimizer's per-parameter update runs unchanged on shards and the graph is
identical on every rank (SPMD); padding is at most N-1 elements per parameter; each shard is a 1-D ``Shard(0)``
piece of the flattened parameter, expressible as a DTensor for ``torch.distributed.checkpoint``. Buckets only group
parameters for communication: a bucket's all-gather and reduce-scatter move the concatenation of its shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerofx import optim_support


@dataclass(frozen=True)
class ParamLayout:
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    world_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def padded_flat(self, full: torch.Tensor) -> torch.Tensor:
        """A new flat tensor of ``padded_numel`` elements: ``full``'s values, then zeros."""
        return F.pad(full.detach().reshape(-1), (0, self.padded_numel - self.numel)).contiguous()

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of rank ``rank``'s chunk of ``full`` (a tensor of this parameter's shape)."""
        return self.padded_flat(full)[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone()

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[:self.numel].view(self.shape)

    def shards(self, state_key: str | None, shape: tuple[int, ...]) -> bool:
        """Whether optimizer state ``state_key`` of this shape is per element (sharded with the parameter) rather
        than per parameter. By shape, except the counters (Adam's step), which a 0-dim parameter's shape matches."""
        return tuple(shape) == self.shape and state_key not in optim_support.SCALAR_STATE


def gather_full(layout: ParamLayout, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard (a synchronous all-gather outside the graph, for state dicts)."""
    if layout.world_size == 1:
        return layout.unpad(shard).clone()
    out = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return layout.unpad(out).clone()
