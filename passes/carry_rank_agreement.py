"""Stage 0: the per-step rank agreement rides on the first gradient bucket's all-reduce, one element more.

Ranks must run the same graph (`zerofx.ranks`). Once every rank has run the same graph twice in a row, a rank whose
step is unchanged needs no exchange of its own: it is enough to learn that no other rank changed. So the first
bucket carries one more element, a zero read from the graph's ``rank_agreement_flag``; after its wait, the graph
checks that the element's sum is still zero. A rank whose step did change does not run this graph: it replays the
collectives this graph issues up to that check (their shapes, zeros, the flag set), and the ranks exchange what they
run. Every rank's collectives stay matched, so a mismatch raises on every rank and never hangs.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from zerofx import collectives, ranks
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import add_call, fake_mode_of
from zerofx.step_graph import TAG, NodeTag

aten = torch.ops.aten
FLAG = "rank_agreement_flag"


@dataclass(frozen=True)
class ReplayedAllReduce:
    """One all-reduce the graph issues before its check, as a rank whose step changed issues it instead."""
    numel: int
    dtype: torch.dtype
    op: str
    group_name: str
    group_size: int


@dataclass(frozen=True)
class CarriedAgreement:
    all_reduces: tuple[ReplayedAllReduce, ...]  # the first carries the flag in its last element
    device: torch.device


def carry_rank_agreement(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: stage 0's graph in its final order (after ``schedule_collectives``), buckets packed by ``aten.cat``
    into `collectives.all_reduce` and unpacked by ``split_with_sizes`` of its wait.

    Guarantees: with ``ctx.carry_agreement``, when the step's first collective is such an all-reduce, its bucket
    ends with one more element, the ``rank_agreement_flag`` buffer's zero; that element has a piece of its own in the split, and
    `zerofx.ranks.check_carried_agreement` reads it right after the split, before anything reads the gradients.
    Leaves ``ctx.artifacts["carried_agreement"]`` (the all-reduces issued before the check, to replay). Otherwise
    (off, one rank, a first collective of another kind, a collective other than an all-reduce before the check) the
    graph is unchanged and there is no artifact."""
    graph = gm.graph
    issued = [n for n in graph.nodes if n.op == "call_function" and n.target in collectives.COLLECTIVES]
    if not ctx.carry_agreement or ctx.world_size == 1 or not issued or not _carries(issued[0]):
        return gm
    carrier = issued[0]
    split = _split_of(carrier)
    order = {n: i for i, n in enumerate(graph.nodes)}
    before_check = [n for n in issued if order[n] < order[split]]
    if any(n.target is not collectives.all_reduce for n in before_check):
        return gm  # a rank whose step changed replays all-reduces only
    flat = carrier.args[0]
    flag = _flag(gm, flat)
    flat.update_arg(0, [*flat.args[0], flag])
    carrier.args = (*carrier.args, 1)  # carried: the last element is not data
    with fake_mode_of(graph):
        grown = torch.empty(flat.meta["val"].numel() + 1, dtype=flat.meta["val"].dtype,
                            device=flat.meta["val"].device)
    wait = split.args[0]
    for node in (flat, carrier, wait):
        node.meta["val"] = grown
    sizes = [*split.args[1], 1]
    split.update_arg(1, sizes)
    split.meta["val"] = tuple(grown.split(sizes))
    with graph.inserting_after(split):
        piece = add_call(graph, operator.getitem, (split, len(sizes) - 1), like=split, val=split.meta["val"][-1])
    with graph.inserting_after(piece):
        add_call(graph, ranks.check_carried_agreement, (piece,), like=split)  # val: None
    ctx.artifacts["carried_agreement"] = CarriedAgreement(
        tuple(ReplayedAllReduce(n.meta["val"].numel(), n.meta["val"].dtype, *n.args[1:4]) for n in before_check),
        grown.device)
    graph.lint()
    gm.recompile()
    return gm


def _carries(node: fx.Node) -> bool:
    """A bucket all-reduce packed by cat and unpacked by a split: the one layout this pass extends."""
    flat = node.args[0]
    if node.target is not collectives.all_reduce or not isinstance(flat, fx.Node) \
            or flat.target is not aten.cat.default or len(flat.args) != 1:
        return False
    split = _split_of(node)
    return split is not None and set(flat.users) == {node, split.args[0]}  # read by the wait alone, to keep it


def _split_of(carrier: fx.Node) -> fx.Node | None:
    waits = [u for u in carrier.users if u.target is collectives.wait]
    splits = [u for w in waits for u in w.users if u.target is aten.split_with_sizes.default]
    return splits[0] if len(waits) == 1 and len(splits) == 1 and len(waits[0].users) == 1 else None


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One per dtype and device, whatever the number of graphs: nothing writes to it."""
    return torch.zeros(1, dtype=dtype, device=device)


def _flag(gm: fx.GraphModule, flat: fx.Node) -> fx.Node:
    val = flat.meta["val"]
    gm.register_buffer(FLAG, _zero(val.dtype, val.device), persistent=False)
    with gm.graph.inserting_before(flat):
        node = gm.graph.get_attr(FLAG)
    with fake_mode_of(gm.graph):
        node.meta["val"] = torch.empty(1, dtype=val.dtype, device=val.device)
    source: NodeTag = flat.meta[TAG]
    node.meta[TAG] = NodeTag(source.phase, source.microbatch, [], source.in_optimizer_step)
    return node
