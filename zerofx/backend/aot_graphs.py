"""Tags on the forward and backward graphs AOTAutograd hands a torch.compile backend, so zerofx's passes read them
as they read a captured step.

AOTAutograd gives two graphs per captured region: forward takes the region's inputs (parameters, buffers, the
activations and batch) in the order Dynamo passes them; backward returns one gradient per forward input, in the same
order (None where no gradient flows). Here every forward node is tagged FORWARD and its parameter and buffer inputs
get their PARAM and BUFFER slots; every backward node is tagged BACKWARD and each parameter's gradient output its
GRAD slot. A gradient is first made what ``AccumulateGrad`` would store (a contiguous tensor of its own), because
the communication passes view gradients flat and may write into their buffers.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes.graph_edit import add_call
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot

aten = torch.ops.aten


def tag_forward(gm: fx.GraphModule, input_slots: list[Slot | None]) -> fx.GraphModule:
    """Tag ``gm`` (AOTAutograd's forward or inference graph); ``input_slots[i]`` is what its i-th input is (None:
    an activation or batch input)."""
    placeholders = _placeholders(gm, len(input_slots), "forward")
    for node in gm.graph.nodes:
        node.meta[TAG] = NodeTag(Phase.FORWARD)
    for node, slot in zip(placeholders, input_slots):
        node.meta[TAG].slots.append(slot or Slot(Role.BATCH))
    return gm


def tag_backward(gm: fx.GraphModule, input_slots: list[Slot | None]) -> fx.GraphModule:
    """Tag ``gm`` (AOTAutograd's backward graph), whose i-th output is the gradient of the forward's i-th input."""
    for node in gm.graph.nodes:
        node.meta[TAG] = NodeTag(Phase.BACKWARD)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = list(output.args[0])
    if len(grads) != len(input_slots):
        raise ValueError(f"the backward graph returns {len(grads)} gradients for {len(input_slots)} forward inputs; "
                         "zerofx expects one per input")
    for i, (grad, slot) in enumerate(zip(grads, input_slots)):
        if slot is None or slot.role != Role.PARAM or not isinstance(grad, fx.Node):
            continue
        grads[i] = _own_contiguous(gm.graph, grad, output, grads[:i])
        grads[i].meta[TAG].slots.append(Slot(Role.GRAD, slot.fqn))
    output.args = (tuple(grads),)
    gm.recompile()
    return gm


def _own_contiguous(graph: fx.Graph, grad: fx.Node, output: fx.Node, earlier: list) -> fx.Node:
    """``grad``, or a contiguous copy of it where it is an input, a value returned twice or a strided view."""
    val = grad.meta["val"]
    if grad.op != "placeholder" and grad not in earlier and val.is_contiguous():
        return grad
    with graph.inserting_before(output):
        return add_call(graph, aten.clone.default, (grad,), like=output,
                        kwargs={"memory_format": torch.contiguous_format})


def _placeholders(gm: fx.GraphModule, expected: int, which: str) -> list[fx.Node]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != expected:
        raise ValueError(f"the {which} graph takes {len(placeholders)} inputs where Dynamo passed {expected}; "
                         "zerofx expects them one to one")
    return placeholders
