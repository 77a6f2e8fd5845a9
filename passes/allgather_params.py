"""Stages 1-2: after the optimizer has updated this rank's shards, every rank gathers the full parameters it updated."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes.bucketing import plan_buckets
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import all_gather_bucket, gathered_rows
from zerofx.passes.graph_edit import add_call
from zerofx.step_graph import Phase, Role, StepGraph

aten = torch.ops.aten


def allgather_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: stage 1 or 2 after ``shard_optimizer_state`` (padded flat parameters, shards updated in place).

    Guarantees: parameters are grouped, in the order their updates finish, into buckets of at most
    ``ctx.bucket_bytes`` (gathered size). A bucket's all-gather is issued right after its last shard is updated, so it
    overlaps the rest of the update; its result is copied into the parameters just before the next bucket's
    all-gather is issued (the last one before the step returns), so at most two gathered buckets are alive at once.
    After the step every rank holds the same full parameters (one the graph did not update is gathered by no one:
    every rank holds it already). Leaves ``ctx.artifacts["param_buckets"]``.
    """
    graph = gm.graph
    sg = StepGraph(gm)
    layouts = ctx.artifacts["layouts"]
    params = sg.params()
    updated = {f: n for f, n in sg.updated_params().items() if f in layouts}
    done_order = sorted(updated, key=lambda f: sg.order[updated[f]])
    buckets = plan_buckets([(f, layouts[f].padded_numel, layouts[f].dtype) for f in done_order], ctx.bucket_bytes)
    output = sg.output
    pending_copy = None
    for bucket in buckets:
        last = max((updated[f] for f in bucket.names), key=sg.order.__getitem__)
        with graph.inserting_before(last.next):
            if pending_copy is not None:
                pending_copy()
            pending = all_gather_bucket(graph, [updated[f] for f in bucket.names], [layouts[f] for f in bucket.names],
                                        ctx, like=last)

        def copy_out(pending=pending, bucket=bucket, like=last):
            rows = gathered_rows(graph, pending, [layouts[f] for f in bucket.names], like=like)
            for f, row in zip(bucket.names, rows):
                layout = layouts[f]
                dst = add_call(graph, aten.view.default, (params[f], [layout.world_size, layout.shard_numel]),
                               like=like)
                add_call(graph, aten.copy_.default, (dst, row), like=like, phase=Phase.OPTIMIZER)

        pending_copy = copy_out
    if pending_copy is not None:
        with graph.inserting_before(output):
            pending_copy()
    ctx.artifacts["param_buckets"] = buckets
    gm.recompile()
    return gm
