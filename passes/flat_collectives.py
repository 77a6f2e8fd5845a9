"""Graph builders shared by the communication passes: pack tensors into one flat bucket, issue a collective, and
unpack its result. All ops are ATen ops or `zerofx.collectives` calls, so dumps read as ordinary code.

Rank-major layout: a bucket of sharded parameters p_1..p_k (shard sizes s_1..s_k, S = sum s_i) is the [N, S] matrix
whose row r holds rank r's chunks of p_1..p_k side by side. A reduce-scatter of it leaves rank r its row; an
all-gather of rows rebuilds it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import add_call, fake_mode_of, flattened
from zerofx.sharding import ParamLayout
from zerofx.step_graph import Phase

aten = torch.ops.aten

# node.meta key: what a buffer holds ("grad", "gathered_param", "comm_buffer": a packed copy sent), for memory reports
CATEGORY = "zerofx_category"


def categorize(node: fx.Node, category: str) -> fx.Node:
    node.meta[CATEGORY] = category
    return node


def cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, like: fx.Node, phase: Phase | None = None) -> fx.Node:
    """``node`` in ``dtype`` (a new node only if the dtype differs): gradients reduced in ``reduce_dtype``."""
    if node.meta["val"].dtype == dtype:
        return node
    return add_call(graph, aten._to_copy.default, (node,), like=like, phase=phase, kwargs={"dtype": dtype})


def wait_for(graph: fx.Graph, pending: fx.Node, like: fx.Node, phase: Phase | None = None) -> fx.Node:
    """The wait node of the collective ``pending``; it also takes the collective's input, so that buffer stays
    alive until the collective has completed."""
    return add_call(graph, collectives.wait, (pending, pending.args[0]), like=like, phase=phase,
                    val=pending.meta["val"])


def wait_and_split(graph: fx.Graph, pending: fx.Node, sizes: list[int], like: fx.Node,
                   category: str | None = None) -> list[fx.Node]:
    """Wait for the collective on ``pending``; cut its flat result into pieces of ``sizes`` elements."""
    done = wait_for(graph, pending, like)
    pieces = add_call(graph, aten.split_with_sizes.default, (done, sizes), like=like)
    out = [add_call(graph, operator.getitem, (pieces, i), like=like) for i in range(len(sizes))]
    if category:
        for n in (done, *out):
            categorize(n, category)
    return out


def split_into_views(graph: fx.Graph, pending: fx.Node, like_nodes: list[fx.Node], like: fx.Node,
                     category: str | None = None) -> list[fx.Node]:
    """Wait for the collective on ``pending`` and cut the flat result into views shaped like ``like_nodes``."""
    pieces = wait_and_split(graph, pending, [n.meta["val"].numel() for n in like_nodes], like, category)
    views = [add_call(graph, aten.view.default, (p, list(n.meta["val"].shape)), like=like)
             for p, n in zip(pieces, like_nodes)]
    if category:
        for v in views:
            categorize(v, category)
    return views


def pack_rank_major(graph: fx.Graph, fulls: list[fx.Node], layouts: list[ParamLayout], like: fx.Node,
                    phase: Phase | None = None) -> fx.Node:
    """A new [N * S] flat buffer, rank-major, from full-shaped tensors (gradients) padded per parameter."""
    rows = []
    for full, layout in zip(fulls, layouts):
        flat = flattened(graph, full, like=like, phase=phase)
        if layout.padded_numel > layout.numel:
            flat = add_call(graph, aten.constant_pad_nd.default, (flat, [0, layout.padded_numel - layout.numel]),
                            like=like, phase=phase)
        rows.append(add_call(graph, aten.view.default, (flat, [layout.world_size, layout.shard_numel]), like=like,
                             phase=phase))
    # cat copies; a lone row is cloned so the collective never divides the gradient itself in place
    packed = add_call(graph, aten.cat.default, (rows, 1), like=like, phase=phase) if len(rows) > 1 else \
        add_call(graph, aten.clone.default, (rows[0],), like=like, phase=phase)
    categorize(packed, "comm_buffer")
    return add_call(graph, aten.view.default, (packed, [-1]), like=like, phase=phase)


def reduce_scatter_bucket(graph: fx.Graph, fulls: list[fx.Node], layouts: list[ParamLayout], ctx: PassContext,
                          like: fx.Node, phase: Phase | None = None) -> fx.Node:
    packed = pack_rank_major(graph, fulls, layouts, like, phase)
    shard_val = packed.meta["val"].new_empty(sum(l.shard_numel for l in layouts))
    node = add_call(graph, collectives.reduce_scatter, (packed, "avg", ctx.group_name, ctx.world_size), like=like,
                    phase=phase, val=shard_val)
    return categorize(node, "grad")


def all_gather_bucket(graph: fx.Graph, shards: list[fx.Node], layouts: list[ParamLayout], ctx: PassContext,
                      like: fx.Node, phase: Phase | None = None) -> fx.Node:
    """Issue the all-gather of the concatenated shards. Shapes come from the layouts: the shards' own metadata may
    still be the full parameter's until ``propagate_shard_shapes`` runs."""
    device = shards[0].meta["val"].device
    with fake_mode_of(graph):
        send_val = torch.empty(sum(l.shard_numel for l in layouts), dtype=layouts[0].dtype, device=device)
        gathered_val = torch.empty(send_val.numel() * ctx.world_size, dtype=layouts[0].dtype, device=device)
    send = add_call(graph, aten.cat.default, (shards,), like=like, phase=phase, val=send_val) \
        if len(shards) > 1 else shards[0]
    node = add_call(graph, collectives.all_gather, (send, ctx.group_name, ctx.world_size), like=like, phase=phase,
                    val=gathered_val)
    return categorize(node, "gathered_param")


