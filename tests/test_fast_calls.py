"""`zerofx.fast_calls`: the graph a step runs calls torch's bindings only where they dispatch to the very overload
the graph names, and computes bitwise what the graph computes."""

import gc
import sys
import weakref

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from zerofx.fast_calls import Runnable, bindings_graph, fast_calls

aten = torch.ops.aten


def _step(x, w, b, s):
    h = aten.addmm.default(b, x, aten.t.default(w))
    h = aten.mul.Tensor(aten.add.Tensor(h, 1.5), 0.5)  # Python numbers: resolved as wrapped-number tensors
    h = aten.add.Scalar(h, 2)  # the binding torch.add(h, 2) would reach add.Tensor instead
    h = aten.pow.Tensor_Scalar(h, 2)
    h = aten.div.Tensor_mode(h, 3.0, rounding_mode="floor")
    out, mean, rstd = aten.native_layer_norm.default(h, [h.shape[-1]], None, None, 1e-5)
    scale = aten._local_scalar_dense.default(aten.sum.default(s))  # a Python float at run time
    parts = aten.split.Tensor(aten.view.default(out, [-1]), 5)
    flat = aten.cat.default([parts[1], parts[0]])
    s.mul_(scale)  # in place, on an input
    above = aten.gt.Scalar(h, 0.0)
    # condition first: above.where(a, b) would mean where(a, above, b), and with bool tensors it would even run
    picked = aten.where.self(above, aten.lt.Scalar(h, 1.0), above)
    signed = aten.where.self(above, h, aten.neg.default(h))  # the same overload, other dtypes
    reshaped = aten.clone.default(s)
    aten.unsqueeze_.default(reshaped, 0)  # changes its tensor's shape: a check on the graph's own values would too
    return aten.mul.Tensor(flat, scale), mean, rstd, picked, signed, reshaped


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 6, generator=g), torch.randn(5, 6, generator=g), torch.randn(5, generator=g),
            torch.randn(2, generator=g))


def _traced():
    return make_fx(_step, tracing_mode="fake")(*_inputs())


