"""float16 loss scaling: a step whose gradients are not all finite changes nothing, on every rank."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.mixed_precision import FOUND_INF
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import wait_for
from zerofx.passes.graph_edit import INSERTED, add_call
from zerofx.step_graph import Role, is_mutating, storage_root, tag

aten = torch.ops.aten
_UPDATED = (Role.PARAM, Role.MASTER, Role.OPT_STATE)


def skip_nonfinite_update(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: a captured step with loss scaling (a node flagged ``FOUND_INF``: this rank's "some gradient is not
    finite"). A no-op otherwise.

    Guarantees: ranks agree on the flag (one scalar all-reduce, max), so every rank skips the same steps; every
    in-place write inside ``optimizer.step()`` into a parameter, master weight or optimizer state becomes
    ``copy_(x, where(found, x, op(x, ...)))``: the update is computed and then kept or discarded element by element,
    with one parameter's temporary at a time. The scale update (GradScaler's ``_amp_update_scale_``) reads the agreed
    flag, so the scale backs off on every rank.
    """
    graph = gm.graph
    local = next((n for n in graph.nodes if n.meta.get(FOUND_INF)), None)
    if local is None:
        return gm
    users = list(local.users)
    with graph.inserting_before(local.next):
        agreed = add_call(graph, collectives.all_reduce_scalar, (local, "max", ctx.group_name, ctx.world_size),
                          like=local, val=local.meta["val"])
        found = wait_for(graph, agreed, like=local)
        skip = add_call(graph, aten.ne.Scalar, (found, 0), like=local)
    for user in users:
        user.replace_input_with(local, found)
    for node in list(graph.nodes):
        if not (tag(node) and tag(node).in_optimizer_step and is_mutating(node)):
            continue
        root = storage_root(node)
        if root.op != "placeholder" or not any(tag(root).has(role) for role in _UPDATED):
            continue
        target = node.args[0]
        with graph.inserting_before(node):
            if node.target is aten.copy_.default:
                value = node.args[1]
            else:
                functional = getattr(getattr(aten, node.target.overloadpacket.__name__.rstrip("_")),
                                     node.target._overloadname)
                value = add_call(graph, functional, node.args, like=node, kwargs=dict(node.kwargs))
            kept = add_call(graph, aten.where.self, (skip, target, value), like=node)
            written = add_call(graph, aten.copy_.default, (target, kept), like=node)
        for update_op in (value, kept, written) if node.target is not aten.copy_.default else (kept, written):
            # the update's own arithmetic in another form: later passes check it and size it on shards as they
            # do the rest of the update, not as a pass's node whose metadata is final
            update_op.meta.pop(INSERTED, None)
        written.meta["zerofx"].slots = tag(node).slots
        node.replace_all_uses_with(written)
        graph.erase_node(node)
        for reader in list(written.users):
            # Python-number reads (Adam's step count) see the advanced value: a skipped step's discarded arithmetic
            # must not divide by a bias correction of zero
            if reader.target is aten._local_scalar_dense.default:
                reader.replace_input_with(written, value)
    gm.recompile()
    return gm
