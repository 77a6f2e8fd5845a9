"""Stage 0, plain data parallelism: average gradients across ranks in flat buckets as backward produces them."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.passes.bucketing import plan_buckets
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import cast, categorize, split_into_views
from zerofx.passes.graph_edit import add_call, first_user_after, flattened
from zerofx.step_graph import Role, StepGraph

aten = torch.ops.aten


def bucket_allreduce(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: a captured step whose gradient nodes carry the GRAD tag (the last micro-batch's are reduced).

    Guarantees: gradients are grouped, in the order backward produces them, into buckets of at most
    ``ctx.bucket_bytes``. Right after a bucket's last gradient is produced, its gradients are copied into one flat
    buffer and all-reduced (averaged) asynchronously; the wait sits just before the first later reader of any of
    them; every later reader (clipping, the optimizer, the ``.grad`` left after the step) reads the averaged values
    as views into that buffer, in ``ctx.reduce_dtype`` when it is set. The update equals DistributedDataParallel's.
    Leaves ``ctx.artifacts["grad_buckets"]``.
    """
    if ctx.world_size == 1:
        return gm
    graph = gm.graph
    sg = StepGraph(gm)
    grads = sg.tagged(Role.GRAD, sg.num_microbatches() - 1)
    ready = sorted(grads, key=lambda fqn: sg.order[grads[fqn]])
    dtype_of = {f: ctx.reduce_dtype or grads[f].meta["val"].dtype for f in ready}
    buckets = plan_buckets([(f, grads[f].meta["val"].numel(), dtype_of[f]) for f in ready], ctx.bucket_bytes)
    for bucket in buckets:
        nodes = [grads[f] for f in bucket.names]
        last = max(nodes, key=sg.order.__getitem__)
        reader = first_user_after(nodes, last, sg.order)
        with graph.inserting_before(last.next):  # nodes land in the order they are added
            flat_views = [cast(graph, flattened(graph, g, like=last), bucket.dtype, last)
                          for g in nodes]
            flat = add_call(graph, aten.cat.default, (flat_views,), like=last)
            reduced = categorize(add_call(graph, collectives.all_reduce,
                                          (flat, "avg", ctx.group_name, ctx.world_size),
                                          like=last, val=flat.meta["val"]), "grad")
        with graph.inserting_before(reader if reader is not None else reduced.next):
            views = split_into_views(graph, reduced, nodes, like=reader or reduced, category="grad")
        for g, view in zip(nodes, views):
            for user in list(g.users):
                if user not in flat_views and sg.order.get(user, -1) > sg.order[last]:
                    user.replace_input_with(g, view)
    ctx.artifacts["grad_buckets"] = buckets
    gm.recompile()
    return gm

