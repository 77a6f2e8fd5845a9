"""M_D: the step's intermediate buffers become views into one arena, allocated once and reused every step.

From the final graph's lifetimes (`zerofx.memory.lifetimes`), each buffer an ATen op allocates fresh (one contiguous
tensor, not the step's input, not returned by the step except as a ``.grad``) is planned, when the op has an ``out=``
variant: the op then writes into its slot of the arena, a view at the planned offset. A copy (``clone``, a dtype cast
on one device) is written into its slot by ``copy_``, which is what both do after allocating. The gradients a step leaves in
``.grad`` (stage 0's reduced buckets) stay in the arena after it, so a step does not ask the allocator for them
again. Each is returned as an alias of its own, never as a slot: as the next step starts, the runtime counts what
still references the arena and leaves it to any holder but itself (`zerofx.runtime.SharedArena`). A step that reads
incoming gradients returns its own outside the arena: the next call, which reads them, would otherwise have to copy
them out first. Buffers alive at the same time never share a byte (`zerofx.memory.plan`), so long- and short-lived
tensors never interleave in an allocator's free lists, and a step asks the allocator only for what is not planned.
The arena is one joint plan or one pool per lifetime class, whichever is smaller (`zerofx.memory.pools`). What is
left to the allocator (collectives' results, ops returning several tensors, ops without an ``out=`` variant or with
one torch generated from the functional op, which allocates and copies, strided outputs) is counted by class in the
report.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import disable_fake_tensor_cache

from zerofx.memory.lifetimes import Lifetime, lifetimes, live_bytes, step_device
from zerofx.memory.pools import Placement, place, slot_alignment, slot_views
from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import add_call, fake_mode_of
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot, StepGraph, tag

aten = torch.ops.aten
# ops that allocate their result and copy into it, which their generated out= variants do once more: planned, they
# copy into their slot in place
_COPIES = {aten.clone.default, aten._to_copy.default}


def plan_memory(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the final graph (every other pass has run); ``ctx.memory_plan`` (False: unchanged). Guarantees: each
    planned node is replaced by its op's ``out=`` variant writing into views of the ``arena`` placeholder (a
    ``uint8`` tensor of ``ctx.artifacts["arena_bytes"]``, added) at its outputs' planned offsets; no two buffers alive
    at the same time overlap; values are unchanged. Leaves ``ctx.artifacts["memory_plan"]``: a `PlannedMemory`."""
    if not ctx.memory_plan:
        return gm
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    spans = lifetimes(graph)
    device = step_device(spans)
    by_node: dict[str, list[Lifetime]] = {}
    for span in spans:
        if not span.is_input and span.device == device:  # host copies (offloaded checkpoints) stay apart
            by_node.setdefault(span.node, []).append(span)
    chosen, others, left = [], [], Counter()
    grads_stay = not StepGraph(gm).placeholders(Role.GRAD_IN)
    for name, spans in by_node.items():
        reason = _why_not(nodes[name], spans, len(nodes), grads_stay)
        if reason is None:
            chosen.append(spans)
        else:
            others += spans
            left[reason] += sum(s.nbytes for s in spans)
    alignment = slot_alignment(device)
    chosen, placed = _fit_under_peak(chosen, others, len(nodes), left, alignment)
    if not chosen:
        return gm
    offsets: dict[str, list[int]] = {}
    for span, offset in zip(chosen, placed.offsets):
        offsets.setdefault(span.node, []).append(offset)
    planned = [(nodes[name], node_offsets) for name, node_offsets in offsets.items()]
    arena = _arena_placeholder(graph, placed.arena_bytes, chosen[0].device,
                               [(val, offset) for node, node_offsets in planned
                                for val, offset in zip(_outputs(node), node_offsets)])
    slot = 0
    for node, node_offsets in planned:
        _write_into_slots(graph, node, arena, range(slot, slot + len(node_offsets)))
        slot += len(node_offsets)
    _return_gradients_as_aliases(graph)
    ctx.artifacts["arena_bytes"] = placed.arena_bytes
    ctx.artifacts["memory_plan"] = PlannedMemory(len(chosen), sum(s.nbytes for s in chosen), placed.arena_bytes,
                                                 placed.lower_bound_bytes, dict(left), placed.layout,
                                                 placed.arena_bytes_by_layout)
    graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class PlannedMemory:
    """What `plan_memory` placed in the arena, and what it left to the allocator (bytes by reason)."""
    buffers: int
    planned_bytes: int
    arena_bytes: int
    lower_bound_bytes: int
    left: dict[str, int]
    layout: str  # one joint plan, or one pool per lifetime class (`zerofx.memory.pools`): the smaller
    arena_bytes_by_layout: dict[str, int]


