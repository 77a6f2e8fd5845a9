"""Stage 3 (P_os+g+p): gather each parameter bucket just before forward uses it, and again before backward does."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes.bucketing import Bucket, plan_buckets
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import all_gather_bucket, categorize, gathered_rows
from zerofx.passes.graph_edit import add_call
from zerofx.sharding import ParamLayout
from zerofx.step_graph import Phase, StepGraph, aliases_first_arg, tag

aten = torch.ops.aten

# Ops that only re-present a parameter (transposes, views, dtype casts): backward recomputes them from the
# re-gathered parameter instead of keeping forward's copy alive, which would undo resharding.
_PARAM_ONLY_OPS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
                   aten._unsafe_view.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                   aten.reshape.default, aten._to_copy.default, aten.detach.default, aten.clone.default}


def gather_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: stage 3 after ``shard_optimizer_state`` (parameter placeholders are this rank's shards; forward and
    backward still read them as if full).

    Guarantees: parameters are grouped by first use in forward into buckets of at most ``ctx.bucket_bytes`` (gathered
    size). Each micro-batch gathers for itself. Before forward's first use of bucket i its all-gather is waited on and each parameter copied out of the
    gathered buffer, which then dies; the all-gather itself is issued ``ctx.prefetch`` buckets earlier (just before
    the first use of bucket i - prefetch), so at most prefetch + 1 gathered buckets are in flight. Every forward reader
    reads the gathered copy, which dies after its last forward use. With ``ctx.reshard_after_forward`` (default)
    backward gathers again the same way, in backward's order of first use, and recomputes the views forward took of a
    parameter (``t(w)``) from the new copy; without it backward reads forward's copies, kept alive between the two.
    The optimizer keeps updating the shard. Leaves ``ctx.artifacts["gather_buckets"]``.
    """
    graph = gm.graph
    sg = StepGraph(gm)
    layouts: dict[str, ParamLayout] = ctx.artifacts["layouts"]
    shards = {f: n for f, n in sg.params().items() if f in layouts}
    derived = {f: sorted(_param_only_closure(p), key=sg.order.__getitem__) for f, p in shards.items()}

    all_forward = {f: _uses(sg, [p], Phase.FORWARD) for f, p in shards.items()}  # before any node is added
    all_backward = {f: _uses(sg, [p, *derived[f]], Phase.BACKWARD) for f, p in shards.items()}
    used = sorted((f for f in shards if all_forward[f]), key=lambda f: sg.order[all_forward[f][0]])
    buckets = plan_buckets([(f, layouts[f].padded_numel, layouts[f].dtype) for f in used], ctx.bucket_bytes)
    for mb in range(sg.num_microbatches()):  # each micro-batch gathers for itself, as the paper's 3M counts
        forward_uses = {f: [u for u in all_forward[f] if tag(u).microbatch == mb] for f in shards}
        backward_uses = {f: [u for u in all_backward[f] if tag(u).microbatch == mb] for f in shards}
        present = [b for b in buckets if any(forward_uses[f] for f in b.names)]
        forward_anchors = [min((forward_uses[f][0] for f in b.names if forward_uses[f]), key=sg.order.__getitem__)
                           for b in present]
        forward_copies = _insert_gathers(graph, ctx, layouts, shards, present, forward_anchors, Phase.FORWARD)
        for f, full in forward_copies.items():
            for user in forward_uses[f]:
                user.replace_input_with(shards[f], full)
        if ctx.reshard_after_forward:
            anchors = _backward_anchors(sg, present, backward_uses, mb)
            order = sorted(range(len(present)), key=lambda i: sg.order[anchors[i]])
            backward_copies = _insert_gathers(graph, ctx, layouts, shards, [present[i] for i in order],
                                              [anchors[i] for i in order], Phase.BACKWARD)
            for f, full in backward_copies.items():
                _rewire_backward(graph, (shards[f], forward_copies[f]), full, derived[f], backward_uses[f])
        else:
            for f, full in forward_copies.items():
                for user in backward_uses[f]:
                    user.replace_input_with(shards[f], full)
    ctx.artifacts["gather_buckets"] = buckets
    gm.recompile()
    return gm


