"""Stages 1-3 (P_os): the optimizer updates this rank's shard of each parameter, with state for that shard only."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.errors import CaptureError, user_frame_from_stack_trace
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import SHARD, add_call, fake_mode_of, keep_grad_outputs
from zerofx.sharding import ParamLayout
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot, StepGraph, tag

aten = torch.ops.aten


def shard_optimizer_state(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: a captured step whose optimizer update is elementwise per parameter (SGD, Adam, AdamW).

    Guarantees, with N = ``ctx.world_size`` and each trainable parameter p laid out by `ParamLayout` (flattened,
    padded to a multiple of N, chunk r belongs to rank r):

    - a RANK placeholder (an int) is added: the graph is the same on every rank, the rank is an input;
    - optimizer state placeholders shaped like p become this rank's shard (``shard_numel`` elements);
    - stages 1-2: p's placeholder becomes the padded flat parameter; forward and backward read
      ``view(slice(p, 0, 0, numel), shape)``, the optimizer updates ``select(view(p, [N, s]), 0, rank)`` in place;
    - stage 3: p's placeholder becomes this rank's shard, which the optimizer updates in place; forward and backward
      reads are left for ``gather_params``;
    - gradients a later call does not read are no longer graph outputs: from stage 1 on, the step owns the state
      and ``.grad`` stays empty; those of ``ctx.grads_kept`` stay outputs, and ``reduce_scatter_grads`` makes them
      this rank's reduced shard, which the step keeps for its next call;
    - each GRAD_IN placeholder (such a shard kept by an earlier call) is shaped as this rank's shard of p.

    Leaves ``ctx.artifacts["layouts"]`` (fqn -> ParamLayout) for the passes after it and the runtime.
    """
    graph = gm.graph
    sg = StepGraph(gm)
    n = ctx.world_size
    trained = sg.tagged(Role.GRAD)
    trainable = {fqn: node for fqn, node in sg.params().items() if fqn in trained or fqn in ctx.owned_params}
    layouts = {fqn: ParamLayout(fqn, tuple(node.meta["val"].shape), node.meta["val"].dtype, n)
               for fqn, node in trainable.items()}
    fake_mode = fake_mode_of(graph)
    last_placeholder = [p for p in graph.nodes if p.op == "placeholder"][-1]
    with graph.inserting_after(last_placeholder):
        rank = graph.placeholder("rank")
    rank.meta.update(val=0, **{TAG: NodeTag(Phase.FORWARD, 0, [Slot(Role.RANK)])})
    first_op = rank.next

    for fqn, p in trainable.items():
        layout = layouts[fqn]
        users = list(p.users)
        _refuse_reads_after_the_update(fqn, users)
        with fake_mode:
            p.meta["val"] = torch.empty(layout.padded_numel if ctx.stage < 3 else layout.shard_numel,
                                        dtype=layout.dtype, device=p.meta["val"].device)
        if ctx.stage >= 3:
            p.meta[SHARD] = True
            continue
        with graph.inserting_before(first_op):
            flat = p if layout.padded_numel == layout.numel else \
                add_call(graph, aten.slice.Tensor, (p, 0, 0, layout.numel), like=p)
            full = add_call(graph, aten.view.default, (flat, list(layout.shape)), like=p)
            rows = add_call(graph, aten.view.default, (p, [n, layout.shard_numel]), like=p)
            chunk = add_call(graph, aten.select.int, (rows, 0, rank), like=p, phase=Phase.OPTIMIZER,
                             val=rows.meta["val"][0])
            chunk.meta[SHARD] = True
        for user in users:
            user.replace_input_with(p, chunk if tag(user).in_optimizer_step else full)

    for fqn, incoming in sg.placeholders(Role.GRAD_IN).items():
        _as_shard(incoming, layouts[fqn].shard_numel, fake_mode)
    for fqn, state in _param_shaped_state(sg, layouts):
        _as_shard(state, layouts[fqn].shard_numel, fake_mode)

    keep_grad_outputs(graph, ctx.grads_kept)
    ctx.artifacts["layouts"] = layouts
    gm.recompile()
    return gm


def _as_shard(placeholder: fx.Node, numel: int, fake_mode) -> None:
    value = placeholder.meta["val"]
    with fake_mode:
        placeholder.meta["val"] = torch.empty(numel, dtype=value.dtype, device=value.device)
    placeholder.meta[SHARD] = True


def _param_shaped_state(sg: StepGraph, layouts: dict[str, ParamLayout]):
    for node in sg.graph.nodes:
        if node.op == "placeholder":
            slot = tag(node).slots[0]
            if slot.role in (Role.OPT_STATE, Role.MASTER) and slot.fqn in layouts \
                    and layouts[slot.fqn].shards(slot.key, node.meta["val"].shape):
                yield slot.fqn, node


def _refuse_reads_after_the_update(fqn: str, users: list[fx.Node]) -> None:
    for user in users:
        t = tag(user)
        if t.phase == Phase.OPTIMIZER and not t.in_optimizer_step:
            raise CaptureError(
                f"the train step reads parameter '{fqn}' outside forward, backward and optimizer.step() "
                f"({user.target}); from stage 1 on only this rank's shard exists there",
                source=user_frame_from_stack_trace(user.meta.get("stack_trace")),
            )

