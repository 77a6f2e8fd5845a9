"""Collectives in flight are moved off the step's busiest moments: a wait comes before them, a prefetch after them.

An asynchronous collective holds a buffer from its issue to its wait: a reduce-scatter its packed gradients until it
is waited on, a prefetching all-gather its gathered parameters from its issue on. The passes that add them place
them for overlap (a bucket's wait where the next bucket is issued, a unit's gather when the previous unit starts);
where that window spans the most bytes the step holds (typically the MLP's backward, whose recomputed activations and
their gradients are the largest), those buffers are held at the peak for nothing. From the graph's lifetimes, this
pass moves each wait that frees a buffer, and each issue whose results are read later, to the position in its window
that leaves the fewest bytes alive at once; among equally good positions, the one that keeps the most overlap.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from zerofx import collectives
from zerofx.memory.lifetimes import Lifetime, lifetimes, live_bytes, step_device
from zerofx.passes.context import PassContext
from zerofx.step_graph import storage_root


@dataclass(frozen=True)
class _Window:
    """``node`` may sit anywhere in positions ``[first, last]``; the ``nbytes`` it holds or frees depend on where."""
    node: fx.Node
    first: int
    last: int
    nbytes: int
    frees: bool  # a wait: the bytes die where it sits; else an issue: they are born where it sits


def schedule_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the final graph but for memory planning; collectives issued by ``zerofx.collectives`` and completed
    by ``zerofx.collectives.wait(result, sent)``. Guarantees: every node still follows its inputs and precedes its
    users. While the step's peak (by lifetimes) lies in the window of a wait that is the last reader of what its
    collective sent (its inputs to where it was) or of an issue whose results nothing reads for a while (where it was
    to its first reader, or to a node that touches what it sends), such nodes move to where their window's most bytes
    alive at once are fewest, as long as that lowers the peak on the step's device (else nothing moves); a prefetch
    may then be issued later than ``ctx.prefetch`` units ahead. The same graph gives
    the same moves on every rank. Leaves ``ctx.artifacts["collectives_moved"]``."""
    graph = gm.graph
    nodes = list(graph.nodes)
    spans = _on_the_step_device(lifetimes(graph))
    live = live_bytes(spans, len(nodes))
    unmoved_peak = live.max(initial=0)
    windows = _windows(nodes, spans)
    places: dict[fx.Node, tuple[fx.Node, str]] = {}
    while True:  # a round moves what spans the peak, and is kept only if the peak falls
        peak, trial, moves = live.max(initial=0), live.copy(), {}
        for window in windows:
            if window.node not in places and trial[window.first:window.last + 1].max() == peak:
                moves[window.node] = _move(window, trial, nodes)
        moves = {node: place for node, place in moves.items() if place is not None}
        if not moves or trial.max() >= peak:
            break
        places.update(moves)
        live = trial
    places = {node: (anchor, where) for node, (anchor, where) in places.items() if anchor not in places}
    _place(places)
    if places and (not _ordered(graph)
                   or live_bytes(_on_the_step_device(lifetimes(graph)), len(nodes)).max() >= unmoved_peak):
        for earlier, later in zip(nodes, nodes[1:]):  # back to the order as it was
            earlier.append(later)
        places = {}
    ctx.artifacts["collectives_moved"] = len(places)
    if places:
        gm.recompile()
    return gm


def _on_the_step_device(spans: list[Lifetime]) -> list[Lifetime]:
    """The peak that matters is the device's: host copies (offloaded checkpoints) are held apart."""
    device = step_device(spans)
    return [s for s in spans if s.device == device]


def _place(places: dict[fx.Node, tuple[fx.Node, str]]) -> None:
    """Move each node before or after its anchor; nodes sharing an anchor keep their order among themselves."""
    for node, (anchor, where) in places.items():
        if where == "before":  # in graph order: each goes just before the anchor, after the ones already there
            anchor.prepend(node)
    for node, (anchor, where) in reversed(places.items()):
        if where == "after":  # in reverse graph order: each goes just after the anchor, before those placed already
            anchor.append(node)


