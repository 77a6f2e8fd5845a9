"""Stages 1-3: each rank receives the average, over ranks, of its shard of every gradient (bucketed)."""

from __future__ import annotations

import torch.fx as fx

from zerofx.passes.bucketing import plan_buckets
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import reduce_scatter_bucket, wait_and_split
from zerofx.passes.graph_edit import SHARD
from zerofx.passes.graph_edit import first_user_after
from zerofx.step_graph import Phase, Role, StepGraph


def reduce_scatter_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: ``ctx.artifacts["layouts"]`` from ``shard_optimizer_state``; GRAD-tagged gradient nodes.

    Guarantees: gradients are grouped, in the order backward produces them, into buckets whose padded size is at most
    ``ctx.bucket_bytes`` (one parameter larger than that travels alone). Each bucket is packed rank-major, divided by
    N and reduce-scattered:
    - stage 1 (P_os): after backward has ended, so full gradients live until then, as the paper's stage 1 keeps them;
    - stages 2-3 (P_os+g): right after backward produced the bucket's last gradient; the full gradients die as soon as
      they are packed, and only shards live on.
    The wait sits just before the first reader; every later reader (the optimizer) reads this rank's shard.
    Leaves ``ctx.artifacts["grad_buckets"]``.
    """
    graph = gm.graph
    sg = StepGraph(gm)
    layouts = ctx.artifacts["layouts"]
    grads = {f: g for f, g in sg.tagged(Role.GRAD, sg.num_microbatches() - 1).items() if f in layouts}
    ready = sorted(grads, key=lambda f: sg.order[grads[f]])
    buckets = plan_buckets([(f, layouts[f].padded_numel, layouts[f].dtype) for f in ready], ctx.bucket_bytes)
    end_of_backward = sg.phase_span(Phase.BACKWARD)[1]
    after_backward = end_of_backward.next
    for bucket in buckets:
        nodes = [grads[f] for f in bucket.names]
        bucket_layouts = [layouts[f] for f in bucket.names]
        last = max(nodes, key=sg.order.__getitem__)
        anchor = last.next if ctx.stage >= 2 else after_backward
        reader = first_user_after(nodes, last, sg.order)
        phase = Phase.BACKWARD if ctx.stage >= 2 else Phase.OPTIMIZER
        with graph.inserting_before(anchor):
            pending = reduce_scatter_bucket(graph, nodes, bucket_layouts, ctx, like=last, phase=phase)
        with graph.inserting_before(reader):
            shards = wait_and_split(graph, pending, [l.shard_numel for l in bucket_layouts], like=reader,
                                    category="grad")
        for g, shard in zip(nodes, shards):
            shard.meta[SHARD] = True
            for user in list(g.users):
                if sg.order.get(user, -1) > sg.order[last]:
                    user.replace_input_with(g, shard)
    ctx.artifacts["grad_buckets"] = buckets
    gm.recompile()
    return gm

