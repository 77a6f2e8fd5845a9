"""Stage 3 (P_os+g+p): gather each parameter bucket just before forward uses it, and again before backward does."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.errors import CaptureError
from zerofx.passes.bucketing import Bucket, plan_sharded
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import all_gather_params, gathered_params
from zerofx.passes.graph_edit import add_call
from zerofx.sharding import ParamLayout
from zerofx.step_graph import Phase, StepGraph, aliases_first_arg, tag

aten = torch.ops.aten

# Ops that only re-present a parameter (transposes, views, dtype casts): backward recomputes them from the
# re-gathered parameter instead of keeping forward's copy alive, which would undo resharding.
PARAM_ONLY_OPS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
                  aten._unsafe_view.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                  aten.reshape.default, aten._to_copy.default, aten.detach.default, aten.clone.default}


def gather_params(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: stage 3 after ``shard_optimizer_state`` (parameter placeholders are this rank's shards; forward and
    backward still read them as if full).

    Guarantees: parameters are grouped by first use in forward into the model's units (``ctx.units``, capped at
    ``ctx.unit_cap_bytes``) or, given ``bucket_bytes``, into buckets of at most that (gathered size). Each micro-batch
    gathers for itself. A bucket's all-gather gives each parameter a buffer of its own, which forward reads in place
    (a view: nothing is copied out) and which dies after the parameter's last forward use; it is issued
    ``ctx.prefetch`` buckets ahead (just before the first use of bucket i - prefetch) and waited on just before the
    bucket's first use, so gathered bytes alive are those of at most prefetch + 1 buckets, less what already died.
    A parameter read again after other buckets were gathered (a tied embedding and head) stays gathered until then if
    it is no larger than the largest other unit, and is gathered again otherwise. With ``ctx.reshard_after_forward``
    (default) backward gathers again the same way, in backward's order of first use and only what backward reads
    (not biases), and recomputes the views
    forward took of a parameter (``t(w)``) from the new copy; without it backward reads forward's copies, kept alive
    between the two. The optimizer keeps updating the shard. Leaves ``ctx.artifacts["gather_buckets"]`` (the units)
    ``ctx.artifacts["gathers"]`` (phase, bucket) for each all-gather issued in the first micro-batch and
    ``ctx.artifacts["kept_gathered"]``, the parameters kept gathered for a later read.
    """
    graph = gm.graph
    sg = StepGraph(gm)
    layouts: dict[str, ParamLayout] = ctx.artifacts["layouts"]
    shards = {f: n for f, n in sg.params().items() if f in layouts}
    derived = {f: sorted(_param_only_closure(p), key=sg.order.__getitem__) for f, p in shards.items()}

    all_forward = {f: _uses(sg, [p], Phase.FORWARD) for f, p in shards.items()}  # before any node is added
    all_backward = {f: _uses(sg, [p, *derived[f]], Phase.BACKWARD) for f, p in shards.items()}
    used = sorted((f for f in shards if all_forward[f]), key=lambda f: sg.order[all_forward[f][0]])
    # a backward graph compiled apart from its forward (torch.compile's) gathers by the units its forward planned
    buckets = ctx.artifacts.get("gather_buckets") or \
        plan_sharded(ctx, [(f, layouts[f].padded_numel, layouts[f].dtype) for f in used])
    gathers: list[tuple[Phase, Bucket]] = []
    kept: set[str] = set()
    for mb in range(sg.num_microbatches()):  # each micro-batch gathers for itself, as the paper's 3M counts
        forward_uses = {f: [u for u in all_forward[f] if tag(u).microbatch == mb] for f in shards}
        backward_uses = {f: [u for u in all_backward[f] if tag(u).microbatch == mb] for f in shards}
        forward = _segments(sg, buckets, forward_uses, kept)
        forward_copies = _insert_gathers(graph, ctx, layouts, shards, forward, Phase.FORWARD)
        for (_, _, uses), copies in zip(forward, forward_copies):
            for f, full in copies.items():
                for user in uses[f]:
                    user.replace_input_with(shards[f], full)
        sources = {f: (shards[f], *(c[f] for c in forward_copies if f in c)) for f in shards}
        if ctx.reshard_after_forward:
            backward = _segments(sg, buckets, backward_uses, kept)
            backward_copies = _insert_gathers(graph, ctx, layouts, shards, backward, Phase.BACKWARD)
            for (_, _, uses), copies in zip(backward, backward_copies):
                for f, full in copies.items():
                    _rewire_backward(graph, sources[f], full, derived[f], uses[f])
        else:
            for f in shards:
                last_copy = next((c[f] for c in reversed(forward_copies) if f in c), None)
                if backward_uses[f] and last_copy is None:
                    raise CaptureError(f"parameter '{f}' is read in backward but not in forward; with "
                                       "reshard_after_forward=False backward reads only forward's copies",
                                       hint="use reshard_after_forward=True")
                for user in backward_uses[f]:
                    user.replace_input_with(shards[f], last_copy)
        if mb == 0:
            gathers = [(Phase.FORWARD, b) for b, _, _ in forward]
            gathers += [(Phase.BACKWARD, b) for b, _, _ in backward] if ctx.reshard_after_forward else []
    ctx.artifacts["gather_buckets"] = buckets
    ctx.artifacts["gathers"] = gathers
    ctx.artifacts["kept_gathered"] = sorted(kept)
    gm.recompile()
    return gm


