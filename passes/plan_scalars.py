"""M_D for scalar operands: the numbers fp32 arithmetic takes as tensors become 0-dim tensors kept with the graph.

A Python number passed where an ATen op takes a tensor (``exp_avg_sq.mul_(beta2)``, ``denom / bias_correction``) is
wrapped into a fresh 0-dim tensor at every call, and cast to the other operand's dtype in a second one: allocations
for each of an optimizer's scalar operations, hundreds a step. Here the ``other`` operand of fp32 ``add``, ``sub``,
``mul`` and ``div`` (in place or not), when it is a number, becomes a 0-dim float32 CPU tensor that the graph module
holds (``self.scalar<i>_<value>``): a constant holds its value from the start, and a number the step computes (a
bias correction from the step count) is written into its own with ``fill_`` just before its first use. Values are
bitwise unchanged: both ways the number is rounded to float32 once, and kernels take a 0-dim CPU tensor as they take
a wrapped number, by value, on CPU and CUDA alike.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from zerofx.passes.context import PassContext
from zerofx.passes.graph_edit import add_call, fake_mode_of
from zerofx.step_graph import TAG, NodeTag

aten = torch.ops.aten
_ARITHMETIC = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.mul.Tensor,
               aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}


def plan_scalar_operands(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Expects: the final graph but for ``plan_memory``, with ``val`` metadata; ``ctx.memory_plan`` (False:
    unchanged). Guarantees: no fp32 ``add``/``sub``/``mul``/``div`` node takes a number as its second positional
    operand; it reads a 0-dim float32 CPU tensor the module keeps instead, one per distinct constant (read once,
    before its first use) and one per computed number (rounded to float32 and filled before its first use); the code
    names every constant by its value; values are unchanged. Leaves ``ctx.artifacts["scalar_operands"]``: a
    `ScalarOperands`."""
    if not ctx.memory_plan:
        return gm
    graph = gm.graph
    uses = [n for n in graph.nodes if _takes_number(n)]
    if not uses:
        return gm
    # what each use reads, by constant (its value) or computed number (its node): read or filled before the first use
    operands: dict[object, fx.Node] = {}
    for node in uses:
        number = node.args[1]
        key = number if isinstance(number, fx.Node) else (type(number), repr(number))  # repr: -0.0 is not 0.0
        if key not in operands:
            with graph.inserting_before(node):
                operands[key] = _operand(gm, f"scalar{len(operands)}", number, like=node)
        node.update_arg(1, operands[key])
    computed = sum(isinstance(key, fx.Node) for key in operands)
    ctx.artifacts["scalar_operands"] = ScalarOperands(len(uses), len(operands) - computed, computed)
    graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class ScalarOperands:
    """What `plan_scalar_operands` rewrote: the calls, and the tensors they read (constants, numbers filled)."""
    calls: int
    constants: int
    computed: int

    @property
    def nbytes(self) -> int:
        """What the module keeps for them: one float32 0-dim tensor each."""
        return (self.constants + self.computed) * torch.float32.itemsize


def float32_of(number: int | float) -> int | float:
    """A computed number as casting it to float32 rounds it: beyond float32's range ±inf (as a wrapped number
    becomes), where ``fill_`` would raise instead. An int is left to ``fill_``, which converts it directly."""
    return number if isinstance(number, int) else ctypes.c_float(number).value


def _takes_number(node: fx.Node) -> bool:
    """An fp32 add/sub/mul/div whose second positional operand is a number, or a node computing one."""
    if node.op != "call_function" or node.target not in _ARITHMETIC or len(node.args) < 2:
        return False
    self_, other = node.args[0], node.args[1]
    number = other.meta.get("val") if isinstance(other, fx.Node) else other  # a SymFloat only where computed
    is_number = isinstance(number, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(number, bool)
    val = node.meta.get("val")
    return (is_number and isinstance(self_, fx.Node)
            and isinstance(self_.meta.get("val"), torch.Tensor) and self_.meta["val"].dtype == torch.float32
            and isinstance(val, torch.Tensor) and val.dtype == torch.float32)


def _operand(gm: fx.GraphModule, name: str, number, *, like: fx.Node) -> fx.Node:
    """A 0-dim float32 tensor kept as ``gm``'s buffer, read where the graph inserts: holding the constant ``number``
    (named by its value), or filled with the number the node ``number`` computes."""
    computed = isinstance(number, fx.Node)
    name += "" if computed else f"_{_spelled(number)}"
    with unset_fake_temporarily():  # an int converts to float32 directly, as a wrapped one does
        value = torch.tensor(0.0 if computed else number).to(torch.float32)
    gm.register_buffer(name, value, persistent=False)  # not state: made again by every trace
    read = _get_attr(gm.graph, name, like=like)
    if not computed:
        return read
    rounded = add_call(gm.graph, float32_of, (number,), like=like, val=number.meta["val"])
    return add_call(gm.graph, aten.fill_.Scalar, (read, rounded), like=like, val=read.meta["val"])


def _get_attr(graph: fx.Graph, name: str, *, like: fx.Node) -> fx.Node:
    node = graph.get_attr(name)
    with fake_mode_of(graph):
        node.meta["val"] = torch.empty((), dtype=torch.float32, device="cpu")
    source: NodeTag = like.meta[TAG]
    node.meta[TAG] = NodeTag(source.phase, source.microbatch, [], source.in_optimizer_step)
    return node


def _spelled(number: int | float) -> str:
    """The constant as an identifier can spell it: ``0.999`` as ``0_999``, ``-1e-08`` as ``neg1eneg08``."""
    text = repr(number).replace("-", "neg").replace("+", "").replace(".", "_")
    return re.sub(r"[^0-9a-z_]", "_", text)
