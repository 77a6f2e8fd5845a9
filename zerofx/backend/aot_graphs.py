"""Tags on the forward and backward graphs AOTAutograd hands a torch.compile backend, so zerofx's passes read them
as they read a captured step.

AOTAutograd gives two graphs per captured region: forward takes the region's inputs (parameters, buffers, the
activations and batch) in the order Dynamo passes them; backward returns one gradient per forward input, in the same
order (None where no gradient flows). Here every forward node is tagged FORWARD and its parameter and buffer inputs
get their PARAM and BUFFER slots; every backward node is tagged BACKWARD and each parameter's gradient output its
GRAD slot. A gradient is first made what ``AccumulateGrad`` would store (a contiguous tensor of its own), because
the communication passes view gradients flat and may write into their buffers.

Stage 3: each graph takes this rank's shard of a sharded parameter where Dynamo passes the parameter, so the
parameter's placeholder holds the shard (as ``shard_optimizer_state`` leaves it in a whole step) while its readers
still read it full, for ``gather_params``. Backward reads a parameter only if forward hands it over among the values
it saves (AOTAutograd names such a backward input as the forward node it is); it is the shard there too, so no
gathered copy lives between the two graphs. The joint graph marks what only re-presents a parameter (its transposes,
views and casts) ``MUST_RECOMPUTE``, so the partitioner saves the parameter rather than such a view of it, and
backward gathers again. Under mixed precision each graph also takes the fp32 master shard of every parameter it
holds, as a MASTER input (`add_master_inputs`): ``cast_params_at_gather`` then gathers casts of it and removes the
parameter's own input, whose place `graph_inputs` leaves out when the graph is called.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from functorch.compile import default_partition
from torch.utils.checkpoint import CheckpointPolicy

from zerofx.passes.gather_params import PARAM_ONLY_OPS
from zerofx.passes.graph_edit import SHARD, add_call, fake_mode_of
from zerofx.sharding import ParamLayout
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot, aliases_first_arg

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


def tag_backward(gm: fx.GraphModule, input_slots: list[Slot | None],
                 saved_params: dict[str, Slot] | None = None) -> fx.GraphModule:
    """Tag ``gm`` (AOTAutograd's backward graph), whose i-th output is the gradient of the forward's i-th input;
    ``saved_params``: forward's parameter placeholders by name, where forward hands a parameter to backward."""
    for node in gm.graph.nodes:
        node.meta[TAG] = NodeTag(Phase.BACKWARD)
        if node.op == "placeholder" and node.name in (saved_params or {}):
            node.meta[TAG].slots.append(saved_params[node.name])
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


def hold_shards(gm: fx.GraphModule, layouts: dict[str, ParamLayout]) -> dict[str, Slot]:
    """Stage 3: the parameter placeholders of ``layouts`` (tagged) hold this rank's shard, which ``gm`` is called
    with; returns their slots by placeholder name."""
    held = {}
    for node in gm.graph.nodes:
        slots = node.meta[TAG].slots if node.op == "placeholder" else []
        if slots and slots[0].role == Role.PARAM and slots[0].fqn in layouts:
            with fake_mode_of(gm.graph):
                full = node.meta["val"]
                node.meta["val"] = torch.empty(layouts[slots[0].fqn].shard_numel, dtype=full.dtype, device=full.device)
            node.meta[SHARD] = True
            held[node.name] = slots[0]
    return held


def add_master_inputs(gm: fx.GraphModule, held: dict[str, Slot], masters: dict[str, torch.Tensor]) -> None:
    """Stage 3 under mixed precision: after ``gm``'s inputs, a MASTER input per parameter it holds (``held``, from
    `hold_shards`), shaped and typed as ``masters[fqn]`` (this rank's fp32 master shard), as a whole step's graph
    takes the masters beside the parameters."""
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    phase = last.meta[TAG].phase
    for slot in held.values():
        with graph.inserting_after(last):
            last = graph.placeholder(f"master_{slot.fqn.replace('.', '_')}")
        master = masters[slot.fqn]
        with fake_mode_of(graph):
            last.meta["val"] = torch.empty(master.shape, dtype=master.dtype, device=master.device)
        last.meta[TAG] = NodeTag(phase, slots=[Slot(Role.MASTER, slot.fqn)])
        last.meta[SHARD] = True
    gm.recompile()


def graph_inputs(gm: fx.GraphModule, names: list[str]) -> list[int | Slot]:
    """How to call ``gm`` after its passes, given the names of its inputs before them: for each input, the position
    of the argument it was, or the MASTER slot `add_master_inputs` gave it."""
    position = {name: i for i, name in enumerate(names)}
    return [position[n.name] if n.name in position else n.meta[TAG].slots[0]
            for n in gm.graph.nodes if n.op == "placeholder"]


def recompute_views_where_read(gm: fx.GraphModule, held: dict[str, Slot]) -> None:
    """Stage 3, backward: what only re-presents a parameter it holds (the views the partitioner recomputes rather
    than save) moves to just before its first reader. The partitioner puts such recomputations first; left there,
    each would be the parameter's first use, and ``gather_params`` would gather every parameter as backward begins."""
    chain = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in held]
    for node in gm.graph.nodes:
        if _re_presents(node, set(chain)):
            chain.append(node)
    position = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    for node in reversed(chain[len(held):]):  # the last first: its readers are in place when it moves
        first = min(node.users, key=position.__getitem__, default=None)
        if first is not None:
            first.prepend(node)
            position[node] = position[first] - 1e-3


def _re_presents(node: fx.Node, chain: set[fx.Node]) -> bool:
    """``node`` computes, from nodes of ``chain`` alone, a view or cast of one of them."""
    return node.op == "call_function" and bool(node.all_input_nodes) and set(node.all_input_nodes) <= chain \
        and (node.target in PARAM_ONLY_OPS or aliases_first_arg(node))


def hand_shards_to_backward(gm: fx.GraphModule, held: dict[str, Slot]) -> dict[int, int]:
    """Stage 3: forward's outputs that are parameter placeholders (saved for backward) are taken out of the graph,
    whose passes would hand over the gathered parameter instead; output position -> input position, for the caller
    to put the shard there."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs, handed = list(output.args[0]), {}
    for i, value in enumerate(outs):
        if isinstance(value, fx.Node) and value.name in held:
            handed[i], outs[i] = placeholders.index(value.name), None
    output.args = (tuple(outs),)
    gm.recompile()
    return handed


def partition_recomputing_param_views(params: list[int]):
    """AOTAutograd's default partitioner, saving no view of the inputs at positions ``params`` for backward: what
    is computed from them alone through ops that re-present a tensor is marked ``MUST_RECOMPUTE``."""

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
        chain = {placeholders[i] for i in params}
        for node in joint.graph.nodes:
            if _re_presents(node, chain):
                chain.add(node)
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return default_partition(joint, joint_inputs, **kwargs)

    return partition


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
