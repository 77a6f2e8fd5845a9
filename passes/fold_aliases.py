"""Drop the aliases that compute nothing: ``detach`` (the graph runs without autograd), a transpose of a transpose,
and the first of two views in a row.

A traced step carries the autograd engine's bookkeeping as ATen calls: ``detach`` where a gradient is accumulated,
``t(t(w))`` where a linear layer's backward takes the transpose of the weight forward already transposed; the passes
add ``view(view(x))`` where they flatten a gradient and then shape it for its bucket. Each is a view of its input,
and each still costs a call through the dispatcher and a new tensor object on every step; the eager step makes them
inside C++ autograd. Reading the input itself instead changes no value; a role the alias was tagged with (a
gradient) moves to its input.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from zerofx.passes.context import PassContext
from zerofx.step_graph import TAG, tag

aten = torch.ops.aten


def fold_aliases(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the final graph but for scheduling and memory planning. Guarantees: every ``detach`` and every
    ``t`` of a 2-D ``t`` is gone, its readers reading what it aliased (the same values, strides and storage), which
    takes over the roles it was tagged with (a gradient), except where what it aliased has roles of its own or is a
    step input the step would then return; a ``view`` of a ``view`` of a contiguous tensor, the first read by
    nothing else, views the tensor itself. Nothing else changes. Leaves ``ctx.artifacts["aliases_folded"]``."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    folded = 0
    for node in list(gm.graph.nodes):
        if _view_of_a_view(node):
            inner = node.args[0]
            node.args = (inner.args[0], *node.args[1:])
            gm.graph.erase_node(inner)
            folded += 1
            continue
        source = _aliased(node)
        if source is None or output in node.users and source.op != "call_function" or not _takes_roles(source, node):
            continue
        inner = node.args[0]
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        if inner is not source and not inner.users:  # the first transpose of a pair, read by nothing else
            gm.graph.erase_node(inner)
        folded += 1
    ctx.artifacts["aliases_folded"] = folded
    if folded:
        gm.recompile()
    return gm


def _takes_roles(source: fx.Node, alias: fx.Node) -> bool:
    """Whether ``source`` can carry the roles (a gradient, ...) ``alias`` is tagged with: it has none of its own."""
    roles = tag(alias).slots if tag(alias) is not None else []
    if not roles:
        return True
    if source.op != "call_function" or tag(source) is None or tag(source).slots:
        return False
    source.meta[TAG] = dataclasses.replace(tag(source), slots=list(roles))
    return True


def _view_of_a_view(node: fx.Node) -> bool:
    inner = node.args[0] if node.op == "call_function" and node.target is aten.view.default else None
    return (getattr(inner, "target", None) is aten.view.default and len(inner.users) == 1
            and not (tag(inner) is not None and tag(inner).slots) and inner.args[0].meta["val"].is_contiguous())


def _aliased(node: fx.Node) -> fx.Node | None:
    """The node whose value ``node`` is an identical view of, or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.detach.default:
        return node.args[0]
    if node.target is aten.t.default and getattr(node.args[0], "target", None) is aten.t.default:
        inner = node.args[0].args[0]
        return inner if isinstance(inner, fx.Node) and inner.meta["val"].dim() == 2 else None
    return None
