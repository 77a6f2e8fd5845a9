"""The graph a step runs: the final graph with each ATen call made through torch's own Python binding of that op
(``x.view(-1)``, ``torch.mm(a, b)``) wherever that binding dispatches to exactly the overload the graph names, with
exactly the graph's arguments in their places.

The graph's ``torch.ops.aten.view.default(x, [-1])`` parses its arguments against the op's schema at every call,
which costs 1-4 µs more than the binding's generated parser: over the thousand-odd calls of a training step that is
a few percent of a small model's step time on a CPU. Each candidate binding is called once per (overload, argument
kinds: Python types, and dtype and dimensions of tensors) on fresh fake tensors, under a mode that records what it
dispatches; it is used only if it dispatched that overload alone, with the same tensors in the same order and the
same other arguments. A method is tried only for an op whose first argument is ``self`` (``where(condition, self,
other)`` is not ``condition.where(...)``) and no ``out=``, which no method takes; nothing is tried for an ``out=``
variant torch made up from its functional op (tagged ``generated``, and not a ``view_copy``, whose bindings torch
does make), which no binding takes: a binding that refuses its arguments throws a C++ exception, whose unwinding
pages in tables (a megabyte of them over a planned step's ``out=`` calls) the process would otherwise never read.

The graph kept for dumps, statistics and memory probes is left as it was: a copy is rewritten, its code generated,
and the copy let go (a graph with its nodes is a megabyte or two of Python objects on a small model, held as long as
the step is cached).
"""

from __future__ import annotations

import functools
import itertools
import linecache
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from zerofx.passes.graph_edit import fake_mode_of

_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn)
_METHOD_FOR = {"_local_scalar_dense": "item"}  # overloads whose binding has another name


class Runnable:
    """``gm``'s step as the code of a rewritten copy of its graph (`bindings_graph`), reading ``gm``'s attributes as
    ``gm``'s own code does; the copy is not kept. The code comes in pieces of at most ``nodes_per_piece`` nodes
    (`_pieces`), each compiled on its own: made as one function, the code of a 2,100-node step peaks at 13 MB of
    Python objects as it is compiled, in pieces of 128 nodes at 5 MB."""

    _sources = itertools.count()

    def __init__(self, gm: fx.GraphModule, graph: fx.Graph, nodes_per_piece: int = 128):
        gm.code  # noqa: B018: a lazily compiled module sets what its code reads (pytree specs) as it first makes it
        number = next(self._sources)
        self._codegen = graph._codegen  # how the graph's callers pass inputs and take outputs (pytrees, say)
        self._pieces, sources = [], []
        for i, piece in enumerate(_pieces(graph, nodes_per_piece)):
            python_code = piece.python_code(root_module="self")
            filename = f"<zerofx step {number} piece {i}>"
            linecache.cache[filename] = (len(python_code.src), None, python_code.src.splitlines(True), filename)
            exec(compile(python_code.src, filename, "exec", dont_inherit=True), python_code.globals)
            self._pieces.append(functools.partial(python_code.globals["forward"], gm))
            sources.append(python_code.src)
        self.code = "".join(sources)

    def __call__(self, *inputs):
        inputs, carried = self._codegen.process_inputs(*inputs), []
        for piece in self._pieces:
            carried = piece(inputs, carried)
        return self._codegen.process_outputs(carried)


class _PieceCodeGen(fx.graph.CodeGen):
    """The code of a piece: ``forward(self, inputs, carried)`` reads the step's inputs it uses by position and takes
    the values earlier pieces computed from ``carried``, which it empties, so that its own names are their only
    holders and its code frees each after its last use; it returns the values later pieces read, in a new list."""

    def __init__(self, num_carried: int, input_positions: list[int]):
        super().__init__()
        self.num_carried, self.input_positions = num_carried, input_positions

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **kwargs) -> str:
        names = free_vars[1:] if free_vars and free_vars[0] == "self" else free_vars
        carried, taken = names[:self.num_carried], names[self.num_carried:]
        lines = [f"def forward(self, inputs, carried){maybe_return_annotation}:"]
        if carried:
            lines += [f"    {', '.join(carried)}, = carried", "    carried.clear()"]
        if taken:
            lines.append(f"    {', '.join(taken)}, = {', '.join(f'inputs[{i}]' for i in self.input_positions)},")
        return "\n".join(lines)


