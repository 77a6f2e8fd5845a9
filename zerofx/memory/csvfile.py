"""Blocks and their offsets as CSV, in the format static-allocation tools share (MiniMalloc's among them).

A header line, then one block a row: ``id,lower,upper,size`` where [lower, upper) is the lifetime, and an
``offset`` column once the blocks are placed. Columns are found by name, so their order does not matter.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from zerofx.memory.planner import Block

_COLUMNS = ("id", "lower", "upper", "size")


def read_csv(path) -> tuple[list[Block], list[int] | None]:
    """The blocks of a CSV file, and their offsets when it has an ``offset`` column."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} (expected a header {','.join(_COLUMNS)})")
        rows = list(reader)
    blocks = [Block(int(r["size"]), int(r["lower"]), int(r["upper"]), r["id"]) for r in rows]
    has_offsets = "offset" in reader.fieldnames
    return blocks, [int(r["offset"]) for r in rows] if has_offsets else None


def write_csv(path, blocks: Sequence[Block], offsets: Sequence[int] | None = None) -> None:
    """Writes ``blocks`` (ids default to their positions), with an ``offset`` column when ``offsets`` are given."""
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_COLUMNS + (("offset",) if offsets is not None else ()))
        for i, b in enumerate(blocks):
            row = [i if b.id is None else b.id, b.start, b.end, b.size]
            writer.writerow(row + ([offsets[i]] if offsets is not None else []))
