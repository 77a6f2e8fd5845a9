"""Stages 1-3: recompute the optimizer's shapes on shards, and refuse an update that is not elementwise."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from zerofx.errors import CaptureError, user_frame_from_stack_trace
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import fake_mode_of
from zerofx.step_graph import tag

aten = torch.ops.aten

# Not tagged pointwise, but shape-preserving per element: safe on a shard.
_SHARD_SAFE = {aten.detach.default, aten.clone.default, aten.copy_.default, aten.zeros_like.default,
               aten.empty_like.default, aten.ones_like.default, aten.full_like.default, aten.alias.default}


def propagate_shard_shapes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the sharded graph (after ``shard_optimizer_state`` and the communication passes).

    Guarantees: every node inside ``optimizer.step()`` carries the ``val`` it computes on shards. Raises
    `CaptureError` naming the op and the source line if one is not elementwise on a sharded tensor (a per-parameter
    norm, as LAMB takes, or a reshape): on shards such an op would compute something else than on the full
    parameter, so zerofx refuses it rather than train a different model.
    """
    fake_mode = fake_mode_of(gm.graph)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not tag(node).in_optimizer_step:
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
        sharded = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and v.ndim > 0]
        elementwise = isinstance(node.target, torch._ops.OpOverload) and (
            torch.Tag.pointwise in node.target.tags or node.target in _SHARD_SAFE)
        if sharded and not elementwise and node.target is not operator.getitem:
            raise CaptureError(
                f"optimizer op {node.target} is not elementwise: at stage {ctx.stage} it would run on a 1/{ctx.world_size}"
                " shard of the parameter and compute something else than on the full parameter",
                source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
                hint="use SGD, Adam or AdamW at stages 1-3, or stage 0",
            )
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)
    gm.recompile()
    return gm
