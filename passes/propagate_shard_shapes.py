"""Stages 1-3: recompute shapes on shards after the update, and refuse what would compute something else there."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from zerofx.errors import CaptureError, user_frame_from_stack_trace
from zerofx.mixed_precision import PER_TENSOR_CHECK
from zerofx.passes.context import PassContext
from zerofx.passes.global_grad_norm import GLOBAL_NORM
from zerofx.passes.graph_edit import INSERTED, SHARD, fake_mode_of
from zerofx.step_graph import Phase, Role, tag

aten = torch.ops.aten

# Not tagged pointwise, but shape-preserving per element: safe on a shard.
_SHARD_SAFE = {aten.detach.default, aten.clone.default, aten.copy_.default, aten.zeros_like.default,
               aten.empty_like.default, aten.ones_like.default, aten.full_like.default, aten.alias.default,
               aten._to_copy.default, aten.zero_.default, aten.fill_.Scalar}


_AFTER_UPDATE_HINT = ("read parameters after the step returns (zerofx.full_state_dict); of the gradients, return "
                      "their global norm (what torch.nn.utils.clip_grad_norm_ returns, before optimizer.step()); or "
                      "use stage 0")


_NORM_HINT = ("take norms over all the gradients with torch.nn.utils.clip_grad_norm_; a norm of each parameter's "
              "(in your code, or an optimizer's, as LAMB takes) needs stage 0")


def propagate_shard_shapes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the sharded graph (after ``shard_optimizer_state`` and the communication passes), shard-holding
    nodes flagged ``SHARD``.

    Guarantees: every node after backward (the update, and gradient processing such as clipping) carries the
    ``val`` it computes on shards. Raises `CaptureError` naming the op and the source line where an op reads a
    shard and is not elementwise, unless a pass made it global (``global_grad_norm``): a per-parameter norm inside
    the update (LAMB), a sum or mean of a gradient, a reshape. On a shard such an op would compute something else
    than on the full tensor, so zerofx refuses it rather than train a different model; so does a value the step
    returns computed elementwise from a shard.
    """
    fake_mode = fake_mode_of(gm.graph)
    sharded = {n for n in gm.graph.nodes if n.meta.get(SHARD)}
    # values a pass gave a new ``val``, and those recomputed from them: a node reading none of them keeps its own
    changed = sharded | {n for n in gm.graph.nodes if n.meta.get(INSERTED)}
    stepped = False  # an optimizer.step() has run: what reads a shard now is user code after it (logging a weight)
    for node in gm.graph.nodes:
        stepped = stepped or bool(tag(node) and tag(node).in_optimizer_step)
        if node.op != "call_function" or tag(node).phase != Phase.OPTIMIZER or node.meta.get(INSERTED):
            continue
        if not any(a in changed for a in node.all_input_nodes):
            continue
        changed.add(node)
        reads_shard = any(a in sharded for a in node.all_input_nodes)
        if reads_shard:
            elementwise = isinstance(node.target, torch._ops.OpOverload) and (
                torch.Tag.pointwise in node.target.tags or node.target in _SHARD_SAFE)
            if elementwise or node.target is operator.getitem:
                sharded.add(node)
            elif not (node.meta.get(GLOBAL_NORM) or node.meta.get(PER_TENSOR_CHECK)):
                after_update = stepped and not tag(node).in_optimizer_step
                raise CaptureError(
                    f"{node.target} reads a 1/{ctx.world_size} shard of a parameter, its state or its gradient at "
                    f"stage {ctx.stage}{' after optimizer.step()' if after_update else ''} and is not elementwise: "
                    "it would compute something else than on the full tensor",
                    source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
                    hint=_AFTER_UPDATE_HINT if after_update else _NORM_HINT,
                )
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)
    _refuse_returned_shards(gm.graph, sharded, ctx)
    gm.recompile()
    return gm


def _refuse_returned_shards(graph: fx.Graph, sharded: set[fx.Node], ctx: PassContext) -> None:
    """What the step returns to the user computed elementwise from a shard (``w * 1.0`` after the update) would be
    this rank's flat piece of it, not the tensor eager returns."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for value, slot in zip(output.args[0], tag(output).slots):
        if slot.role == Role.USER_OUTPUT and value in sharded:
            raise CaptureError(
                f"the train step returns {value.target}, computed from a 1/{ctx.world_size} shard of a parameter, "
                f"its state or its gradient at stage {ctx.stage}: it would return this rank's flat piece",
                source=user_frame_from_stack_trace(value.meta.get("stack_trace")),
                hint=_AFTER_UPDATE_HINT)