def test_runs_bitwise_as_the_graph_and_mutates_inputs_alike():
    gm = _traced()
    want_inputs, got_inputs = _inputs(), _inputs()
    want, got = gm(*want_inputs), fast_calls(gm)(*got_inputs)
    for a, b in zip(want + want_inputs, got + got_inputs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_in_pieces_runs_bitwise_as_the_graph_and_mutates_inputs_alike():
    gm = _traced()
    want_inputs, got_inputs = _inputs(), _inputs()
    runnable = Runnable(gm, bindings_graph(gm), nodes_per_piece=2)
    want, got = gm(*want_inputs), runnable(*got_inputs)
    for a, b in zip(want + want_inputs, got + got_inputs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    body = len(gm.graph.nodes) - 4 - 1  # less the four inputs and the output
    assert runnable.code.count("def forward(self, inputs, carried)") == (body + 1) // 2


_WATCHED: list[weakref.ref] = []


def _made(x):
    return x * 2


def _watched_sum(t):
    _WATCHED.append(weakref.ref(t))
    return t.sum()


def _still_alive(_):
    return [ref() is not None for ref in _WATCHED]


def test_a_value_carried_between_pieces_is_freed_after_its_last_use_as_in_one_piece():
    """``made`` comes from the first piece; the second reads it for the last time and then asks whether it is
    alive: only the piece's own name held it, and the list it came in was emptied."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    made = graph.call_function(_made, (x,))
    other = graph.call_function(torch.neg, (x,))
    total = graph.call_function(_watched_sum, (made,))
    alive = graph.call_function(_still_alive, (total,))
    graph.output((alive, other))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    for nodes_per_piece in (2, 100):
        _WATCHED.clear()
        alive, other = Runnable(gm, graph, nodes_per_piece)(torch.ones(3))
        assert alive == [False] and torch.equal(other, -torch.ones(3))


def test_an_overload_no_binding_reaches_keeps_its_overload():
    graph = bindings_graph(_traced())
    left = {n.target for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    assert aten.add.Scalar in left  # torch.add(h, 2) dispatches add.Tensor: not the same call
    rewritten = {n.target for n in graph.nodes if n.op in ("call_method", "call_function")} - left
    assert {"t", "view", "item", "split", "mul"} <= {getattr(t, "__name__", t) for t in rewritten}
    assert aten.mul.Tensor not in left and aten.addmm.default not in left
    assert "where" not in {n.target for n in graph.nodes if n.op == "call_method"}
    code = fast_calls(_traced()).code  # what runs is that graph's code
    assert "torch.ops.aten.add.Scalar(" in code and "torch.ops.aten.addmm.default(" not in code


def _writes_out(x, w, table, idx, mm, total, looked_up, normed, mean, rstd, turned):
    aten.mm.out(x, w, out=mm)
    aten.sum.IntList_out(x, [0], out=total)
    aten.embedding.out(table, idx, out=looked_up)  # an out= variant made up from embedding: no binding takes it
    aten.native_layer_norm.out(x, [x.shape[-1]], None, None, 1e-5, out0=normed, out1=mean, out2=rstd)
    aten.permute_copy.out(x, [1, 0], out=turned)  # made up too, but a view_copy: torch.permute_copy takes out=
    return mm, total, looked_up, normed, mean, rstd, turned


def _out_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 6, generator=g), torch.randn(6, 3, generator=g), torch.randn(7, 6, generator=g),
            torch.tensor([0, 3, 6]), torch.empty(4, 3), torch.empty(6), torch.empty(3, 6), torch.empty(4, 6),
            torch.empty(4, 1), torch.empty(4, 1), torch.empty(6, 4))


def test_out_variants_find_their_bindings_without_trying_ones_that_cannot_take_out():
    """Methods take no ``out=``, nor do the bindings of most out= variants made up from functional ops: trying them
    raises (a C++ exception, which pages in unwinding tables the process would not touch otherwise); seen here as
    no exception reaching `fast_calls`'s frames."""
    gm = make_fx(_writes_out, tracing_mode="fake")(*_out_inputs())
    raised = []

    def trace(frame, event, arg):
        if event == "exception" and frame.f_code.co_filename.endswith("fast_calls.py") \
                and not issubclass(arg[0], (GeneratorExit, StopIteration)):  # generators closing, not errors
            raised.append(arg[1])
        return trace

    previous = sys.gettrace()  # a coverage tool's or a debugger's
    sys.settrace(trace)
    try:
        graph = bindings_graph(gm)
    finally:
        sys.settrace(previous)
    assert raised == []
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.mm in targets and torch.sum in targets and torch.permute_copy in targets
    assert aten.embedding.out in targets and aten.native_layer_norm.out in targets
    want, got = gm(*_out_inputs()), fast_calls(gm)(*_out_inputs())
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_the_graph_it_was_made_from_is_left_as_it_was_and_no_copy_is_kept():
    gm = _traced()
    before = [(n.op, n.target, n.args, n.meta["val"].shape if isinstance(n.meta.get("val"), torch.Tensor) else None)
              for n in gm.graph.nodes]
    gc.collect()
    nodes_alive = _nodes_alive()
    fast = fast_calls(gm)
    gc.collect()
    after = [(n.op, n.target, n.args, n.meta["val"].shape if isinstance(n.meta.get("val"), torch.Tensor) else None)
             for n in gm.graph.nodes]
    assert before == after
    assert _nodes_alive() == nodes_alive  # it only runs: the rewritten copy went once its code was made
    assert not [n for n in bindings_graph(gm).nodes if n.meta]
    fast(*_inputs())


def _nodes_alive() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is fx.Node)


def test_a_lazily_compiled_graph_taking_and_returning_pytrees_runs_as_the_graph_does():
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    inputs = {"a": torch.randn(3), "b": torch.randn(3)}
    with _use_lazy_graph_module(True):  # its code, and the input and output specs that code reads, made on demand
        gm = make_fx(lambda d: {"sum": aten.add.Tensor(d["a"], d["b"])}, tracing_mode="fake")(inputs)
    assert torch.equal(fast_calls(gm)(inputs)["sum"], inputs["a"] + inputs["b"])
