"""Stage 3 under mixed precision: gather the low-precision parameters cast from the fp32 master shards."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import add_call
from zerofx.step_graph import Role, StepGraph, is_mutating, storage_root

aten = torch.ops.aten


def cast_params_at_gather(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: stage 3 after ``gather_params``, under mixed precision (MASTER placeholders: the fp32 master shards;
    PARAM placeholders: the ``param_dtype`` shards, read only by the all-gathers and written after the update). A
    no-op without master weights.

    Guarantees: every all-gather of a parameter sends its master shard cast to ``param_dtype`` just before it (the
    same rounding as the write-back it replaces), the write-back after the update is removed, and so is the
    ``param_dtype`` shard itself: a rank keeps (b_g + K)Ψ/N_d bytes of model states, not (b_p + b_g + K)Ψ/N_d, as
    FSDP2 keeps only its fp32 shard and casts at each all-gather.
    """
    graph = gm.graph
    sg = StepGraph(gm)
    params = sg.params()
    for fqn, master in sg.placeholders(Role.MASTER).items():
        shard = params[fqn]
        for gather in [u for u in shard.users if u.target is collectives.all_gather_coalesced]:
            with graph.inserting_before(gather):
                cast = add_call(graph, aten._to_copy.default, (master,), like=gather,
                                kwargs={"dtype": shard.meta["val"].dtype})
            waits = [w for item in gather.users if item.target is operator.getitem for w in item.users]
            for node in (gather, *waits):
                node.replace_input_with(shard, cast)
        _erase_write_back(graph, shard)
    gm.recompile()
    return gm


def _erase_write_back(graph: fx.Graph, shard: fx.Node) -> None:
    """The update's ``copy_`` into the shard, what only it read (the skip-step ``where``), then the placeholder."""
    writes = [u for u in shard.users if is_mutating(u) and storage_root(u) is shard]
    feeding = {a for w in writes for a in w.all_input_nodes if a is not shard}
    for w in writes:
        graph.erase_node(w)
    for node in feeding:  # never an in-place update itself (the master's last write feeds the copy without skipping)
        if not node.users and node.op == "call_function" and not is_mutating(node):
            graph.erase_node(node)
    if shard.users:
        readers = ", ".join(str(u.target) for u in shard.users)
        raise AssertionError(f"the {shard.name} shard is still read after the all-gathers were moved ({readers})")
    graph.erase_node(shard)
