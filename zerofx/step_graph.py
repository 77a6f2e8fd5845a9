"""What every node of a captured training step means, and the questions passes ask about it.

Capture tags each node with a `NodeTag` in ``node.meta["zerofx"]``: its phase (forward, backward, optimizer), its
micro-batch, and for inputs and the values the optimizer consumes, its role and the parameter's fully qualified name.
`StepGraph` answers "the gradient of p", "the optimizer update of p", "first and last use of p in forward".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.fx as fx

TAG = "zerofx"


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Role(str, enum.Enum):
    # graph inputs
    PARAM = "param"  # the parameter forward and backward read (in param_dtype under mixed precision)
    MASTER = "master"  # under mixed precision: the fp32 master weight the optimizer updates
    BUFFER = "buffer"
    GRAD_IN = "grad_in"  # a .grad that existed before the step (accumulation across calls)
    OPT_STATE = "opt_state"
    HYPERPARAM = "hyperparam"
    BATCH = "batch"
    LOSS_SCALE = "loss_scale"  # float16 mixed precision: the dynamic loss scale (updated in place)
    GROWTH_TRACKER = "growth_tracker"  # steps since the scale last changed (updated in place)
    RANK = "rank"  # this rank's index (stages 1-3): the graph is the same on every rank, the rank is data
    ARENA = "arena"  # the bytes planned buffers are views into (memory_plan), allocated once
    TP_RANK = "tp_rank"  # this rank's index in its tensor-parallel group (partitioned activation checkpoints)
    # values inside the graph
    GRAD = "grad"  # a parameter's gradient as backward leaves it (per micro-batch)
    OPTIMIZER_GRAD = "optimizer_grad"  # the gradient the optimizer reads (after clipping etc.)
    UPDATED_PARAM = "updated_param"  # the last in-place update of a parameter
    # graph outputs
    USER_OUTPUT = "user_output"
    GRAD_OUT = "grad_out"  # the .grad left after the step
    BATCH_GRAD = "batch_grad"  # the .grad backward leaves in a batch input that requires grad
    NEW_STATE = "new_state"  # optimizer state created or replaced by the step
    NEW_BUFFER = "new_buffer"  # a buffer the module re-assigned


@dataclass(frozen=True)
class Slot:
    """One graph input or output: what it is and whose it is."""

    role: Role
    fqn: str | None = None  # parameter or buffer name; None for batch, user outputs
    key: str | None = None  # optimizer state key ("exp_avg") or hyperparameter key ("lr")
    group: int | None = None  # (optimizer index, param group index) flattened for hyperparameters
    optimizer: int | None = None

    def describe(self) -> str:
        parts = [self.role.value]
        if self.fqn:
            parts.append(self.fqn)
        if self.key:
            parts.append(self.key)
        if self.group is not None:
            parts.append(f"group{self.group}")
        return ":".join(parts)


@dataclass
class NodeTag:
    phase: Phase
    microbatch: int = 0
    slots: list[Slot] = field(default_factory=list)  # a value can be several things at once
    in_optimizer_step: bool = False  # created inside optimizer.step() (not clipping or code after the step)

    def has(self, role: Role, fqn: str | None = None) -> bool:
        return any(s.role == role and (fqn is None or s.fqn == fqn) for s in self.slots)


def tag(node: fx.Node) -> NodeTag | None:
    return node.meta.get(TAG)


def users_in(node: fx.Node, phase: Phase) -> list[fx.Node]:
    """The nodes of ``phase`` that read ``node`` directly."""
    return [u for u in node.users if tag(u) is not None and tag(u).phase == phase]


# what zero_grad(set_to_none=False) writes into a gradient: zeros, to which adding adds nothing
ZEROING_OPS = (torch.ops.aten.zero_.default, torch.ops.aten._foreach_zero_.default)


def is_mutating(node: fx.Node) -> bool:
    """True for an ATen op that writes into one of its arguments (``add_``, ``copy_``, ``out=``)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# ops returning views of their first argument without an alias annotation: the functional collectives' wait (the
# collective's output buffer it was given), and _unsafe_view and the unsafe splits (views autograd treats as new
# tensors: nn.GRU's and nn.LSTM's decomposed cells split their gates with them)
HIDDEN_ALIASES = (torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten._unsafe_view.default,
                  torch.ops.aten.unsafe_split.Tensor, torch.ops.aten.unsafe_split_with_sizes.default,
                  torch.ops.aten.unsafe_chunk.default)


