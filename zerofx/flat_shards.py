"""A rank's flat shard of a parameter as checkpoint chunks of the parameter's own shape.

zerofx's shard of a parameter is a contiguous range of its flattened elements (``sharding.ParamLayout``). In the
row-major parameter that range is a union of at most ``2 * ndim - 1`` rectangular boxes: a partial first row, whole
rows, a partial last row, recursively. Each box is a view of the flat shard, so a ``ShardedTensor`` made of them
lets ``torch.distributed.checkpoint`` write and read the shard in place, under the parameter's fully qualified name
and full shape. A checkpoint therefore does not depend on the world size, the stage or the padding: DCP reshards
between zerofx's boxes and any other layout of the same shapes, FSDP2's row shards and plain tensors included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from zerofx.sharding import ParamLayout


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int  # where the box's first element sits in the flattened tensor

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """The rectangular boxes, in order, whose union is elements ``[start, stop)`` of a row-major ``shape``."""
    if start >= stop:
        return []
    if not shape:
        return [Box((), (), 0)]
    row = math.prod(shape[1:])
    out: list[Box] = []
    if start % row:  # a partial first row
        first = start // row
        end = min(stop, (first + 1) * row)
        out += [Box((first, *b.offsets), (1, *b.sizes), first * row + b.flat_start)
                for b in boxes(start - first * row, end - first * row, shape[1:])]
        start = end
    whole = (stop - start) // row
    if whole:
        out.append(Box((start // row, *(0,) * (len(shape) - 1)), (whole, *shape[1:]), start))
        start += whole * row
    if start < stop:  # a partial last row
        last = start // row
        out += [Box((last, *b.offsets), (1, *b.sizes), last * row + b.flat_start)
                for b in boxes(0, stop - last * row, shape[1:])]
    return out


def rank_boxes(layout: ParamLayout, rank: int) -> list[Box]:
    """The boxes of rank ``rank``'s shard; the padding past the parameter's end belongs to none."""
    start = rank * layout.shard_numel
    return boxes(start, min(start + layout.shard_numel, layout.numel), layout.shape)


def every_rank_holds(layout: ParamLayout) -> bool:
    """Whether the last rank's shard holds any element: DCP skips a ShardedTensor without local shards on a rank,
    and the key then counts as missing there."""
    return (layout.world_size - 1) * layout.shard_numel < layout.numel


def sharded_view(layout: ParamLayout, shard: torch.Tensor, rank: int) -> ShardedTensor:
    """``shard`` (this rank's flat shard of ``layout``) as a ShardedTensor of the full shape; its local shards are
    views of ``shard``, so loading into it writes the shard in place."""
    device = shard.device
    metadata = []
    for r in range(layout.world_size):
        for box in rank_boxes(layout, r):
            metadata.append(ShardMetadata(list(box.offsets), list(box.sizes), f"rank:{r}/{device}"))
    local = [Shard(_box_view(shard, box, rank * layout.shard_numel), md)
             for box, md in zip(rank_boxes(layout, rank), _metadata_of(metadata, rank))]
    global_md = ShardedTensorMetadata(metadata, torch.Size(layout.shape), TensorProperties(dtype=shard.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_md, dist.group.WORLD)


def _box_view(shard: torch.Tensor, box: Box, shard_start: int) -> torch.Tensor:
    begin = box.flat_start - shard_start
    return shard[begin:begin + box.numel].view(box.sizes)


def _metadata_of(metadata: list[ShardMetadata], rank: int) -> list[ShardMetadata]:
    return [md for md in metadata if md.placement.rank() == rank]

