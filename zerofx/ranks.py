"""Ranks must run the same graph: check before the first collective so a mismatch errors everywhere, never hangs.

Each step every rank contributes the hash of its guard key (batch shapes, modes, optimizer layout) to one small
all-gather; before a graph first runs, the hash of its code too. On a mismatch every rank learns it from the same
all-gather, exchanges a description, and raises `RankMismatchError` naming what differs on which rank.

The per-step check is issued as the step begins and awaited only just before the step's first collective
(`collectives.before_next_collective`): at stages 0-2 of a model without buffers that is in backward, so the check
overlaps forward; where the first collective opens forward (stage 3, buffers to broadcast) it overlaps little. A
rank whose key changed since its last step awaits it at once instead, before tracing or checking a new graph: then
every rank meets the others' description exchange from the same point, before any collective of the step.

At stage 0 the check can cost no collective of its own (``carry_rank_agreement``): once every rank has run the same
graph twice in a row, a rank whose step is unchanged only checks the element the graph's first bucket carries
(`check_carried_agreement`), and a rank whose step changed replays that graph's collectives up to the check with the
element set (`replay_carried`); then every rank takes part in the all-gather, and they raise unless all changed
alike.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from zerofx import collectives
from zerofx.errors import RankMismatchError

if TYPE_CHECKING:
    from zerofx.passes.carry_rank_agreement import CarriedAgreement


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
        _raise_mismatch(what, descriptions)

    return settle


def _raise_mismatch(what: str, descriptions: list[str]) -> None:
    """Each rank's description, less the lines every rank's has (a description of a whole step key has a line per
    part: what differs is then what is shown)."""
    common = set.intersection(*(set(d.splitlines()) for d in descriptions))
    own = ["\n    ".join(line for line in d.splitlines() if line not in common) for d in descriptions]
    lines = [f"  rank {r}: {d}" for r, d in enumerate(own if all(own) else descriptions)]
    raise RankMismatchError(f"ranks would run different graphs: {what} differs\n" + "\n".join(lines))


class _Expected(threading.local):
    carried: tuple[int, str, Callable[[], str]] | None = None  # this step's key hash, what it is, its description


_expected = _Expected()


def expect_carried(value: int, what: str, describe: Callable[[], str]) -> None:
    """This rank runs the graph that carries the agreement: what its check exchanges if another rank changed."""
    _expected.carried = (value, what, describe)


def check_carried_agreement(flag: torch.Tensor) -> None:
    """Called by the graph right after the wait of the bucket that carries ``flag``: zero unless a rank replayed
    the graph's collectives instead of running it, and then every rank meets that rank's all-gather and raises."""
    if isinstance(flag, torch._subclasses.FakeTensor) or flag.is_meta:
        return
    expected, _expected.carried = _expected.carried, None
    if flag.item() != 0:
        value, what, describe = expected or (0, "the step's inputs", lambda: "a graph run without expecting it")
        verify_same(value, what, describe)
        raise RankMismatchError(f"ranks would run different graphs: {what} differs (a rank replayed this one)")


def replay_carried(carried: "CarriedAgreement", value: int, what: str, describe: Callable[[], str]) -> None:
    """This rank's step changed while the others may run the graph that carries the agreement: issue that graph's
    collectives up to its check, zeros with the flag set, then the all-gather; returns only if every rank changed
    alike."""
    sent = []
    for i, call in enumerate(carried.all_reduces):
        zeros = torch.zeros(call.numel, dtype=call.dtype, device=carried.device)
        if i == 0:
            zeros[-1] = 1
        sent.append(collectives.all_reduce(zeros, call.op, call.group_name, call.group_size, int(i == 0)))
    for tensor in sent:
        collectives.wait(tensor)
    verify_same(value, what, describe)