def aliases_first_arg(node: fx.Node) -> bool:
    """True for an op whose output aliases its first argument: views, in-place ops, and the ops whose schema does not
    say so (`HIDDEN_ALIASES`)."""
    if node.target in HIDDEN_ALIASES:
        return True
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments or not node.args:
        return False
    info = schema.arguments[0].alias_info
    return info is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def storage_root(node: fx.Node) -> fx.Node:
    """Follow views and in-place results back to the node that owns the storage."""
    while aliases_first_arg(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


class StepGraph:
    """Read-only questions about a tagged step graph. Built fresh by a pass; cheap."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.graph = gm.graph
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}

    def placeholders(self, role: Role) -> dict[str, fx.Node]:
        out = {}
        for n in self.graph.nodes:
            t = tag(n)
            if n.op == "placeholder" and t is not None:
                for s in t.slots:
                    if s.role == role:
                        out[s.fqn or n.name] = n
        return out

    def params(self) -> dict[str, fx.Node]:
        return self.placeholders(Role.PARAM)

    def updated_params(self) -> dict[str, fx.Node]:
        """fqn -> the last in-place update of each parameter this graph updates (not one it leaves as it found)."""
        params = self.params()
        return {f: n for f, n in self.tagged(Role.UPDATED_PARAM).items() if n is not params.get(f)}

    def output_slots(self) -> list[Slot]:
        return tag(self.output).slots

    @property
    def output(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def input_slots(self) -> list[Slot]:
        return [tag(n).slots[0] for n in self.graph.nodes if n.op == "placeholder"]

    def tagged(self, role: Role, microbatch: int | None = None) -> dict[str, fx.Node]:
        """fqn -> node for every node holding ``role`` (e.g. GRAD of the given micro-batch)."""
        out = {}
        for n in self.graph.nodes:
            t = tag(n)
            if t is None:
                continue
            for s in t.slots:
                if s.role == role and (microbatch is None or t.microbatch == microbatch):
                    out[s.fqn] = n
        return out

    def grad(self, fqn: str, microbatch: int = -1) -> fx.Node | None:
        """The gradient of ``fqn`` as backward of ``microbatch`` leaves it (-1: the last micro-batch)."""
        mb = self.num_microbatches() - 1 if microbatch == -1 else microbatch
        return self.tagged(Role.GRAD, mb).get(fqn)

    def num_microbatches(self) -> int:
        return 1 + max((tag(n).microbatch for n in self.graph.nodes if tag(n)), default=0)

    def update(self, fqn: str) -> list[fx.Node]:
        """The optimizer's in-place writes into parameter ``fqn``, in order."""
        param = self.params()[fqn]
        return [n for n in self.graph.nodes if is_mutating(n) and storage_root(n) is param]

    def uses(self, fqn: str, phase: Phase | None = None) -> list[fx.Node]:
        """Nodes that read parameter ``fqn`` (through views too), in graph order, optionally of one phase."""
        param = self.params()[fqn]
        seen, frontier, users = {param}, [param], []
        while frontier:
            for u in frontier.pop().users:
                if u in seen:
                    continue
                seen.add(u)
                if aliases_first_arg(u) and u.args[0] in seen and not is_mutating(u):
                    frontier.append(u)  # a view: its readers read the parameter
                users.append(u)
        users.sort(key=self.order.__getitem__)
        if phase is not None:
            users = [u for u in users if tag(u) is not None and tag(u).phase == phase]
        return users

    def first_use(self, fqn: str, phase: Phase) -> fx.Node | None:
        uses = self.uses(fqn, phase)
        return uses[0] if uses else None

    def last_use(self, fqn: str, phase: Phase) -> fx.Node | None:
        uses = self.uses(fqn, phase)
        return uses[-1] if uses else None

    def phase_span(self, phase: Phase, microbatch: int | None = None) -> tuple[fx.Node, fx.Node] | None:
        nodes = [
            n for n in self.graph.nodes
            if tag(n) is not None and tag(n).phase == phase and n.op == "call_function"
            and (microbatch is None or tag(n).microbatch == microbatch)
        ]
        return (nodes[0], nodes[-1]) if nodes else None