def _windows(nodes: list[fx.Node], spans: list[Lifetime]) -> list[_Window]:
    position = {n: i for i, n in enumerate(nodes)}
    defined: dict[str, list[Lifetime]] = {}
    for span in spans:
        defined.setdefault(span.node, []).append(span)
    waits = [w for w in (_wait_window(n, position, defined) for n in nodes) if w is not None]
    waited_early = {_issue_of(w.node) for w in waits}  # such a collective's issue stays: its bytes die at its wait
    issues = [w for w in (_issue_window(n, position, defined, nodes) for n in nodes if n not in waited_early)
              if w is not None]
    return waits + issues


def _wait_window(node: fx.Node, position: dict, defined: dict) -> _Window | None:
    """A wait that is the last reader of the buffer its collective sent may move up to just after its inputs."""
    if node.op != "call_function" or node.target is not collectives.wait or len(node.args) < 2 \
            or not isinstance(node.args[1], fx.Node):
        return None
    sent = [s for s in defined.get(storage_root(node.args[1]).name, []) if s.end == position[node] + 1]
    if not sent:
        return None  # read after its wait too: waiting earlier frees nothing
    first = max(position[a] for a in node.all_input_nodes) + 1
    return _Window(node, first, position[node], sum(s.nbytes for s in sent), frees=True)


def _issue_window(node: fx.Node, position: dict, defined: dict, nodes: list[fx.Node]) -> _Window | None:
    """A collective whose results are first read later may be issued up to just before that read, or before any
    node that reads or writes what it sends (an in-place update, an average divided in place at issue)."""
    if node.op != "call_function" or node.target not in collectives.COLLECTIVES or not node.users:
        return None
    born = [s for s in defined.get(node.name, []) if s.start == position[node]]
    last = min(position[u] for u in node.users) - 1
    sent = {storage_root(a) for a in node.all_input_nodes}
    for later in nodes[position[node] + 1:last + 1]:  # what it sends is read (or written) there: it stays before
        if any(storage_root(a) in sent for a in later.all_input_nodes):
            last = position[later] - 1
            break
    return _Window(node, position[node], last, sum(s.nbytes for s in born), frees=False)


def _issue_of(wait: fx.Node) -> fx.Node:
    result = wait.args[0]
    return result.args[0] if result.target is operator.getitem else result  # one result of a coalesced collective


def _move(window: _Window, live: np.ndarray, nodes: list[fx.Node]) -> tuple[fx.Node, str] | None:
    """Where ``window.node`` leaves the window's most bytes alive at once fewest (``live`` updated to match), as
    (the node it goes before or after, "before" or "after"); None where it is best where it is."""
    span = live[window.first:window.last + 1]
    if window.frees:  # sitting before position first + k: the bytes are alive on [first, first + k)
        with_buffer = np.maximum.accumulate(np.concatenate(([0], span)))[:-1]
        without = np.maximum.accumulate((span - window.nbytes)[::-1])[::-1]
        cost = np.maximum(with_buffer, without)
        k = len(cost) - 1 - int(cost[::-1].argmin())  # the latest of the best: the most overlap
    else:  # sitting after position first + k: the bytes are alive on (first + k, last]
        without = np.maximum.accumulate(span - window.nbytes)
        with_buffer = np.concatenate((np.maximum.accumulate(span[::-1])[::-1][1:], [0]))
        cost = np.maximum(without, with_buffer)
        k = int(cost.argmin())  # the earliest of the best: the most overlap
    anchor = nodes[window.first + k]
    if cost[k] >= span.max() or anchor is window.node:
        return None
    if window.frees:
        live[window.first + k:window.last + 1] -= window.nbytes
        return anchor, "before"
    live[window.first:window.first + k + 1] -= window.nbytes
    return anchor, "after"


def _ordered(graph: fx.Graph) -> bool:
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        if any(a not in seen for a in node.all_input_nodes):
            return False
        seen.add(node)
    return True
