"""DDP's default for buffers (BatchNorm running statistics): rank 0's values are broadcast before each forward."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.passes.flat_collectives import split_into_views
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import add_call, flattened
from zerofx.step_graph import Role, StepGraph

aten = torch.ops.aten


def broadcast_buffers(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: BUFFER placeholders. Guarantees: before any other node, every buffer is overwritten in place with
    rank 0's value, through one flat broadcast per dtype; nothing else changes."""
    buffers = list(StepGraph(gm).placeholders(Role.BUFFER).values())
    if ctx.world_size == 1 or not buffers:
        return gm
    graph = gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    by_dtype: dict[torch.dtype, list[fx.Node]] = {}
    for b in buffers:
        by_dtype.setdefault(b.meta["val"].dtype, []).append(b)
    for same_dtype in by_dtype.values():
        like = same_dtype[0]
        with graph.inserting_before(first_op):
            views = [flattened(graph, b, like=like) for b in same_dtype]
            flat = add_call(graph, aten.cat.default, (views,), like=like)
            sent = add_call(graph, collectives.broadcast, (flat, 0, ctx.group_name, ctx.world_size), like=like,
                            val=flat.meta["val"])
            pieces = split_into_views(graph, sent, same_dtype, like=like)
            for b, piece in zip(same_dtype, pieces):
                add_call(graph, aten.copy_.default, (b, piece), like=like)
    gm.recompile()
    return gm
