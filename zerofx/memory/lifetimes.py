"""Lifetimes of every buffer a step graph allocates, in execution order: what memory planning works from.

A buffer is the storage behind a node's output (or each tensor of a node that returns several). It is defined where
its node runs and lives until the last node that reads it or anything aliasing it: a view, an in-place update's
result, a collective's ``wait`` (so a collective's output lives until it is waited on and read, and a collective's
input until its wait: zerofx's waits take it as an argument for that reason, and the input of a functional collective
DTensor issued counts as read at its ``wait_tensor``). The step's inputs (parameters or their shards,
optimizer state, the batch) exist before the step and after it; what the graph returns lives to the end. Each buffer
has its bytes and its class, the categories the memory reports use (``zerofx.memory.tracking``); as there, a buffer
that a gradient or a gathered parameter aliases (a view of the ``mm`` that computed it) is of that class.

Lifetimes are half-open positions ``[start, end)`` over the graph's nodes, as `zerofx.memory.plan` takes them.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from zerofx import collectives
from zerofx.memory.planner import Block
from zerofx.memory.pools import Placement, place, slot_alignment
from zerofx.memory.tracking import category_of
from zerofx.step_graph import Role, aliases_first_arg, tag

_ALIASING_CALLS = (collectives.wait, collectives.all_reduce)  # Python functions in the graph that return their input
_CLAIMING = ("grads", "gathered_params")  # classes an alias gives the buffer it views (`StepProbe` does the same)


@dataclass(frozen=True)
class Lifetime:
    node: str  # the defining node's name
    index: int | None  # which of its outputs, where it returns several
    nbytes: int
    start: int
    end: int  # exclusive
    category: str  # params, optimizer_states, grads, gathered_params, checkpoints, activations, ...
    device: torch.device
    is_input: bool  # a graph input: it exists before the step and after it
    returned_as: frozenset[Role | None] = frozenset()  # the roles of the step's outputs that return it (None: untagged)

    @property
    def name(self) -> str:
        return self.node if self.index is None else f"{self.node}[{self.index}]"

    def block(self) -> Block:
        return Block(self.nbytes, self.start, self.end, self.name)


def lifetimes(graph: fx.Graph) -> list[Lifetime]:
    """The lifetime of every buffer ``graph`` reads or allocates, in order of definition."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    buffers = _Buffers()
    last_use: dict[tuple[fx.Node, int | None], int] = {}
    defined: list[tuple[fx.Node, int | None, torch.Tensor]] = []
    claimed: dict[tuple[fx.Node, int | None], str] = {}  # buffers an alias gives its class
    returned_as: dict[tuple[fx.Node, int | None], set[Role | None]] = {}
    for node in nodes:
        used_until = len(nodes) - 1 if node.op == "output" else position[node]  # returned: alive to the end
        for key in buffers.read_by(node) | buffers.read_by(_functional_collective_waited(node)):
            last_use[key] = used_until
        if node.op == "output":
            for key, role in _returned(node, buffers):
                returned_as.setdefault(key, set()).add(role)
            continue
        if not buffers.follow(node):
            defined += buffers.define(node)
        elif category_of(node) in _CLAIMING:
            claimed.update((key, category_of(node)) for key in buffers.keys[node] if key is not None)
    out = []
    for node, index, val in defined:
        placeholder = node.op in ("placeholder", "get_attr")  # the graph module's own tensors exist all along
        start = 0 if placeholder else position[node]
        end = len(nodes) if placeholder else max(last_use.get((node, index), start), start) + 1
        category = claimed.get((node, index), category_of(node))
        out.append(Lifetime(node.name, index, val.untyped_storage().nbytes(), start, end, category, val.device,
                            placeholder, frozenset(returned_as.get((node, index), ()))))
    return out


def _returned(output: fx.Node, buffers: _Buffers) -> list[tuple[tuple[fx.Node, int | None], Role | None]]:
    """(buffer, role of the output returning it) for every buffer the step returns."""
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    slots = tag(output).slots if tag(output) is not None else []
    roles = [s.role for s in slots] if len(slots) == len(values) else [None] * len(values)
    return [(key, role) for value, role in zip(values, roles) if isinstance(value, fx.Node)
            for key in buffers.keys.get(value, ()) if key is not None]


