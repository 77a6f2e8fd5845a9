"""Stages 1-3: each rank receives the average, over ranks, of its shard of every gradient (bucketed)."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.errors import CaptureError, user_frame_from_stack_trace
from zerofx.mixed_precision import MASTER_GRAD
from zerofx.passes.bucketing import plan_buckets, plan_sharded
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import cast, categorize, reduce_scatter_bucket, wait_and_split
from zerofx.passes.graph_edit import SHARD, add_call, first_user_after
from zerofx.sharding import ParamLayout
from zerofx.step_graph import Phase, Role, StepGraph, is_mutating, storage_root

aten = torch.ops.aten


def reduce_scatter_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: ``ctx.artifacts["layouts"]`` from ``shard_optimizer_state``; GRAD-tagged gradient nodes per
    micro-batch (backward accumulating into ``.grad`` with ``add_`` from the second micro-batch on, or starting afresh
    after a ``zero_grad()`` between micro-batches, which drops the earlier ones' shards), computed as if
    ``.grad`` had been empty where ``split_incoming_grads`` names an incoming gradient to add.

    Guarantees: gradients are grouped, in the order backward produces them, at stages 2-3 into the model's units
    (as ``gather_params`` groups parameters), at stage 1 (or given ``bucket_bytes``) into buckets whose padded size is
    at most ``ctx.bucket_bytes`` (one parameter larger than that travels alone). Each bucket is packed rank-major,
    divided by
    N and reduce-scattered:
    - stage 1 (P_os): once, after the last backward, so full gradients live (and accumulate) until then, as the
      paper's stage 1 keeps them;
    - stages 2-3 (P_os+g): right after backward produced the bucket's last gradient, in every micro-batch: the
      micro-batch's contribution is reduce-scattered and added to this rank's accumulated shard, the full gradients
      die as soon as they are packed, and only shards live on.
    Gradients travel in ``ctx.reduce_dtype`` when it is set (cast just before packing); with several micro-batches
    their shards are summed in the dtype every reader of the final gradient converts it to, where that is wider
    (under mixed precision, the fp32 master gradient's), and those readers read the sum itself. At stages 2-3 a bucket's
    wait sits where the next bucket is issued (one reduce-scatter and its packed copy in flight); the last wait (and
    every wait at stage 1) sits just before the first reader; every later reader (clipping, the optimizer) reads
    this rank's accumulated shard, which starts from the shard an earlier call kept (a GRAD_IN placeholder) where
    there is one. A gradient nothing reads (a parameter no optimizer holds) is not reduced. Leaves
    ``ctx.artifacts["grad_buckets"]``.
    """
    sg = StepGraph(gm)
    micro = sg.num_microbatches()
    # what nothing reads (a parameter no optimizer holds, beside the others' update) needs no reduction
    unread = {f for f, g in sg.tagged(Role.GRAD, micro - 1).items() if not g.users}
    layouts = {f: layout for f, layout in ctx.artifacts["layouts"].items() if f not in unread}
    if not any(f in layouts for f in sg.tagged(Role.GRAD)):
        return gm  # no gradient to shard: a forward graph of torch.compile's
    rounds = range(micro) if ctx.stage >= 2 else [micro - 1]
    # a shard an earlier call kept is where this call's first reduced shard is added
    split = ctx.artifacts.get("incoming_grads", set())
    accumulated = {f: incoming for f, incoming in sg.placeholders(Role.GRAD_IN).items() if f in split and f in layouts}
    final = {f: g for f, g in sg.tagged(Role.GRAD, micro - 1).items() if f in layouts}
    summed_in = {f: _summed_in(g, sg.order) for f, g in final.items()} if len(rounds) > 1 else {}
    previous: dict[str, fx.Node] = {}  # fqn -> its gradient as the last round left it
    for mb in rounds:
        grads = {f: g for f, g in sg.tagged(Role.GRAD, mb).items() if f in layouts}
        parts, restart = {}, set()
        for f, g in grads.items():
            parts[f], dropped = _contribution(f, g, previous.get(f), ctx) if len(rounds) > 1 else (g, False)
            if dropped:
                restart.add(f)
        previous.update(grads)
        last_round = mb == micro - 1
        if last_round:
            where = None  # just before the first reader of the bucket's final gradients
        elif ctx.stage >= 2:
            where = sg.phase_span(Phase.BACKWARD, mb)[1].next
        shards = _reduce_scatter_round(gm.graph, sg, ctx, layouts, grads, parts, where)
        for f, shard in shards.items():
            if f in summed_in:
                with gm.graph.inserting_after(shard):
                    shard = categorize(cast(gm.graph, shard, summed_in[f], like=shard), "grad")
                    shard.meta[SHARD] = True
            if f in accumulated and f not in restart:
                with gm.graph.inserting_after(shard):
                    shard = add_call(gm.graph, aten.add.Tensor, (accumulated[f], shard), like=shard)
                    shard.meta[SHARD] = True
                categorize(shard, "grad")
            accumulated[f] = shard
    for f, g in final.items():
        for user in list(g.users):
            if sg.order.get(user, -1) > sg.order[g]:
                user.replace_input_with(g, accumulated[f])
                if f in summed_in and summed_in[f] != g.meta["val"].dtype:
                    _conversion_is_the_sum(gm.graph, user, accumulated[f])
    if ctx.stage >= 2:
        for mb in range(micro - 1, 0, -1):  # the full accumulations, now unread
            for f, g in sg.tagged(Role.GRAD, mb).items():
                if f in layouts and not g.users:
                    gm.graph.erase_node(g)
    gm.recompile()
    return gm


