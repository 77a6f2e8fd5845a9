"""Drop the ``record_function`` enter/exit markers torch.optim leaves in a trace: they do no work and clutter dumps."""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes.context import PassContext

_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def remove_profiler_ops(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: any captured graph. Guarantees: no profiler marker nodes; every other node untouched."""
    markers = [n for n in gm.graph.nodes if n.target in _PROFILER_OPS]
    for node in reversed(markers):  # an exit uses its enter: erase exits first
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
