"""Ranks must run the same graph: check before the first collective so a mismatch errors everywhere, never hangs.

Each step every rank contributes the hash of its guard key (batch shapes, modes, optimizer layout) to one small
all-gather; before a graph first runs, the hash of its code too. On a mismatch every rank learns it from the same
all-gather, exchanges a description, and raises `RankMismatchError` naming what differs on which rank.

The per-step check is issued as the step begins and awaited only just before the step's first collective
(`collectives.before_next_collective`): at stages 0-2 of a model without buffers that is in backward, so the check
overlaps forward; where the first collective opens forward (stage 3, buffers to broadcast) it overlaps little. A
rank whose key changed since its last step awaits it at once instead, before tracing or checking a new graph: then
every rank meets the others' description exchange from the same point, before any collective of the step.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from zerofx import collectives
from zerofx.errors import RankMismatchError


def control_device(group: dist.ProcessGroup | None = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify_same(value: int, what: str, describe: Callable[[], str], group: dist.ProcessGroup | None = None) -> None:
    agree(value, what, describe, group)()


def agree(value: int, what: str, describe: Callable[[], str],
          group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """Issue the all-gather of ``value`` now; the returned function awaits it and raises on a mismatch."""
    mine = torch.tensor([value], dtype=torch.int64, device=control_device(group))
    every, work = collectives.all_gather_control(mine, group, async_op=True)

    def settle() -> None:
        work.wait()
        values = every.flatten().tolist()
        if len(set(values)) == 1:
            return
        descriptions: list = [None] * len(values)
        dist.all_gather_object(descriptions, describe(), group=group)
        lines = [f"  rank {r}: {d}" for r, d in enumerate(descriptions)]
        raise RankMismatchError(f"ranks would run different graphs: {what} differs\n" + "\n".join(lines))

    return settle