def _contribution(fqn: str, grad: fx.Node, previous: fx.Node | None, ctx: PassContext) -> tuple[fx.Node, bool]:
    """What a micro-batch's backward added to a gradient, and whether the gradients before it were dropped. Backward
    accumulates with ``add_(previous, contribution)``; after ``zero_grad()`` between micro-batches it starts afresh
    (set to None: a new gradient) or adds to the zeroed one (``add_(zero_(previous), contribution)``)."""
    if previous is None:
        return grad, False
    if grad.target is aten.add_.Tensor and grad.args[0] is previous:
        return grad.args[1], False
    if grad.target is aten.add_.Tensor and grad.args[0].target is aten.zero_.default and \
            storage_root(grad.args[0]) is storage_root(previous):
        return grad.args[1], True
    if not is_mutating(grad):
        return grad, True
    writer = grad.args[0] if grad.target is aten.add_.Tensor else grad
    raise CaptureError(
        f"the gradient of '{fqn}' is written in place between micro-batches ({writer.target}); at stage "
        f"{ctx.stage} each micro-batch's gradients are reduce-scattered as backward leaves them",
        source=user_frame_from_stack_trace(writer.meta.get("stack_trace")),
        hint="change gradients after the last backward (clipping, scaling the loss instead), or use stage 1")


def _conversion_is_the_sum(graph: fx.Graph, conversion: fx.Node, summed: fx.Node) -> None:
    """A conversion of the gradient to the dtype its shards were summed in copies the sum: its readers read the sum
    (nothing else does), which keeps its flags (an fp32 master gradient's)."""
    if MASTER_GRAD in conversion.meta:
        summed.meta[MASTER_GRAD] = conversion.meta[MASTER_GRAD]
    conversion.replace_all_uses_with(summed)
    graph.erase_node(conversion)


def _summed_in(grad: fx.Node, order: dict[fx.Node, int]) -> torch.dtype:
    """The dtype the micro-batches' reduced shards are summed in: the gradient's own, or the wider one every later
    reader converts it to (under mixed precision the fp32 master's, as FSDP2 sums each backward's reduced gradient
    into fp32 shards), so no sum is rounded to the low precision first."""
    own = grad.meta["val"].dtype
    readers = [u for u in grad.users if order.get(u, -1) > order[grad]]
    wider = {u.kwargs.get("dtype") for u in readers if u.target is aten._to_copy.default}
    if readers and len(wider) == 1 and len(readers) == sum(u.target is aten._to_copy.default for u in readers):
        dtype = wider.pop()
        if dtype is not None and dtype.is_floating_point and dtype.itemsize > own.itemsize:
            return dtype
    return own


def _reduce_scatter_round(graph: fx.Graph, sg: StepGraph, ctx: PassContext, layouts: dict[str, ParamLayout],
                          grads: dict[str, fx.Node], parts: dict[str, fx.Node],
                          wait_before: fx.Node | None) -> dict[str, fx.Node]:
    """Reduce-scatter ``parts`` bucket by bucket as ``grads`` become ready; fqn -> this rank's shard."""
    ready = sorted(grads, key=lambda f: sg.order[grads[f]])
    dtype_of = {f: ctx.reduce_dtype or layouts[f].dtype for f in ready}
    items = [(f, layouts[f].padded_numel, dtype_of[f]) for f in ready]
    buckets = plan_sharded(ctx, items) if ctx.stage >= 2 else plan_buckets(items, ctx.bucket_bytes)
    ctx.artifacts["grad_buckets"] = buckets
    end_of_backward = sg.phase_span(Phase.BACKWARD)[1]
    phase = Phase.BACKWARD if ctx.stage >= 2 else Phase.OPTIMIZER
    shards = {}
    anchors = [max((grads[f] for f in b.names), key=sg.order.__getitem__).next if ctx.stage >= 2
               else end_of_backward.next for b in buckets]
    for k, bucket in enumerate(buckets):
        nodes = [grads[f] for f in bucket.names]
        bucket_layouts = [layouts[f] for f in bucket.names]
        last = max(nodes, key=sg.order.__getitem__)
        with graph.inserting_before(anchors[k]):
            sent = [cast(graph, parts[f], dtype_of[f], like=last, phase=phase) for f in bucket.names]
            pending = reduce_scatter_bucket(graph, sent, bucket_layouts, ctx, like=last, phase=phase)
        reader = wait_before or first_user_after(nodes, last, sg.order)
        if ctx.stage >= 2 and k + 1 < len(buckets) and sg.order[anchors[k + 1]] < sg.order[reader]:
            reader = anchors[k + 1]  # one reduce-scatter in flight: its packed copy dies as the next is issued
        with graph.inserting_before(reader):
            pieces = wait_and_split(graph, pending, [l.shard_numel for l in bucket_layouts], like=reader,
                                    category="grad")
        for f, shard in zip(bucket.names, pieces):
            shard.meta[SHARD] = True
            shards[f] = shard
    return shards
