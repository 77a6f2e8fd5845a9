"""Group tensors into flat buckets of at most ``bucket_bytes`` (C_B: the buffer size does not grow with the model)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    dtype: torch.dtype
    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(items: list[tuple[str, int, torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Greedy in the given order (the order tensors become ready): a bucket closes when the next tensor would push
    it past ``bucket_bytes``. A tensor larger than the limit gets a bucket of its own. One dtype per bucket."""
    buckets: list[Bucket] = []
    open_by_dtype: dict[torch.dtype, Bucket] = {}
    for name, numel, dtype in items:
        bucket = open_by_dtype.get(dtype)
        if bucket is not None and bucket.numels and (bucket.numel + numel) * dtype.itemsize > bucket_bytes:
            bucket = None
        if bucket is None:
            bucket = Bucket(dtype)
            buckets.append(bucket)
            open_by_dtype[dtype] = bucket
        bucket.names.append(name)
        bucket.numels.append(numel)
    return buckets
