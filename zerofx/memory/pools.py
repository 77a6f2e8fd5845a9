"""A step's buffers in one arena, laid out two ways: one joint plan over all of them, or one pool per class
(activations, gradients, communication buffers, ...) side by side, in which no two classes ever share bytes. The
smaller arena is kept; both sizes are reported. This module is the one place that chooses, and that makes a slot's
tensor out of the arena's bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofx.memory.planner import HEURISTICS, plan

JOINT = "joint"
BY_CLASS = "pools by class"


@dataclass(frozen=True)
class Placement:
    layout: str  # JOINT or BY_CLASS
    offsets: tuple[int, ...]  # per buffer, in the order given
    arena_bytes: int
    lower_bound_bytes: int  # the most bytes alive at once (aligned): no layout needs less
    arena_bytes_by_layout: dict[str, int]  # JOINT and BY_CLASS
    pools: dict[str, tuple[int, int]]  # with BY_CLASS: class -> (offset, bytes) of its pool; else empty


def slot_alignment(device: torch.device) -> int:
    """Where a slot may start: where the device's allocator starts every block, so an op sees its output aligned as
    in the unplanned step. On CPU, c10's 64 bytes (a cache line; any dtype's alignment). On an accelerator, the
    caching allocator's 512-byte blocks: its libraries choose kernels by their operands' alignment (cuBLASLt's
    heuristics by up to 256 bytes)."""
    return 64 if device.type == "cpu" else 512


def place(spans: list, alignment: int = 64, layout: str | None = None) -> Placement:
    """Offsets for ``spans`` (`zerofx.memory.lifetimes.Lifetime`), jointly or pooled by ``category``: the smaller
    arena (the joint one on a tie), or the ``layout`` named. Deterministic: the heuristics only, no time-limited
    search."""
    if layout not in (None, JOINT, BY_CLASS):
        raise ValueError(f"layout must be None, {JOINT!r} or {BY_CLASS!r}, got {layout!r}")
    joint = plan([s.block() for s in spans], alignment=alignment, heuristics=HEURISTICS)
    offsets, pools, base = [0] * len(spans), {}, 0
    for category in sorted({s.category for s in spans}):
        members = [i for i, s in enumerate(spans) if s.category == category]
        pool = plan([spans[i].block() for i in members], alignment=alignment, heuristics=HEURISTICS)
        for i, offset in zip(members, pool.offsets):
            offsets[i] = base + offset
        pools[category] = (base, pool.arena_bytes)
        base += pool.arena_bytes  # a multiple of the alignment: sizes are rounded up to it
    sizes = {JOINT: joint.arena_bytes, BY_CLASS: base}
    if layout == BY_CLASS or layout is None and base < joint.arena_bytes:
        return Placement(BY_CLASS, tuple(offsets), base, joint.lower_bound_bytes, sizes, pools)
    return Placement(JOINT, joint.offsets, joint.arena_bytes, joint.lower_bound_bytes, sizes, {})


def slot_views(raw: torch.Tensor, slots) -> list[torch.Tensor]:
    """The contiguous tensors ``(byte offset, dtype, shape)`` of ``slots`` in the ``uint8`` buffer ``raw``, whose
    size and offsets are multiples of every dtype's size (the alignment's). One view of ``raw`` a dtype, then one
    strided view a slot: on a graph's fake tensors, three views a slot took a tenth of a planned build."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for offset, dtype, shape in slots:
        if dtype not in typed:
            typed[dtype] = raw.view(dtype)
        start = (raw.storage_offset() + offset) // dtype.itemsize  # as_strided counts from the storage's start
        views.append(typed[dtype].as_strided(shape, _contiguous_strides(shape), start))
    return views


def slot_place(slot: torch.Tensor) -> tuple[int, torch.dtype, torch.Size]:
    """Where `slot_views` put ``slot`` (a fake one in the graph, say), to make it again in other bytes: its byte
    offset in its storage (the arena's, which starts at the storage's start), dtype and shape."""
    return slot.storage_offset() * slot.element_size(), slot.dtype, slot.shape


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
