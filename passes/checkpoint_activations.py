"""Activation checkpointing: a checkpointed region keeps its inputs, and backward recomputes what it needs from them.

Capture marks the forward nodes of each call of a checkpointed module (``zerofx.compile(checkpoint=...)``) with its
region. Backward reads some of those nodes' values (what autograd saved); this pass gives backward copies of the
region's nodes instead, placed just before backward first reads one, so the originals die as forward ends. A
region's outputs (read by forward after it) and collectives are not recomputed: they stay as saved. Stage 3 runs
after this pass, so a recomputed node reads its parameters the way backward does: gathered again, never saved.

With ``ctx.activation_budget`` (a fraction) a region keeps more than its inputs: of the values backward reads from
the regions, those worth most recompute time per byte are kept, up to that fraction of their bytes (a knapsack,
functorch's ``dp_knapsack``, over each value's bytes and its recompute cost: FLOPs, and at least one per element
for the memory-bound ops; a storage with the views and in-place writes onto it, such as a dropout mask, is one
item); the rest is recomputed. 1.0 recomputes nothing backward reads, 0.0 keeps only inputs.

Random ops draw what forward drew: when a random op is recomputed, the generator's state is read before the
region's first random op, every random op of the region is recomputed from that state, and the generator's state
is restored after the recompute, so a step is bitwise the step without checkpointing and later draws are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
from torch.utils.flop_counter import FlopCounterMode

from zerofx import collectives
from zerofx.errors import user_frame_from_stack_trace
from zerofx.passes.context import PassContext
from zerofx.passes.flat_collectives import CATEGORY, categorize
from zerofx.passes.graph_edit import RECOMPUTED, add_call, fake_mode_of
from zerofx.rng import GET, SET
from zerofx.step_graph import TAG, NodeTag, Phase, is_mutating, storage_root, tag, users_in
from zerofx.trace_events import REGION

log = logging.getLogger("zerofx")
aten = torch.ops.aten
# ops whose schema declares no write but that update the running statistics they are given (training batch norm)
_UPDATES_RUNNING_STATS = {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                          aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default}


def checkpoint_activations(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: a captured graph, forward nodes of checkpointed module calls marked ``node.meta[REGION]`` (none:
    the graph is left as it is). Guarantees: no backward node reads a value a region computed, other than the
    region's outputs; each region's needed nodes are copied (tagged backward, ``meta[RECOMPUTED]``) right before
    their first backward reader; random ops replay the forward's generator state. A region that writes into a
    tensor made outside it, or whose inputs are written before backward, is left as it is, with a warning. Leaves
    ``ctx.artifacts["recomputed"]``: region -> `Recomputed` (nodes copied, their FLOPs, the bytes of the
    activations the recompute starts from)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if REGION in node.meta and node.op == "call_function" and tag(node).phase == Phase.FORWARD:
            regions.setdefault(node.meta[REGION], []).append(node)
    writes_into: dict[fx.Node, list[fx.Node]] = {}  # storage root -> the in-place writes into it
    for node in graph.nodes:
        if is_mutating(node):
            writes_into.setdefault(storage_root(node), []).append(node)
    saved = set() if ctx.activation_budget is None else _kept_by_budget(graph, regions, ctx.activation_budget, order)
    recomputed = {}
    for name, members in regions.items():
        copies = _recompute(graph, name, members, saved, order, writes_into)
        if copies:
            recomputed[name] = Recomputed(len(copies), _flops(graph, copies), _checkpoint_bytes(copies))
    ctx.artifacts["recomputed"] = recomputed
    gm.recompile()
    return gm


@dataclass(frozen=True)
class Recomputed:
    nodes: int
    flops: int  # of the recomputed ops, by torch.utils.flop_counter (matmuls and attention)
    checkpoint_bytes: int  # the region's saved inputs that forward computed (not parameters or the batch)


def _recompute(graph: fx.Graph, name: str, members: list[fx.Node], saved: set[fx.Node],
               order: dict[fx.Node, int], writes_into: dict[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    member_set = set(members)
    kept = {m for m in members if _kept(m, member_set) or m in saved}
    read_back = [m for m in members if m not in kept and _backward_users(m)]
    if not read_back:
        return []
    needed = _closure(read_back, member_set, kept)
    # a draw recomputed replays the region's generator state: then every draw of the region runs again, in order
    randoms = [m for m in members if _is_random(m)] if any(_is_random(n) for n in needed) else []
    needed |= _closure(randoms, member_set, kept)
    first_read = min((u for m in read_back for u in _backward_users(m)), key=order.__getitem__)
    problem = _unsafe(needed, member_set, order, first_read, writes_into)
    if problem:
        log.warning("zerofx: region %s is not recomputed: %s", name, problem)
        return []
    states = _save_rng_states(graph, randoms)
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(first_read), _replaying(graph, states, first_read):
        for node in sorted(needed, key=order.__getitem__):
            copy = graph.node_copy(node, lambda n: copies.get(n, n))
            copy.meta[TAG] = NodeTag(Phase.BACKWARD, tag(first_read).microbatch)
            copy.meta[RECOMPUTED] = "checkpoint"
            del copy.meta[REGION]
            copies[node] = copy
    for member in read_back:
        for user in _backward_users(member):
            user.replace_input_with(member, copies[member])
    return list(copies.values())


def _kept_by_budget(graph: fx.Graph, regions: dict[str, list[fx.Node]], budget: float,
                    order: dict[fx.Node, int]) -> set[fx.Node]:
    """The region nodes backward keeps reading as saved: the storages the knapsack keeps within ``budget`` of the
    bytes backward reads from the regions, each with the views and in-place writes (a dropout mask's) onto it."""
    candidates, members_of = [], {}
    for members in regions.values():
        member_set = set(members)
        roots = {storage_root(m) for m in members if not _kept(m, member_set) and _backward_users(m)}
        chosen = sorted((r for r in roots if r in member_set and not _kept(r, member_set)), key=order.__getitem__)
        candidates += chosen
        members_of.update({r: [m for m in members if storage_root(m) is r] for r in chosen})
    sizes = [_nbytes(r) for r in candidates]
    if not candidates or sum(sizes) == 0:
        return set()
    if budget >= 1.0 or budget <= 0.0:
        keep = range(len(candidates)) if budget >= 1.0 else []
    else:  # the solver rounds each share to 1e-4: half a step of slack per item keeps what fits exactly
        costs = [_recompute_cost(graph, r) for r in candidates]
        _, keep, _ = dp_knapsack([s / sum(sizes) for s in sizes], costs, budget + len(sizes) * 5e-5)
    return {m for i in keep for m in members_of[candidates[i]]}


def _recompute_cost(graph: fx.Graph, node: fx.Node) -> float:
    """FLOPs of the op that makes ``node`` (an item of a tuple: the op's), at least one per element."""
    producer = node.args[0] if node.target is operator.getitem else node
    flops = _flops(graph, [producer])
    if producer.target is aten._scaled_dot_product_flash_attention_for_cpu.default:  # the counter skips it
        q, k = producer.args[0].meta["val"], producer.args[1].meta["val"]
        flops = 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return float(max(flops, node.meta["val"].numel()))


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0


def _kept(node: fx.Node, members: set[fx.Node]) -> bool:
    """A region output (forward reads it after the region), a collective, or a generator state read (the user's own
    ``torch.utils.checkpoint`` inside the region restores it in backward: read again there, it would redraw the
    dropout masks): saved, not recomputed."""
    if node.target in collectives.COLLECTIVES or getattr(node.target, "namespace", None) == "_c10d_functional":
        return True
    if node.target is GET:
        return True
    return any(u not in members and tag(u) is not None and tag(u).phase == Phase.FORWARD for u in node.users)


def _backward_users(node: fx.Node) -> list[fx.Node]:
    return users_in(node, Phase.BACKWARD)


def _is_random(node: fx.Node) -> bool:
    """An op that draws from a generator; attention with ``dropout_p`` 0 draws nothing."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" in names:
        i = names.index("dropout_p")
        return (node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)) != 0.0
    return True


def _closure(wanted: list[fx.Node], members: set[fx.Node], kept: set[fx.Node]) -> set[fx.Node]:
    """The members ``wanted`` depends on, through members that are not kept, with every in-place write into the
    storages they use (through views too)."""
    needed: set[fx.Node] = set()
    writes = [m for m in members if is_mutating(m)]
    frontier = list(wanted)
    while frontier:
        while frontier:
            node = frontier.pop()
            if node not in needed:
                needed.add(node)
                frontier += [a for a in node.all_input_nodes if a in members and a not in kept]
        roots = {storage_root(n) for n in needed}
        frontier = [w for w in writes if w not in needed and storage_root(w) in roots]
    return needed


def _described(node: fx.Node) -> str:
    """An op as a user knows it: its target, and the line of the user's code that ran it."""
    source = user_frame_from_stack_trace(node.meta.get("stack_trace"))
    return f"{node.target}" + (f" (at {source})" if source else "")


def _unsafe(needed: set[fx.Node], members: set[fx.Node], order: dict[fx.Node, int], first_read: fx.Node,
            writes_into: dict[fx.Node, list[fx.Node]]) -> str:
    """Why recomputing ``needed`` before ``first_read`` would not give the forward's values ('' if it would)."""
    for node in needed:
        if is_mutating(node) and storage_root(node) not in members:
            return f"{_described(node)} writes into a tensor made outside the region"
        if node.target in _UPDATES_RUNNING_STATS and node.args[3] is not None:
            return f"{_described(node)} would update its running statistics a second time"
    for node in needed:  # a value it reads, written in place after forward read it and before the recompute
        for value in node.all_input_nodes:
            if value in needed:
                continue
            for write in writes_into.get(storage_root(value), ()):
                if write not in needed and order[node] < order[write] < order[first_read]:
                    return f"{_described(write)} writes into {value.name}, which the recompute reads, after " \
                           f"forward read it"
    return ""


@contextlib.contextmanager
def _replaying(graph: fx.Graph, states: dict[torch.device, fx.Node], like: fx.Node):
    """Nodes added inside run from the forward's generator ``states``; the generators' current states are restored
    after them."""
    current = {device: add_call(graph, GET, (device,), like=like) for device in states}
    for device, state in states.items():
        add_call(graph, SET, (state, device), like=like)
    yield
    for device, state in current.items():
        add_call(graph, SET, (state, device), like=like)


def _save_rng_states(graph: fx.Graph, randoms: list[fx.Node]) -> dict[torch.device, fx.Node]:
    """Device -> a node reading that device's generator state just before the region's first random op on it."""
    states = {}
    for node in randoms:
        device = next(v for v in pytree.tree_leaves(node.meta["val"]) if isinstance(v, torch.Tensor)).device
        if device not in states:
            with graph.inserting_before(node):
                states[device] = add_call(graph, GET, (device,), like=node)
    return states


def _flops(graph: fx.Graph, nodes: list[fx.Node]) -> int:
    with fake_mode_of(graph), FlopCounterMode(display=False) as counter:
        for node in nodes:
            args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            node.target(*args, **kwargs)
    return counter.get_total_flops()


def _checkpoint_bytes(copies: list[fx.Node]) -> int:
    """Bytes of the distinct storages forward computed that the copies read (what the region keeps for them);
    marks them ``checkpoint`` for memory reports."""
    inside = set(copies)
    roots = {storage_root(a) for c in copies for a in c.all_input_nodes if a not in inside}
    kept = [categorize(r, "checkpoint") for r in roots if r.op == "call_function" and not r.meta.get(CATEGORY)]
    return sum(_nbytes(r) for r in kept)
