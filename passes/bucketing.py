"""Group tensors into communication buckets of constant size (C_B: a bucket does not grow with the model).

Two planners: ``plan_buckets`` fills buckets of at most ``bucket_bytes`` in the given order (DDP's way; a user's
``bucket_bytes=`` selects it everywhere); ``plan_units`` follows the model's units (`zerofx.units`: one repeated
block each), merges small neighbours outside every unit into them, and splits at ``cap_bytes``. Each bucket says
what it holds and why it was cut there, for ``stats()`` and the dumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerofx.passes.context import PassContext


@dataclass
class Bucket:
    dtype: torch.dtype
    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    unit: str | None = None  # the module path of the unit it follows, if any
    reason: str = "bucket_bytes"  # why cut there: "unit", "between units", "cap", "bucket_bytes", "read again later"

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


def plan_units(items: list[tuple[str, int, torch.dtype]], unit_of: dict[str, str], cap_bytes: int) -> list[Bucket]:
    """Consecutive tensors (in the given order) of one unit form a bucket; so do consecutive tensors outside every
    unit. A bucket closes at ``cap_bytes`` (one tensor larger than that travels alone). A bucket outside every unit
    that is smaller than a quarter of a neighbour joins it (norms and biases between blocks), the earlier one first,
    while the result stays within the cap."""
    buckets: list[Bucket] = []
    for name, numel, dtype in items:
        unit = unit_of.get(name)
        last = buckets[-1] if buckets else None
        same = last is not None and last.unit == unit and last.dtype == dtype
        if same and (last.numel + numel) * dtype.itemsize <= cap_bytes:
            last.names.append(name)
            last.numels.append(numel)
            continue
        reason = "cap" if same else ("unit" if unit is not None else "between units")
        buckets.append(Bucket(dtype, [name], [numel], unit, reason))
    return _merge_small_neighbours(buckets, cap_bytes)


def _merge_small_neighbours(buckets: list[Bucket], cap_bytes: int) -> list[Bucket]:
    merged: list[Bucket] = []
    pending: Bucket | None = None  # a small bucket waiting for the next one
    for b in buckets:
        if pending is not None:
            if _absorbs(b, pending, cap_bytes):
                b = Bucket(b.dtype, pending.names + b.names, pending.numels + b.numels, b.unit, b.reason)
            else:
                merged.append(pending)
            pending = None
        if b.unit is None and merged and _absorbs(merged[-1], b, cap_bytes):
            merged[-1].names += b.names
            merged[-1].numels += b.numels
        elif b.unit is None and b.nbytes * 4 < cap_bytes:
            pending = b
        else:
            merged.append(b)
    if pending is not None:
        merged.append(pending)
    return merged


def _absorbs(host: Bucket, small: Bucket, cap_bytes: int) -> bool:
    return host.unit is not None and host.dtype == small.dtype and small.nbytes * 4 <= host.nbytes \
        and host.nbytes + small.nbytes <= cap_bytes


def plan_sharded(ctx: PassContext, items: list[tuple[str, int, torch.dtype]]) -> list[Bucket]:
    """Buckets for the collectives that shard (stage 3's gathers, stages 2-3's reduce-scatters): the model's units,
    unless the user gave ``bucket_bytes``."""
    if ctx.units is None:
        return plan_buckets(items, ctx.bucket_bytes)
    return plan_units(items, ctx.units, ctx.unit_cap_bytes)