def _why_not(node: fx.Node, spans: list[Lifetime], end_of_step: int, grads_stay: bool) -> str | None:
    """None if ``node``'s outputs can live in the arena, else why not (the report's reason). ``grads_stay``: what
    the step returns only as ``.grad`` may (the step reads no incoming gradient)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return "a collective or other call"
    if any(s.end >= end_of_step and not (grads_stay and s.returned_as == {Role.GRAD_OUT}) for s in spans):
        return "returned by the step"  # kept by the caller: a loss in a list would hold the arena
    vals = _outputs(node)
    if len(vals) != len(spans):
        return "outputs that are not tensors"
    if node.target in _COPIES:
        if not _copies_on_one_device(node):
            return "a copy to another device or layout"
    elif (variant := _out_variant(node.target)) is None or len(variant[1]) != len(vals):
        return f"no out= variant ({node.target.overloadpacket.__name__})"
    elif torch.Tag.generated in variant[0].tags:
        # torch made this out= variant from the functional op: it allocates the result as the op would, then copies
        return f"an out= variant that allocates and copies ({node.target.overloadpacket.__name__})"
    elif _mixes_floating_dtypes(node):
        # the fake kernels that gave the outputs' dtypes are not always the real ones' there (batch norm on a
        # bf16 input with fp32 weights: fp32 statistics, bf16 in the fake kernel), and an out= kernel checks them
        return f"arguments of several floating dtypes ({node.target.overloadpacket.__name__})"
    if not all(v.is_contiguous() and v.storage_offset() == 0
               and v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in vals):
        return "strided output"
    return None


def _fit_under_peak(chosen: list[list[Lifetime]], others: list[Lifetime], length: int, left: Counter,
                    alignment: int) -> tuple[list[Lifetime], Placement]:
    """The arena is held all step, the buffers left to the allocator come and go: planned, the step holds the
    arena's size plus the most those others hold at once, which exceeds the unplanned peak whenever the planned
    buffers are busiest at another time, or the arena has gaps. Leave to the allocator, largest first, planned
    buffers not alive where the others peak (and, while the planned ones peak elsewhere, alive where they do),
    until the arena fits in what the planned buffers hold where the others peak. Gradients the step leaves in the
    arena go last: left to the allocator, they would be allocated anew every step.

    The order they leave in follows from live bytes alone (`_leaving_order`); an arena takes a whole plan to size,
    so one is planned only at a few points along that order (`_earliest_fitting`), not after every buffer. Fitting
    can come and go along the order (the room shrinks as buffers leave, and the heuristics may pack fewer buffers
    worse), so the point found fits but may lie past an earlier one that also does: more buffers then go to the
    allocator than a plan after every buffer would send (on the test GPT's fp32 stage-0 step on one rank, 93 of 113
    buffers instead of 42; but planning after every buffer took its fp16 stage-1 build 6.7 s instead of 0.4).

    Returns the buffers that stay and their placement (heuristics only: the plan, and so the graph, is the same on
    every rank)."""
    chosen = sorted(chosen, key=lambda spans: (any(s.end >= length for s in spans), -sum(s.nbytes for s in spans)))
    leaving, fitting = _leaving_order(chosen, others, length)
    placements: dict[int, Placement] = {}  # by how many have left

    def placed_after(gone: int) -> Placement:
        if gone not in placements:
            placements[gone] = place(_staying(chosen, leaving[:gone]), alignment)
        return placements[gone]

    found = _earliest_fitting(len(fitting), lambda i: placed_after(fitting[i][0]).arena_bytes <= fitting[i][1])
    gone = len(leaving) if found is None else fitting[found][0]
    if gone:
        left["held where the planned buffers peak"] += sum(s.nbytes for spans in leaving[:gone] for s in spans)
    return _staying(chosen, leaving[:gone]), placed_after(gone)


def _leaving_order(chosen: list[list[Lifetime]], others: list[Lifetime],
                   length: int) -> tuple[list[list[Lifetime]], list[tuple[int, int]]]:
    """The planned buffers in the order they leave for the allocator, and, for each point along it (how many have
    left) where the planned buffers hold no more at their own peak than where the others peak, that point and the
    room there."""
    planned, rest = live_bytes([s for spans in chosen for s in spans], length), live_bytes(others, length)
    staying, leaving, fitting = list(chosen), [], []
    while True:
        at_rest_peak = int(rest.argmax())
        room = int(planned[at_rest_peak])
        at_planned_peak = int(planned.argmax()) if planned.max() > room else None
        if at_planned_peak is None:
            fitting.append((len(leaving), room))
        index = next((i for i, spans in enumerate(staying)
                      if (at_planned_peak is None or any(s.start <= at_planned_peak < s.end for s in spans))
                      and not any(s.start <= at_rest_peak < s.end for s in spans)), None)
        if index is None:
            return leaving, fitting
        leaving.append(staying.pop(index))
        for s in leaving[-1]:
            planned[s.start:s.end] -= s.nbytes
            rest[s.start:s.end] += s.nbytes


def _earliest_fitting(n: int, fits) -> int | None:
    """The earliest ``i < n`` found with ``fits(i)``, trying 0, 1, 3, 7, ... and then halving back from the first
    that fits: the earliest of all where fitting, once reached, stays so; where it comes and goes, one that fits,
    not always the earliest; None if none tried fits (a point between those tried may)."""
    known_not, i, step = -1, 0, 1
    while i < n and not fits(i):
        known_not, i, step = i, i + step, step * 2
    if i >= n:
        if known_not == n - 1 or not fits(n - 1):
            return None
        i = n - 1
    while i - known_not > 1:
        middle = (known_not + i) // 2
        if fits(middle):
            i = middle
        else:
            known_not = middle
    return i


def _staying(chosen: list[list[Lifetime]], leaving: list[list[Lifetime]]) -> list[Lifetime]:
    gone = {id(spans) for spans in leaving}
    return [s for spans in chosen if id(spans) not in gone for s in spans]


def _outputs(node: fx.Node) -> list:
    val = node.meta["val"]
    return [val] if isinstance(val, torch.Tensor) else list(val)


def _mixes_floating_dtypes(node: fx.Node) -> bool:
    """Whether ``node``'s tensor arguments that are not scalars come in more than one floating dtype."""
    dtypes = {a.meta["val"].dtype for a in node.all_input_nodes
              if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() > 0
              and a.meta["val"].is_floating_point()}
    return len(dtypes) > 1


