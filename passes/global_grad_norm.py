"""Stages 1-3: a gradient norm taken outside the optimizer (``clip_grad_norm_``) becomes the global norm."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.mixed_precision import MASTER_GRAD
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import CATEGORY, wait_for
from zerofx.passes.graph_edit import add_call
from zerofx.step_graph import aliases_first_arg, tag

aten = torch.ops.aten
GLOBAL_NORM = "zerofx_global_norm"  # node.meta flag: a norm over shards that this pass made global


def global_grad_norm(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: gradients as this rank's shards (after ``reduce_scatter_grads``), or master gradients made from them;
    a norm over them taken as
    ``vector_norm(stack(per-gradient norms), p)``, which is how ``clip_grad_norm_`` and ``get_total_norm`` take it.

    Guarantees: the total norm of every such pattern is replaced by the norm over all ranks, with one scalar
    all-reduce (sum of p-th powers; max for p = inf). Padding is zero, so it changes no norm. Per-gradient norms are
    flagged as handled; ``propagate_shard_shapes`` refuses any other reduction over gradient shards.
    """
    graph = gm.graph
    for total in list(graph.nodes):
        if total.target is not aten.linalg_vector_norm.default or not _stacks_shard_norms(total):
            continue
        p = float(total.args[1]) if len(total.args) > 1 else 2.0
        users = list(total.users)
        with graph.inserting_before(total.next):
            if p == float("inf"):
                reduced = add_call(graph, collectives.all_reduce_scalar, (total, "max", ctx.group_name,
                                                                          ctx.world_size), like=total,
                                   val=total.meta["val"])
                norm = wait_for(graph, reduced, like=total)
            else:
                powered = add_call(graph, aten.pow.Tensor_Scalar, (total, p), like=total)
                reduced = add_call(graph, collectives.all_reduce_scalar, (powered, "sum", ctx.group_name,
                                                                          ctx.world_size), like=total,
                                   val=powered.meta["val"])
                summed = wait_for(graph, reduced, like=total)
                norm = add_call(graph, aten.pow.Tensor_Scalar, (summed, 1.0 / p), like=total)
        for user in users:
            user.replace_input_with(total, norm)
        total.meta[GLOBAL_NORM] = True
    gm.recompile()
    return gm


def _stacks_shard_norms(total: fx.Node) -> bool:
    stacked = total.args[0]
    if not isinstance(stacked, fx.Node) or stacked.target is not aten.stack.default:
        return False
    norms = [n for n in stacked.args[0] if isinstance(n, fx.Node)]
    parts = [_norm_input(n) for n in norms]
    if not norms or not all(part is not None and _is_grad_shard(part) for part in parts):
        return False
    for n in norms:
        n.meta[GLOBAL_NORM] = True
    return True


def _norm_input(node: fx.Node) -> fx.Node | None:
    """What a per-gradient norm reads: ``vector_norm(g)`` or ``_foreach_norm([...])[i]``, through dtype casts."""
    while node.target in (aten._to_copy.default, aten.detach.default):
        node = node.args[0]
    if node.target is aten.linalg_vector_norm.default:
        return node.args[0]
    if node.target is operator.getitem and node.args[0].target is aten._foreach_norm.Scalar:
        node.args[0].meta[GLOBAL_NORM] = True
        return node.args[0].args[0][node.args[1]]
    return None


def _is_grad_shard(node: fx.Node) -> bool:
    """A gradient shard, or the fp32 master gradient made from one (cast and unscaled elementwise: zero where the
    shard's padding is zero)."""
    while aliases_first_arg(node) and not _is_gradient(node):
        node = node.args[0]
    return _is_gradient(node) and tag(node) is not None


def _is_gradient(node: fx.Node) -> bool:
    return node.meta.get(CATEGORY) == "grad" or bool(node.meta.get(MASTER_GRAD))