def _pieces(graph: fx.Graph, nodes_per_piece: int) -> list[fx.Graph]:
    """``graph`` cut, in order, into graphs of at most ``nodes_per_piece`` nodes with `_PieceCodeGen`'s code: each
    piece's inputs are the step's inputs it reads and the values earlier pieces computed that it or a later one reads
    (carried, in graph order); the last piece returns what ``graph`` returns."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
    output = nodes[-1]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    chunks = [body[i:i + nodes_per_piece] for i in range(0, len(body), nodes_per_piece)] or [[]]
    chunk_of = {n: k for k, chunk in enumerate(chunks) for n in chunk}
    chunk_of[output] = len(chunks) - 1
    last_read = {n: max(chunk_of[u] for u in n.users) for n in body if n.users}
    pieces, carried = [], []
    for k, chunk in enumerate(chunks):
        read = {a for n in chunk + ([output] if k == len(chunks) - 1 else []) for a in n.all_input_nodes}
        taken = sorted((a for a in read if a.op == "placeholder"), key=position.__getitem__)
        piece = fx.Graph()
        piece._codegen = _PieceCodeGen(len(carried), [position[a] for a in taken])
        copies = {a: piece.placeholder(a.name) for a in [*carried, *taken]}
        for n in chunk:
            copies[n] = piece.node_copy(n, copies.__getitem__)
        carried = [n for n in [*carried, *chunk] if last_read.get(n, -1) > k]
        if k == len(chunks) - 1:
            piece.output(fx.map_arg(output.args[0], copies.__getitem__))
        else:
            piece.output([copies[n] for n in carried])
        pieces.append(piece)
    return pieces


def fast_calls(gm: fx.GraphModule) -> Runnable:
    """``gm``'s step to run: its ATen calls through the bindings that dispatch to the same overloads, its other
    nodes as they were. Needs the nodes' ``val`` metadata (capture gives it); values are bitwise unchanged."""
    return Runnable(gm, bindings_graph(gm))


def bindings_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm``'s graph with its ATen calls through the bindings that dispatch to the same overloads (none
    where the graph has no ``val`` metadata to check them on), and no metadata."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    try:
        _rewrite_calls(list(copies.values()), fake_mode_of(gm.graph))
    except ValueError:  # no fake metadata to check bindings on: the graph's calls as they are
        pass
    for node in copies.values():
        node.meta = {}  # read by the checks only
    return graph


def _rewrite_calls(nodes: list[fx.Node], fake_mode) -> None:
    checked: dict[tuple, tuple[str, Any] | None] = {}
    for node in nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        key = (node.target, _argument_kinds(node))
        if key not in checked:
            checked[key] = _binding_of(node, fake_mode)
        if checked[key] is not None:
            node.op, node.target = checked[key]


def _argument_kinds(node: fx.Node) -> tuple:
    """What decides whether a binding fits: the structure of the arguments and each leaf's kind."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    return str(spec), tuple(_kind_of(leaf) for leaf in leaves)


def _kind_of(leaf: Any) -> Any:
    value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf
    if isinstance(value, torch.Tensor):
        return torch.Tensor, value.dtype, value.dim()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return type(value), tuple((v.dtype, v.dim()) for v in value)
    return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}.get(type(value), type(value))


def _binding_of(node: fx.Node, fake_mode) -> tuple[str, Any] | None:
    """``("call_method", name)`` or ``("call_function", fn)`` whose call on stand-ins of ``node``'s arguments
    dispatches exactly ``node.target`` with those arguments in the same places, and nothing else; None if none does."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    if any(isinstance(n, fx.Node) and "val" not in n.meta for n in leaves):
        return None
    name = node.target.overloadpacket.__name__
    schema = node.target._schema
    writes_out = any(a.is_out for a in schema.arguments)
    if writes_out and torch.Tag.generated in node.target.tags and torch.Tag.view_copy not in node.target.tags:
        return None  # an out= variant made up from the functional op: no binding takes its out=
    candidates: list[tuple[str, Any]] = []
    if schema.arguments and schema.arguments[0].name == "self" and node.args and not writes_out \
            and isinstance(node.args[0], fx.Node) and isinstance(node.args[0].meta["val"], torch.Tensor):
        method = _METHOD_FOR.get(name, name)  # (no method takes out=)
        if hasattr(torch.Tensor, method):
            candidates.append(("call_method", method))
    candidates += [("call_function", getattr(ns, name)) for ns in _NAMESPACES if hasattr(ns, name)]
    for kind, target in candidates:
        with fake_mode:
            args, kwargs = pytree.tree_map(_sample, (node.args, node.kwargs))
        call: Callable = getattr(args[0], target) if kind == "call_method" else target
        recorded = _Recorder()
        try:
            with _quiet_fake_tensors(), fake_mode, recorded:
                call(*(args[1:] if kind == "call_method" else args), **kwargs)
        except Exception:  # noqa: BLE001: a binding that cannot take these arguments is simply not used
            continue
        if recorded.calls == [(node.target, _same_places(args, kwargs))]:
            return kind, target
    return None


def _same_places(args, kwargs) -> list:
    """The arguments as the dispatcher sees them, flattened: tensors by identity, the rest by value."""
    return [id(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in pytree.tree_leaves((args, kwargs))]


class _quiet_fake_tensors:
    """Fake tensors log every meta kernel that raises; a binding that does not fit is expected to, quietly."""

    def __enter__(self):
        self.logger = logging.getLogger("torch._subclasses.fake_tensor")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _sample(leaf: Any) -> Any:
    """A fresh stand-in of the same Python type (tensors: same shape, strides, dtype and device), so that checking a
    binding never changes the graph's metadata, even through an in-place op."""
    if not isinstance(leaf, fx.Node):
        return leaf
    value = leaf.meta.get("val")
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, torch.Tensor):
        return _fresh(value)
    kind = _kind_of(leaf)
    return kind(1) if kind in (int, float, bool) else value


def _fresh(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


class _Recorder(TorchDispatchMode):
    """The ops a call dispatches with their arguments (`_same_places`), less the metadata queries fake tensors make
    (``prim.device``)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch._ops.OpOverload, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim":
            self.calls.append((func, _same_places(args, kwargs)))
        return func(*args, **kwargs)
