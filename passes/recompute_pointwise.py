"""Cheap recomputation: a pointwise op's output that backward reads is made again in backward from inputs backward
keeps anyway, instead of living from forward to backward.

Autograd saves both the input and the output of many cheap ops: a linear layer after GELU saves GELU's output
for its weight gradient while GELU saves its own input; a linear layer after LayerNorm saves the norm's output
while the norm saves its input and statistics. Recomputing the output from those inputs just before backward first
reads it costs one memory-bound kernel and frees the output for the whole time between. Only ops whose every
input stays alive in backward until then qualify (parameters too: stage 3 gathers them for backward), so the
recompute never extends an activation's life, and results are bitwise those without it (no random op qualifies).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import RECOMPUTED
from zerofx.step_graph import TAG, NodeTag, Phase, Role, is_mutating, storage_root, tag
from zerofx.trace_events import REGION

aten = torch.ops.aten
_CHEAP_MULTI = {aten.native_layer_norm.default}  # ops with several outputs, the first recomputed


def recompute_pointwise(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: a captured graph (after ``checkpoint_activations``), ``ctx.recompute_pointwise`` (False: unchanged).
    Guarantees: every forward pointwise op whose output backward reads, whose inputs backward also reads at or
    after that moment (or are the batch, or parameters backward reads), and whose output no op writes in place, is
    copied (with the views backward reads of it, tagged backward, ``meta[RECOMPUTED]``) just before backward first
    reads it, and backward reads the copies. Leaves ``ctx.artifacts["recomputed_pointwise"]``, the bytes no longer
    kept from forward to backward."""
    if not ctx.recompute_pointwise:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    reads = _backward_reads(graph)  # keyed by storage root
    first = {root: min(order[u] for u, _ in pairs) for root, pairs in reads.items()}
    last = {root: max(order[u] for u, _ in pairs) for root, pairs in reads.items()}
    written = {_root(n) for n in graph.nodes if is_mutating(n)}
    freed = 0
    for node in [n for n in graph.nodes if n in reads]:
        if _recomputable(node, reads, first, last, written):
            _copy_into_backward(graph, node, reads[node], order)
            freed += node.meta["val"].untyped_storage().nbytes()
    ctx.artifacts["recomputed_pointwise"] = freed
    gm.recompile()
    return gm


def _backward_reads(graph: fx.Graph) -> dict[fx.Node, list[tuple[fx.Node, fx.Node]]]:
    """Storage root of a forward value -> (backward node, the forward node it reads: the root or a view of it)."""
    reads: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or tag(node) is None or tag(node).phase != Phase.FORWARD:
            continue
        for user in node.users:
            if tag(user) is not None and tag(user).phase == Phase.BACKWARD:
                reads.setdefault(_root(node), []).append((user, node))
    return reads


def _root(node: fx.Node) -> fx.Node:
    """The node that owns ``node``'s storage, through views, in-place ops and ``_unsafe_view`` (reshape's copy)."""
    node = storage_root(node)
    while node.target is aten._unsafe_view.default:
        node = storage_root(node.args[0])
    return node


def _producer(node: fx.Node) -> fx.Node | None:
    """The cheap op that computes ``node`` (a LayerNorm's output is an item of its result), or None."""
    target = node.target
    if target is operator.getitem and node.args[1] == 0 and getattr(node.args[0], "target", None) in _CHEAP_MULTI:
        return node.args[0]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags \
            and torch.Tag.nondeterministic_seeded not in target.tags and not is_mutating(node) \
            and isinstance(node.meta.get("val"), torch.Tensor):
        return node
    return None


def _recomputable(node: fx.Node, reads, first, last, written) -> bool:
    producer = _producer(node)
    if producer is None or node in written or tag(node).phase != Phase.FORWARD:
        return False
    return all(_alive_until(a, first[node], reads, last, written) for a in producer.all_input_nodes)


def _alive_until(value: fx.Node, moment: int, reads, last, written) -> bool:
    """Whether backward can read ``value``, unchanged, at graph position ``moment``."""
    if value.op == "get_attr":
        return True
    if value.op == "placeholder":
        slots = tag(value).slots
        return bool(slots) and slots[0].role in (Role.BATCH, Role.PARAM)
    root = _root(value)
    return root in reads and root not in written and last[root] >= moment


def _copy_into_backward(graph: fx.Graph, node: fx.Node, pairs: list[tuple[fx.Node, fx.Node]],
                        order: dict[fx.Node, int]) -> None:
    """Copy ``node`` (its producer first, for a LayerNorm's output) and the views of it backward reads just before
    the first backward reader; point every reader at the copies."""
    first_reader = min((u for u, _ in pairs), key=order.__getitem__)
    producer = _producer(node)
    copies: dict[fx.Node, fx.Node] = {}
    for user, read in pairs:  # ``read`` is the node or a view of it (the node's storage is written by no op)
        views = []
        while read is not node:
            views.append(read)
            read = read.args[0]
        for value in ([producer] if producer is not node else []) + [node] + views[::-1]:
            if value not in copies:
                with graph.inserting_before(first_reader):
                    copy = graph.node_copy(value, lambda n: copies.get(n, n))
                copy.meta[TAG] = NodeTag(Phase.BACKWARD, tag(first_reader).microbatch)
                copy.meta[RECOMPUTED] = "pointwise"
                copy.meta.pop(REGION, None)
                copies[value] = copy
        user.replace_input_with(views[0] if views else node, copies[views[0] if views else node])
