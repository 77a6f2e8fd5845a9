"""P_a: a checkpoint that every rank of the tensor-parallel group holds whole is kept as this rank's 1/tp slice, and
all-gathered over the group just before backward recomputes its region.

Tensor parallelism (Megatron-LM's, or ``parallelize_module``'s) leaves a block's input replicated across the tp
group: each rank would keep the same checkpoint. Which values are replicated is read off the graph: the step's inputs
are, except the local tensors of parameters split over tp (and their gradients and optimizer state); a value computed
from replicated values is, and so is the result of an all-reduce or all-gather over the tp group. Each replicated
checkpoint is flattened, padded to a multiple of tp, and this rank's slice copied out right after its last forward
reader, so the whole copy dies there; in backward an all-gather over tp rebuilds it just before the first recompute
that reads it. DeepSpeed slices the flattened tensor the same way; here the gather is issued where the recompute
needs it and its bytes are filed apart (purpose "activations") from the model states' traffic.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import CATEGORY, categorize, wait_for
from zerofx.passes.graph_edit import RESTORES_CHECKPOINT, add_call, fake_mode_of, saved_checkpoints
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot, storage_root, tag, users_in

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_REPLICATING = (_c10d.all_reduce.default, _c10d.all_gather_into_tensor.default)
_SPLIT_ROLES = (Role.PARAM, Role.MASTER, Role.GRAD_IN, Role.OPT_STATE)


def partition_checkpoints(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: ``checkpoint_activations`` has run; ``ctx.partition_activations`` with ``ctx.tp_size`` > 1 (else
    unchanged), ``ctx.tp_group_name`` and ``ctx.tp_sharded``. Guarantees: every checkpoint replicated across the tp
    group and of at least ``tp_size`` elements is read in backward only through an all-gather over tp of the slices
    (marked ``meta[RESTORES_CHECKPOINT]``), issued right before its first backward reader; the slice (category
    ``checkpoint``) is the only part kept from forward; a ``tp_rank`` placeholder is added; values are unchanged.
    Leaves ``ctx.artifacts["partitioned_checkpoints"]``: how many checkpoints were split."""
    if not ctx.partition_activations or ctx.tp_size == 1:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    varying = _varies_over_tp(graph, ctx)
    chosen = [(value, readers) for value, readers in saved_checkpoints(graph, order)
              if value not in varying and value.meta["val"].numel() >= ctx.tp_size]
    if chosen:
        tp_rank = _tp_rank_placeholder(graph)
        for value, readers in chosen:
            _partition(graph, value, readers, tp_rank, order, ctx)
    ctx.artifacts["partitioned_checkpoints"] = len(chosen)
    gm.recompile()
    return gm


def _varies_over_tp(graph: fx.Graph, ctx: PassContext) -> set[fx.Node]:
    """The nodes whose value may differ between the ranks of the tp group."""
    varying: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            slot = tag(node).slots[0] if tag(node) and tag(node).slots else None
            if slot is not None and slot.role in _SPLIT_ROLES and slot.fqn in ctx.tp_sharded:
                varying.add(node)
        elif node.target is _c10d.wait_tensor.default and _replicates(node.args[0], ctx):
            continue
        elif any(a in varying for a in node.all_input_nodes):
            varying.add(node)
    return varying


def _replicates(collective: fx.Node, ctx: PassContext) -> bool:
    return collective.target in _REPLICATING and collective.args[-1] == ctx.tp_group_name


def _tp_rank_placeholder(graph: fx.Graph) -> fx.Node:
    last_placeholder = [p for p in graph.nodes if p.op == "placeholder"][-1]
    with graph.inserting_after(last_placeholder):
        node = graph.placeholder("tp_rank")
    node.meta.update(val=0, **{TAG: NodeTag(Phase.FORWARD, 0, [Slot(Role.TP_RANK)])})
    return node


def _partition(graph: fx.Graph, value: fx.Node, readers: list[fx.Node], tp_rank: fx.Node,
               order: dict[fx.Node, int], ctx: PassContext) -> None:
    val = value.meta["val"]
    n = ctx.tp_size
    slice_numel = -(-val.numel() // n)
    last_forward = max(users_in(value, Phase.FORWARD), key=order.__getitem__, default=value)
    with graph.inserting_before(last_forward.next):  # in order, right after the last forward reader
        flat = add_call(graph, aten.reshape.default, (value, [-1]), like=last_forward)
        padded = add_call(graph, aten.constant_pad_nd.default, (flat, [0, slice_numel * n - val.numel()]),
                          like=last_forward)
        rows = add_call(graph, aten.view.default, (padded, [n, slice_numel]), like=last_forward)
        row = add_call(graph, aten.select.int, (rows, 0, tp_rank), like=last_forward)
        kept = categorize(add_call(graph, aten.clone.default, (row,), like=last_forward), "checkpoint")
    storage_root(value).meta.pop(CATEGORY, None)  # now an ordinary activation, dead after forward
    first_reader = min(readers, key=order.__getitem__)
    with graph.inserting_before(first_reader):
        with fake_mode_of(graph):
            gathered_val = torch.empty_like(padded.meta["val"])
        pending = add_call(graph, collectives.all_gather, (kept, ctx.tp_group_name, n, "activations"),
                           like=first_reader, val=gathered_val)
        pending.meta[RESTORES_CHECKPOINT] = True
        whole = wait_for(graph, pending, first_reader)
        restored = add_call(graph, aten.view.default, (add_call(
            graph, aten.slice.Tensor, (whole, 0, 0, val.numel()), like=first_reader), list(val.shape)),
            like=first_reader)
    for reader in readers:
        reader.replace_input_with(value, restored)