_Segment = tuple  # (bucket, anchor, fqn -> the uses it serves)


def _segments(sg: StepGraph, buckets: list[Bucket], uses: dict[str, list[fx.Node]],
              kept: set[str]) -> list[_Segment]:
    """Where each bucket is gathered, in order: before its first use, for its parameters this phase reads (backward
    does not read biases, nor an embedding's weight). A parameter read again after another bucket's first use (a tied
    embedding and head) stays gathered until then if it is no larger than the largest other unit, so gathered bytes
    stay within the units in flight plus one such parameter; a larger one is gathered again there (its elements cost
    traffic again, its bytes are not held across the buckets between). Several parameters may be kept so, each no
    larger than a unit (a model ties one, the embedding and the head). Parameters of a bucket first read only after
    another bucket's first use are split off and gathered there. Adds the parameters kept gathered to ``kept``."""
    order = sg.order.__getitem__
    sizes = sorted((b.nbytes for b in buckets), reverse=True) + [0, 0]
    bytes_of = {f: n * b.dtype.itemsize for b in buckets for f, n in zip(b.names, b.numels)}
    # the largest bucket besides the parameter's own: what a kept parameter must not outgrow
    largest = {f: sizes[1] if b.nbytes == sizes[0] else sizes[0] for b in buckets for f in b.names}
    pending = [(b, {f: uses[f] for f in b.names if uses.get(f)}) for b in buckets]
    segments: list[_Segment] = []
    while pending := [(b, u) for b, u in pending if u]:
        pending.sort(key=lambda bu: min(order(xs[0]) for xs in bu[1].values()))
        bucket, bucket_uses = pending.pop(0)
        anchor = min((xs[0] for xs in bucket_uses.values()), key=order)
        # where the next bucket is first read; a node that reads this bucket and another (a bias here, its weight
        # there) is this bucket's to serve
        end = min((order(xs[0]) for _, u in pending for xs in u.values() if order(xs[0]) > order(anchor)),
                  default=len(sg.order))
        now = {f: [x for x in xs if order(x) < end or (order(xs[0]) < end and bytes_of[f] <= largest[f])]
               for f, xs in bucket_uses.items()}
        later = {f: [x for x in xs if x not in now[f]] for f, xs in bucket_uses.items()}
        kept.update(f for f, xs in now.items() if xs and order(xs[-1]) >= end)
        segments.append((_subset(bucket, now, bucket.reason), anchor, {f: xs for f, xs in now.items() if xs}))
        again = {f: xs for f, xs in later.items() if xs and now[f]}  # gathered now and needed again later
        first = {f: xs for f, xs in later.items() if xs and not now[f]}  # only read later: split off, not repeated
        pending += [(_subset(bucket, again, "read again later"), again), (_subset(bucket, first, bucket.reason), first)]
    return segments


def _subset(bucket: Bucket, uses: dict[str, list[fx.Node]], reason: str) -> Bucket:
    kept = [(f, n) for f, n in zip(bucket.names, bucket.numels) if uses.get(f)]
    return Bucket(bucket.dtype, [f for f, _ in kept], [n for _, n in kept], bucket.unit, reason)


def _param_only_closure(param: fx.Node) -> list[fx.Node]:
    """Forward nodes computed from ``param`` alone through view-like ops, in graph order."""
    closure, frontier = [], [param]
    members = {param}
    while frontier:
        for user in frontier.pop().users:
            if user in members or tag(user).phase != Phase.FORWARD:
                continue
            inputs = [a for a in user.all_input_nodes]
            if (user.target in PARAM_ONLY_OPS or aliases_first_arg(user)) and all(a in members for a in inputs):
                members.add(user)
                closure.append(user)
                frontier.append(user)
    return closure


def _uses(sg: StepGraph, sources: list[fx.Node], phase: Phase) -> list[fx.Node]:
    source_set = set(sources)
    users = {u for s in sources for u in s.users if u not in source_set and tag(u).phase == phase}
    return sorted(users, key=sg.order.__getitem__)


def _insert_gathers(graph: fx.Graph, ctx: PassContext, layouts: dict[str, ParamLayout], shards: dict[str, fx.Node],
                    segments: list[_Segment], phase: Phase) -> list[dict[str, fx.Node]]:
    """All-gather each segment's bucket (in the order given) before its anchor, issued ``ctx.prefetch`` segments
    ahead; per segment, fqn -> full-parameter node, a view of that parameter's own gathered buffer."""
    issued: dict[int, fx.Node] = {}
    copies: list[dict[str, fx.Node]] = []
    for i, (bucket, anchor, _) in enumerate(segments):
        with graph.inserting_before(anchor):
            for j in range(i, min(i + ctx.prefetch + 1, len(segments))):
                if j not in issued:
                    names = segments[j][0].names
                    issued[j] = all_gather_params(graph, [shards[f] for f in names], [layouts[f] for f in names],
                                                  ctx, like=anchor, phase=phase)
            views = gathered_params(graph, issued[i], [layouts[f] for f in bucket.names], anchor, phase)
        copies.append(dict(zip(bucket.names, views)))
    return copies


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