def _backward_anchors(sg: StepGraph, buckets: list[Bucket], uses: dict[str, list[fx.Node]],
                      microbatch: int) -> list[fx.Node]:
    """Where backward needs each bucket: its first backward use. As in the paper, every bucket is gathered again,
    also one whose parameters backward never reads (biases): it goes with the bucket forward used before it."""
    end = sg.phase_span(Phase.BACKWARD, microbatch)[1]
    anchors: list[fx.Node] = []
    for b in buckets:
        firsts = [uses[f][0] for f in b.names if uses[f]]
        anchors.append(min(firsts, key=sg.order.__getitem__) if firsts else None)
    for i, anchor in enumerate(anchors):
        if anchor is None:
            earlier = [a for a in anchors[:i] if a is not None]
            anchors[i] = earlier[-1] if earlier else end
    return anchors


def _param_only_closure(param: fx.Node) -> list[fx.Node]:
    """Forward nodes computed from ``param`` alone through view-like ops, in graph order."""
    closure, frontier = [], [param]
    members = {param}
    while frontier:
        for user in frontier.pop().users:
            if user in members or tag(user).phase != Phase.FORWARD:
                continue
            inputs = [a for a in user.all_input_nodes]
            if (user.target in _PARAM_ONLY_OPS or aliases_first_arg(user)) and all(a in members for a in inputs):
                members.add(user)
                closure.append(user)
                frontier.append(user)
    return closure


def _uses(sg: StepGraph, sources: list[fx.Node], phase: Phase) -> list[fx.Node]:
    source_set = set(sources)
    users = {u for s in sources for u in s.users if u not in source_set and tag(u).phase == phase}
    return sorted(users, key=sg.order.__getitem__)


def _insert_gathers(graph: fx.Graph, ctx: PassContext, layouts: dict[str, ParamLayout], shards: dict[str, fx.Node],
                    buckets: list[Bucket], anchors: list[fx.Node], phase: Phase) -> dict[str, fx.Node]:
    """All-gather ``buckets`` (in the order given) before their ``anchors``, each issued ``ctx.prefetch`` buckets
    ahead; returns fqn -> full-parameter node."""
    issued: dict[int, fx.Node] = {}
    fulls: dict[str, fx.Node] = {}
    for i, bucket in enumerate(buckets):
        with graph.inserting_before(anchors[i]):
            for j in range(i, min(i + ctx.prefetch + 1, len(buckets))):
                if j not in issued:
                    names = buckets[j].names
                    issued[j] = all_gather_bucket(graph, [shards[f] for f in names], [layouts[f] for f in names],
                                                  ctx, like=anchors[i], phase=phase)
            fulls.update(_copy_out(graph, issued[i], bucket, layouts, anchors[i], phase))
    return fulls


def _copy_out(graph: fx.Graph, pending: fx.Node, bucket: Bucket, layouts: dict[str, ParamLayout], like: fx.Node,
              phase: Phase) -> dict[str, fx.Node]:
    """Each parameter of the bucket as its own full tensor; the gathered buffer is dead after this."""
    bucket_layouts = [layouts[f] for f in bucket.names]
    rows = gathered_rows(graph, pending, bucket_layouts, like, phase)
    fulls = {}
    for f, row, layout in zip(bucket.names, rows, bucket_layouts):
        dense = categorize(add_call(graph, aten.clone.default, (row,), like=like, phase=phase,
                                    kwargs={"memory_format": torch.contiguous_format}), "gathered_param")
        flat = add_call(graph, aten.view.default, (dense, [-1]), like=like, phase=phase)
        if layout.padded_numel > layout.numel:
            flat = add_call(graph, aten.slice.Tensor, (flat, 0, 0, layout.numel), like=like, phase=phase)
        fulls[f] = add_call(graph, aten.view.default, (flat, list(layout.shape)), like=like, phase=phase)
    return fulls


def _rewire_backward(graph: fx.Graph, sources: tuple[fx.Node, ...], full: fx.Node, derived: list[fx.Node],
                     uses: list[fx.Node]) -> None:
    """Backward readers of the parameter (``sources``: its shard and forward's gathered copy) or of a view forward
    took of it read ``full`` and fresh views of it, recomputed right after ``full``."""
    derived_set = set(derived)
    needed = {a for u in uses for a in u.all_input_nodes if a in derived_set}
    stack = list(needed)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in derived_set and a not in needed:
                needed.add(a)
                stack.append(a)
    remap = {s: full for s in sources}
    with graph.inserting_before(full.next):
        for d in derived:  # graph order: inputs are copied before their users
            if d in needed:
                remap[d] = graph.node_copy(d, lambda n: remap.get(n, n))
                remap[d].meta = {**d.meta, "zerofx": type(tag(d))(Phase.BACKWARD, tag(full).microbatch)}
    for user in uses:
        for old, new in remap.items():
            if old in user.all_input_nodes:
                user.replace_input_with(old, new)
