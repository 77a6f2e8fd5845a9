"""P_a+cpu: the inputs checkpointed regions keep move to host memory after forward and come back before backward
recomputes the region.

A checkpoint (a block's input, kept for its recompute) is otherwise resident from forward until backward reaches
its block. With ``offload_activations`` it is copied to host memory (pinned, on an accelerator) once forward no
longer reads it, and copied back just before the first recompute that reads it; the resident copy dies in between.
On a CPU machine the same copies run (host to host), and memory reports count the host copies apart
(``offloaded``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import categorize
from zerofx.passes.graph_edit import add_call, saved_checkpoints
from zerofx.step_graph import Phase, users_in

aten = torch.ops.aten


def offload_checkpoints(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: ``checkpoint_activations`` has run (its copies marked ``meta[RECOMPUTED]``);
    ``ctx.offload_activations`` (False: unchanged). Guarantees: every forward value that backward first reads to
    recompute a region (`saved_checkpoints`: a block's input, or P_a's slice of it) is copied to host memory right
    after its last forward reader and back right before that first reader, and every backward reader reads the copy
    back; values are unchanged. Leaves
    ``ctx.artifacts["offloaded_bytes"]``."""
    if not ctx.offload_activations:
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    offloaded = 0
    for value, readers in saved_checkpoints(graph, order):
        last_forward = max(users_in(value, Phase.FORWARD), key=order.__getitem__, default=value)
        first_reader = min(readers, key=order.__getitem__)
        val = value.meta["val"]
        accelerated = val.device.type != "cpu"  # copies asynchronous on the device's stream
        with graph.inserting_after(last_forward):
            # non-blocking from an accelerator: torch copies into pinned host memory
            host = categorize(add_call(graph, aten._to_copy.default, (value,), like=last_forward, kwargs={
                "device": torch.device("cpu"), "non_blocking": accelerated}), "offloaded")
        with graph.inserting_before(first_reader):
            back = add_call(graph, aten._to_copy.default, (host,), like=first_reader,
                            kwargs={"device": val.device, "non_blocking": accelerated})
        for reader in readers:
            reader.replace_input_with(value, back)
        offloaded += val.untyped_storage().nbytes()
    ctx.artifacts["offloaded_bytes"] = offloaded
    gm.recompile()
    return gm

