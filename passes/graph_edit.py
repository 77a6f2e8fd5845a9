"""Small helpers passes share to add nodes that carry the same metadata capture gives (``val``, the zerofx tag)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from zerofx.step_graph import TAG, NodeTag, Phase, Role, tag, users_in


INSERTED = "zerofx_inserted"  # node.meta flag: added by a pass (its metadata is set when it is added)
# node.meta: a copy of a forward node that backward runs, and which pass made it ("checkpoint", "pointwise")
RECOMPUTED = "zerofx_recomputed"
# node.meta flag: rebuilds a checkpoint kept in pieces (P_a's all-gather) for the recompute that follows
RESTORES_CHECKPOINT = "zerofx_restores_checkpoint"
SHARD = "zerofx_shard"  # node.meta flag: holds this rank's shard of a parameter, its state or its gradient


def fake_mode_of(graph: fx.Graph):
    for n in graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch._subclasses.FakeTensor):
            return val.fake_mode
    raise ValueError("graph has no fake tensor metadata: run capture first")


def add_call(graph: fx.Graph, target: Callable, args: tuple, *, like: fx.Node, phase: Phase | None = None,
             val: Any = None, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args)`` at the graph's current insertion point, with ``val`` computed on fake tensors
    (unless given) and a tag copied from ``like`` (phase overridable)."""
    node = graph.call_function(target, args, kwargs or {})
    if val is None:
        fake_args = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs or {}))
        with fake_mode_of(graph):
            val = target(*fake_args[0], **fake_args[1])
    node.meta["val"] = val
    node.meta[INSERTED] = True
    source: NodeTag = like.meta[TAG]
    node.meta[TAG] = NodeTag(phase or source.phase, source.microbatch, [], source.in_optimizer_step)
    if "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    return node


def flattened(graph: fx.Graph, node: fx.Node, *, like: fx.Node, phase: Phase | None = None) -> fx.Node:
    """``node``'s elements in row-major order as one dimension: a view where it is contiguous, else a contiguous
    copy's (a channels-last weight or its gradient, a transposed parameter), the order the flat shards keep."""
    if not node.meta["val"].is_contiguous():
        node = add_call(graph, torch.ops.aten.clone.default, (node,), like=like, phase=phase,
                        kwargs={"memory_format": torch.contiguous_format})
    return add_call(graph, torch.ops.aten.view.default, (node, [-1]), like=like, phase=phase)


def keep_grad_outputs(graph: fx.Graph, kept: frozenset[str]) -> None:
    """Drop the graph's gradient outputs (``.grad`` left to the caller) but those of the parameters ``kept``."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    pairs = [(v, s) for v, s in zip(output.args[0], tag(output).slots) if s.role != Role.GRAD_OUT or s.fqn in kept]
    output.args = ([v for v, _ in pairs],)
    tag(output).slots = [s for _, s in pairs]


def saved_checkpoints(graph: fx.Graph, order: dict[fx.Node, int]) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Forward values (not inputs of the step) that backward first reads to recompute a checkpointed region (in a
    recomputed copy, or in a node marked ``meta[RESTORES_CHECKPOINT]``), each with its backward readers."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or tag(node).phase != Phase.FORWARD or node.meta.get(RECOMPUTED) \
                or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        readers = users_in(node, Phase.BACKWARD)
        first = min(readers, key=order.__getitem__, default=None)
        if first is not None and (first.meta.get(RECOMPUTED) == "checkpoint" or first.meta.get(RESTORES_CHECKPOINT)):
            out.append((node, readers))
    return out


def first_user_after(nodes: list[fx.Node], after: fx.Node, order: dict[fx.Node, int],
                     exclude: set[fx.Node] = frozenset()) -> fx.Node | None:
    """The earliest node in graph order, later than ``after``, that uses any of ``nodes``."""
    candidates = [u for n in nodes for u in n.users if u not in exclude and order.get(u, -1) > order[after]]
    return min(candidates, key=order.__getitem__, default=None)

