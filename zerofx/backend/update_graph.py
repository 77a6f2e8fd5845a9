"""Stages 1-2 through the backend: the parameters gathered after ``optimizer.step()`` by ``allgather_params``.

The optimizer runs eagerly, outside every graph torch.compile captures, so the whole-step path's
``allgather_params`` (which issues each bucket's all-gather after the update's last write to it) finds no update in
AOTAutograd's graphs. It runs instead on a small graph that states what the eager update left: each trainable
parameter is a padded flat placeholder whose chunk ``rank`` the optimizer wrote in place (the node tagged
UPDATED_PARAM, as ``shard_optimizer_state`` leaves it in a whole step). The pass adds the bucketed all-gathers and
the copies into the parameters; the graph runs after each ``optimizer.step()``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from zerofx.passes import PassContext, allgather_params
from zerofx.sharding import ParamLayout
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot

aten = torch.ops.aten


def gather_after_update(layouts: list[ParamLayout], ctx: PassContext, device: torch.device) -> fx.GraphModule:
    """A graph ``(padded flat parameters in the order of ``layouts``..., rank) -> ()`` that all-gathers every rank's
    updated chunk into each parameter; ``layouts`` in the order the optimizer updates them, on ``device``."""
    graph = fx.Graph()
    fake = FakeTensorMode()
    with fake:
        params = [_node(graph.placeholder(f"p{i}"), torch.empty(l.padded_numel, dtype=l.dtype, device=device),
                        Role.PARAM, l.fqn) for i, l in enumerate(layouts)]
    rank = _node(graph.placeholder("rank"), 0, Role.RANK)
    for node, layout in zip(params, layouts):
        with fake:
            rows = node.meta["val"].view(layout.world_size, layout.shard_numel)
        view = _node(graph.call_function(aten.view.default, (node, [layout.world_size, layout.shard_numel])), rows)
        _node(graph.call_function(aten.select.int, (view, 0, rank)), rows[0], Role.UPDATED_PARAM, layout.fqn)
    _node(graph.output(()), None)
    ctx.artifacts["layouts"] = {l.fqn: l for l in layouts}
    return allgather_params(fx.GraphModule(torch.nn.Module(), graph), ctx)


def _node(node: fx.Node, val, role: Role | None = None, fqn: str | None = None) -> fx.Node:
    node.meta["val"] = val
    node.meta[TAG] = NodeTag(Phase.OPTIMIZER, 0, [Slot(role, fqn)] if role else [], in_optimizer_step=True)
    return node