class _Buffers:
    """Which buffers each node's value is: a buffer is (defining node, output index or None); a node that returns
    several tensors has one per output (None where an output is not a tensor)."""

    def __init__(self):
        self.keys: dict[fx.Node, list[tuple[fx.Node, int | None] | None]] = {}
        self._attrs: dict[str, tuple[fx.Node, None]] = {}  # a module attribute read twice is one buffer

    def define(self, node: fx.Node) -> list[tuple[fx.Node, int | None, torch.Tensor]]:
        val = node.meta.get("val")
        if node.op == "get_attr" and node.target in self._attrs:
            self.keys[node] = [self._attrs[node.target]]
            return []
        if isinstance(val, torch.Tensor):
            if node.op == "get_attr":
                self._attrs[node.target] = (node, None)
            self.keys[node] = [(node, None)]
            return [(node, None, val)]
        if not isinstance(val, (list, tuple)):
            return []
        keys, defined, first_in = [], [], {}  # views of one storage (the arena's slots) are one buffer
        for i, t in enumerate(val):
            if not isinstance(t, torch.Tensor):
                keys.append(None)
                continue
            storage = StorageWeakRef(t.untyped_storage()).cdata
            if storage not in first_in:
                first_in[storage] = (node, i)
                defined.append((node, i, t))
            keys.append(first_in[storage])
        self.keys[node] = keys
        return defined

    def follow(self, node: fx.Node) -> bool:
        """Record ``node`` as aliasing buffers it reads (a view, an in-place result, a wait, an element of a list,
        what an ``out=`` variant wrote); False if its value is new."""
        written = _written_arguments(node) or _returned_inputs(node)
        if written and all(w in self.keys for w in written):
            self.keys[node] = [k for w in written for k in self.keys[w]]
            return True
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        first = node.args[0]
        if first not in self.keys:
            return False
        if node.target is operator.getitem:
            self.keys[node] = [self.keys[first][node.args[1]]]
            return True
        if aliases_first_arg(node) or node.target in _ALIASING_CALLS:
            val = node.meta.get("val")
            views = len(val) if isinstance(val, (list, tuple)) and len(self.keys[first]) == 1 else 1
            self.keys[node] = self.keys[first] * views  # split, unbind: every piece is a view of the one buffer
            return True
        return False

    def read_by(self, node: fx.Node | None) -> set[tuple[fx.Node, int | None]]:
        if node is None:
            return set()
        return {k for arg in node.all_input_nodes for k in self.keys.get(arg, ()) if k is not None}


def _functional_collective_waited(node: fx.Node) -> fx.Node | None:
    """The functional collective (one DTensor issued) a ``wait_tensor`` completes: its input is read until then,
    by the backend's own stream or thread."""
    if node.target is torch.ops._c10d_functional.wait_tensor.default and isinstance(node.args[0], fx.Node):
        issued = node.args[0]
        if getattr(issued.target, "namespace", None) == "_c10d_functional":
            return issued
    return None


def _returned_inputs(node: fx.Node) -> list[fx.Node]:
    """What a collective on a group of one rank returns: its input (`collectives.IDENTITY_ON_ONE_RANK`)."""
    if node.op != "call_function" or node.target not in collectives.IDENTITY_ON_ONE_RANK:
        return []
    bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
    if bound["group_size"] != 1:
        return []
    inputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    return [i for i in inputs if isinstance(i, fx.Node)]


def _written_arguments(node: fx.Node) -> list[fx.Node]:
    """The buffers an ``out=`` variant writes into and returns (``out``, ``out0``..., ``grad_input``)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    written = [node.kwargs.get(a.name) for a in schema.arguments if a.is_out]
    return [w for w in written if isinstance(w, fx.Node)]


def live_bytes(spans: list[Lifetime], length: int) -> np.ndarray:
    """Bytes alive at each of ``length`` positions."""
    delta = np.zeros(length + 1, dtype=np.int64)
    for s in spans:
        delta[s.start] += s.nbytes
        delta[s.end] -= s.nbytes
    return np.cumsum(delta)[:length]


def peak_live(spans: list[Lifetime]) -> tuple[int, int]:
    """(the most bytes alive at once, the first position where they are)."""
    live = live_bytes(spans, max((s.end for s in spans), default=0))
    at = int(live.argmax()) if len(live) else 0
    return (int(live[at]) if len(live) else 0), at


@dataclass(frozen=True)
class StepMemoryPlan:
    """The step's own buffers (not its inputs, which exist before and after it) placed in one arena."""
    spans: list[Lifetime]  # every buffer, inputs included
    placement: Placement  # of the step's own buffers on the step's device, jointly or pooled by class

    def largest_at_peak(self, most: int = 5) -> list[Lifetime]:
        """The largest buffers alive when the most bytes are (inputs included)."""
        _, at = peak_live(self.spans)
        alive = [s for s in self.spans if s.start <= at < s.end]
        return sorted(alive, key=lambda s: -s.nbytes)[:most]


def step_device(spans: list[Lifetime]) -> torch.device:
    """The device holding most of the step's input bytes (its parameters and state)."""
    inputs = [s for s in spans if s.is_input] or spans
    nbytes: dict[torch.device, int] = {}
    for s in inputs:
        nbytes[s.device] = nbytes.get(s.device, 0) + s.nbytes
    return max(nbytes, key=nbytes.__getitem__)


def plan_step(graph: fx.Graph) -> StepMemoryPlan:
    spans = lifetimes(graph)
    device = step_device(spans)
    planned = [s for s in spans if not s.is_input and s.device == device]  # host copies stay apart
    return StepMemoryPlan(spans, place(planned, slot_alignment(device)))