def _copies_on_one_device(node: fx.Node) -> bool:
    """Whether a copy (``clone``, ``_to_copy``) stays on its input's device, strided and unpinned: what ``copy_``
    into a slot does the same."""
    source, result = node.args[0].meta["val"], node.meta["val"]
    kwargs = node.kwargs
    return (source.device == result.device and kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory"))


def _out_variant(op: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, list[str]] | None:
    """The overload of ``op``'s packet taking the same arguments plus the outputs to write (``out=``,
    ``out0=``..., ``grad_input=``), and those arguments' names."""
    signature = [(a.name, str(a.type)) for a in op._schema.arguments]  # pow(Tensor, number) is not pow(Tensor, Tensor)
    for overload in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, overload)
        arguments = candidate._schema.arguments
        outs = [a.name for a in arguments if a.is_out]
        if outs and [(a.name, str(a.type)) for a in arguments if not a.is_out] == signature:
            return candidate, outs
    return None


def _arena_placeholder(graph: fx.Graph, nbytes: int, device: torch.device,
                       slots: list[tuple[torch.Tensor, int]]) -> fx.Node:
    """The ``arena`` input: its slots, views of one ``uint8`` buffer of ``nbytes``, one per planned output (like
    ``val``, at byte ``offset``). The runtime makes them once (`CompiledGraph.arena`): a step picks them out of a
    list instead of slicing the arena again every time."""
    last_placeholder = [p for p in graph.nodes if p.op == "placeholder"][-1]
    with graph.inserting_after(last_placeholder):
        arena = graph.placeholder("arena")
    mode = fake_mode_of(graph)
    # a view op a slot, each with new arguments: torch's fake-op cache (one for the whole process) would keep
    # an entry for each as long as the process lives, a megabyte or more a plan
    with mode, disable_fake_tensor_cache(mode):
        raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        views = slot_views(raw, [(offset, val.dtype, val.shape) for val, offset in slots])
    arena.meta.update(val=views, **{TAG: NodeTag(Phase.FORWARD, 0, [Slot(Role.ARENA)])})
    return arena


def _write_into_slots(graph: fx.Graph, node: fx.Node, arena: fx.Node, slots: range) -> None:
    copy = node.target in _COPIES
    variant, out_names = (aten.copy_.default, ["out"]) if copy else _out_variant(node.target)
    outs = {}
    with graph.inserting_before(node):
        for name, slot in zip(out_names, slots):
            outs[name] = add_call(graph, operator.getitem, (arena, slot), like=node,
                                  val=arena.meta["val"][slot])
        written = (graph.call_function(variant, (outs["out"], node.args[0])) if copy
                   else graph.call_function(variant, node.args, {**node.kwargs, **outs}))
    written.meta.update(node.meta)
    node.replace_all_uses_with(written)
    graph.erase_node(node)


def _return_gradients_as_aliases(graph: fx.Graph) -> None:
    """Every ``.grad`` the step returns is a tensor of its own (an alias): never the same object as an arena slot,
    which an ``out=`` variant or an in-place op on its result (``grad.div_(2)``) returns. The runtime tells the
    caller's tensors from its own slots by counting them."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = list(output.args[0])
    for i, (value, slot) in enumerate(zip(values, tag(output).slots)):
        if slot.role == Role.GRAD_OUT and isinstance(value, fx.Node):
            with graph.inserting_before(output):
                values[i] = add_call(graph, aten.alias.default, (value,), like=value, val=value.meta["val"])
    output.args = (values,)