def all_gather_params(graph: fx.Graph, shards: list[fx.Node], layouts: list[ParamLayout], ctx: PassContext,
                      like: fx.Node, phase: Phase | None = None) -> fx.Node:
    """Issue one all-gather of the parameters' shards into one buffer per parameter (the padded flat parameter, since
    rank r's chunk is its r-th): nothing is packed before or copied out after."""
    device = shards[0].meta["val"].device
    with fake_mode_of(graph):
        vals = [torch.empty(l.padded_numel, dtype=l.dtype, device=device) for l in layouts]
    node = add_call(graph, collectives.all_gather_coalesced, (shards, ctx.group_name, ctx.world_size), like=like,
                    phase=phase, val=vals)
    return categorize(node, "gathered_param")


def gathered_params(graph: fx.Graph, pending: fx.Node, layouts: list[ParamLayout], like: fx.Node,
                    phase: Phase | None = None) -> list[fx.Node]:
    """Wait for ``all_gather_params`` and view each parameter, full-shaped, in its own gathered buffer."""
    fulls = []
    for i, layout in enumerate(layouts):
        out = add_call(graph, operator.getitem, (pending, i), like=like, phase=phase, val=pending.meta["val"][i])
        done = categorize(add_call(graph, collectives.wait, (out, pending.args[0]), like=like, phase=phase,
                                   val=out.meta["val"]), "gathered_param")
        flat = done if layout.padded_numel == layout.numel else \
            add_call(graph, aten.slice.Tensor, (done, 0, 0, layout.numel), like=like, phase=phase)
        fulls.append(add_call(graph, aten.view.default, (flat, list(layout.shape)), like=like, phase=phase))
    return fulls


def gathered_rows(graph: fx.Graph, pending: fx.Node, layouts: list[ParamLayout], like: fx.Node,
                  phase: Phase | None = None) -> list[fx.Node]:
    """Wait for an all-gather and return, per parameter, its [N, s] (strided) slice of the gathered matrix."""
    done = categorize(wait_for(graph, pending, like, phase), "gathered_param")
    n = layouts[0].world_size
    total = sum(l.shard_numel for l in layouts)
    matrix = add_call(graph, aten.view.default, (done, [n, total]), like=like, phase=phase)
    rows, offset = [], 0
    for layout in layouts:
        rows.append(add_call(graph, aten.slice.Tensor, (matrix, 1, offset, offset + layout.shard_numel), like=like,
                             phase=phase))
        offset += layout.shard_numel
    return rows
