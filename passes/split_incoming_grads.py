"""Stages 1-3: a gradient kept from an earlier call is added to this call's reduced shard, not to a full gradient."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.errors import CaptureError, user_frame_from_stack_trace
from zerofx.mixed_precision import MASTER_GRAD
from zerofx.passes.context import PassContext
from zerofx.step_graph import Role, StepGraph, is_mutating, storage_root, tag

aten = torch.ops.aten


def split_incoming_grads(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the captured graph; each GRAD_IN placeholder (a ``.grad`` an earlier call left: from stage 1 on,
    this rank's reduced shard of it, which the step keeps) read by backward's accumulation into it, the
    ``add_(incoming, contribution)`` tagged as its gradient, or not by backward at all: in an evaluation, or for a
    parameter this call computes no gradient for, the optimizer or the graph's output reads it as it is. Under mixed
    precision it is the fp32 master's gradient, which capture already adds the conversion of this call's gradient to
    (flagged ``MASTER_GRAD``): left as it is, and not among those ``reduce_scatter_grads`` adds.

    Guarantees: backward computes this call's own gradient, as if ``.grad`` had been empty: the accumulation becomes
    a ``detach`` of the contribution (a ``clone`` where a later micro-batch adds into it), so the passes after
    reduce only what this call computed. Leaves ``ctx.artifacts["incoming_grads"]``: the parameters whose placeholder
    ``reduce_scatter_grads`` must add (sharded by ``shard_optimizer_state``) to this call's reduced shard. Any other
    read of an incoming gradient is refused, naming the parameter and the op.
    """
    sg = StepGraph(gm)
    ctx.artifacts["incoming_grads"] = split = set()
    for fqn, incoming in sg.placeholders(Role.GRAD_IN).items():
        accumulations = [u for u in incoming.users if is_mutating(u) and storage_root(u) is incoming]
        others = [u for u in incoming.users if u not in accumulations and u.op != "output"
                  and not (tag(u) is not None and tag(u).in_optimizer_step) and not u.meta.get(MASTER_GRAD)]
        if others or len(accumulations) > 1 or any(u.target != aten.add_.Tensor or u.args[0] is not incoming
                                                   for u in accumulations):
            node = (others or accumulations)[0]
            raise CaptureError(
                f"the train step reads the gradient of '{fqn}' an earlier call left in .grad ({node.target}) other "
                f"than by accumulating into it in backward; at stage {ctx.stage} the step keeps only this rank's "
                "shard of it between calls",
                source=user_frame_from_stack_trace(node.meta.get("stack_trace")))
        for accumulation in accumulations:
            contribution = accumulation.args[1]
            added_to_later = any(is_mutating(u) and u.args[0] is accumulation for u in accumulation.users)
            accumulation.target = aten.clone.default if added_to_later else aten.detach.default
            accumulation.args, accumulation.kwargs = (contribution,), {}
            split.add(fqn)
    gm.recompile()
    return gm
