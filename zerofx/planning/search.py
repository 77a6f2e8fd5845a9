"""The largest model of a family that fits a device: a search over depth at the family's width, using the planner.

Every block of a decoder is alike, so the bytes a rank holds grow by the same amount per block: two plans of shallow
models give the line, the line gives the deepest model that fits, and (``confirm``) plans of that model and of one
block more check it, walking on while they disagree.
"""

from __future__ import annotations

from typing import Callable

from zerofx.planning.shapes import ModelShape

SHALLOW = (2, 4)  # depths the line is fitted through (the loss and embeddings make depth 1 unlike the rest)


def deepest(shape: ModelShape, needed: Callable[[ModelShape], int], budget: int, confirm: bool = False) -> int:
    """The most blocks ``shape`` may have with ``needed(shape)`` bytes at most ``budget``; 0 if not even one."""
    (d1, d2), (b1, b2) = SHALLOW, [needed(shape.with_depth(d)) for d in SHALLOW]
    per_block = (b2 - b1) / (d2 - d1)
    depth = max(0, int((budget - b1) // per_block) + d1) if per_block > 0 else 0
    if not confirm:
        return depth
    while depth > 0 and needed(shape.with_depth(depth)) > budget:
        depth -= 1
    while needed(shape.with_depth(depth + 1)) <= budget:
        depth += 1
    return depth
