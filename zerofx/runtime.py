"""Build (capture, then the stage's passes) and execute a step graph on the ranks of a process group."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from zerofx import collectives, dump
from zerofx.binding import StepBinding, incoming_grads, input_values, present_grads
from zerofx.capture import CapturedStep, capture, refuse_repeated_side_effects
from zerofx.errors import CaptureError, user_frame_from_stack_trace
from zerofx.fast_calls import Runnable, fast_calls
from zerofx.memory import StepProbe
from zerofx.memory import timeline
from zerofx.memory.lifetimes import StepMemoryPlan, lifetimes, plan_step
from zerofx.memory.pools import slot_place, slot_views
from zerofx.mesh import DTensorSpecs, local, wrap
from zerofx.mixed_precision import MixedPrecision
from zerofx.passes import PassContext, pipeline
from zerofx.passes.graph_edit import keep_grad_outputs
from zerofx.sharded_state import ShardedState
from zerofx.step_graph import ZEROING_OPS, Phase, Role, Slot, StepGraph, is_mutating, storage_root, tag
from zerofx.units import UnitRule

log = logging.getLogger("zerofx")


class SharedArena:
    """The bytes every cached graph of one compiled step writes its planned buffers into (``memory_plan``). Their
    runs never overlap, so one buffer as large as the largest plan serves them all: an eval-mode or short-batch trace
    adds no arena of its own. Only the gradients a step leaves (in ``.grad``, or from stage 1 on the shards it
    keeps for its next call) outlive its run, and a run that reads them moves them out first; a run that finds
    anything still holding the bytes (last step's ``.grad`` kept by the caller) leaves them to their holder and
    takes new ones."""

    def __init__(self):
        self._raw: torch.Tensor | None = None
        # by graph (an evicted graph's go with it): its slots, views of ``_raw``, and the references to its storage
        # they take (measured as they are made)
        self._slots: weakref.WeakKeyDictionary[fx.Graph, tuple[list[torch.Tensor], int]] = weakref.WeakKeyDictionary()
        self._warned = False  # about a gradient kept across steps, once

    def release(self) -> None:
        """Let the bytes go (at once, unless a ``.grad`` still views them); the next graph to run allocates them
        again."""
        self._slots.clear()
        self._raw = None

    @property
    def nbytes(self) -> int:
        """The bytes held (0 before a planned graph first runs)."""
        return 0 if self._raw is None else self._raw.numel()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views the arena's bytes."""
        return self._raw is not None and tensor.untyped_storage().data_ptr() == self._raw.untyped_storage().data_ptr()

    def release_if_held_elsewhere(self, params_with_grads_in_it: list[torch.Tensor] = ()) -> None:
        """Before a run: bytes something but the arena, its slots and the ``.grad`` of ``params_with_grads_in_it``
        still holds (last step's ``.grad`` kept by the caller, a view of it, its storage object) are left to it, and
        the run takes new ones."""
        if self._raw is None:
            return
        held = _storage_references(self._raw)  # first: a collection it may set off only lowers it (safe side)
        expected = 1 + len(params_with_grads_in_it) + sum(references for _, references in self._slots.values())
        if held <= expected and not any(_grad_held_by_caller(p) for p in params_with_grads_in_it):
            return
        if not self._warned:
            log.warning("zerofx: a gradient the last step left in its planned arena is still referenced; the "
                        "arena (%d bytes) stays with it and the step allocates another. Clone gradients you keep "
                        "across steps.", self.nbytes)
            self._warned = True
        self.release()

    def slots(self, graph: fx.Graph, planned: list[torch.Tensor]) -> list[torch.Tensor]:
        """``graph``'s slots (like ``planned``, the ``arena`` placeholder's fake views), in the shared bytes; the bytes
        grow, and every graph's slots are made again, when ``graph`` plans more than they hold."""
        nbytes, device = planned[0].untyped_storage().nbytes(), planned[0].device
        if self._raw is None or self._raw.numel() < nbytes or self._raw.device != device:
            self.release()  # the old bytes go before the new ones come
            self._raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if graph not in self._slots:
            before = _storage_references(self._raw)
            slots = slot_views(self._raw, [slot_place(s) for s in planned])
            self._slots[graph] = slots, _storage_references(self._raw) - before
        return self._slots[graph][0]


def _storage_references(tensor: torch.Tensor) -> int:
    """The references to ``tensor``'s storage: a tensor viewing it counts once (``tensor`` included), and so does
    its Python storage object while anything else holds that."""
    use_count, object_refs = _storage_counts(tensor)
    return use_count - 1 + (object_refs > _unheld_storage_object_refs())  # fetching the object added one, unless held


def _storage_counts(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()  # the storage's one Python object
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def _grad_held_by_caller(param: torch.Tensor) -> bool:
    """Whether anything but ``param`` holds its ``.grad`` tensor object (``g = p.grad`` in the caller's code)."""
    return _grad_references(param) > _unheld_grad_references()


def _grad_references(param: torch.Tensor) -> int:
    grad = param.grad
    return sys.getrefcount(grad)


@functools.cache
def _unheld_grad_references() -> int:
    """The references `_grad_references` sees to a ``.grad`` its parameter alone holds."""
    param = torch.nn.Parameter(torch.empty(1))
    param.grad = torch.empty(1)
    return _grad_references(param)


@functools.cache
def _unheld_storage_object_refs() -> int:
    """The references `_storage_counts` sees to a storage object nothing else holds (torch keeps one of its own)."""
    return _storage_counts(torch.empty(1))[1]


# ops whose kernels read autograd's grad mode, which the step's graph runs with off: nn.LSTM's CPU kernel makes the
# workspace its backward reads only with grad mode on (off, it returns an undefined tensor and the backward fails)
GRAD_MODE_KERNELS = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})


@dataclass
class CompiledGraph:
    captured: CapturedStep
    gm: fx.GraphModule
    ctx: PassContext
    input_slots: list[Slot]
    output_slots: list[Slot]
    shared_arena: SharedArena  # the step's, shared by its cached graphs
    left_grads: set[str] = field(default_factory=set)  # parameters whose .grad the step sets; the others it clears
    reads_incoming_grads: bool = False  # the step accumulates into a .grad it finds set (no zero_grad before)
    grads_added_to: frozenset[str] = frozenset()  # whose incoming .grad this trace (or an earlier one) added to
    grads_released: frozenset[str] = frozenset()  # gradients an update used that the step leaves and releases
    snapshots: dict[str, GraphSnapshot] = field(default_factory=dict)  # "capture" and each pass's (keep_graphs)
    verified: bool = False
    has_run: bool = False
    _memory_plan: StepMemoryPlan | None = None

    def arena(self) -> list[torch.Tensor]:
        """The planned buffers (``memory_plan``): views of the step's arena, allocated on the first step, kept after."""
        return self.shared_arena.slots(self.gm.graph, self._planned_slots)

    @functools.cached_property
    def _planned_slots(self) -> list[torch.Tensor]:
        return next(n for n in self.gm.graph.nodes if n.op == "placeholder" and n.name == "arena").meta["val"]

    def memory_plan(self) -> StepMemoryPlan:
        """The final graph's buffers, their lifetimes and their planned offsets (computed once)."""
        if self._memory_plan is None:
            self._memory_plan = plan_step(self.gm.graph)
        return self._memory_plan

    @functools.cached_property
    def runnable(self) -> Runnable:
        """The step as it runs from its second call: code generated from ``gm``'s graph with its ATen calls through
        torch's faster bindings (`fast_calls`)."""
        return fast_calls(self.gm)

    @functools.cached_property
    def takes_rank_or_arena(self) -> bool:
        """Whether a graph input comes from neither the module nor the optimizer nor the batch."""
        return any(slot.role in (Role.TP_RANK, Role.ARENA) for slot in self.input_slots)

    @functools.cached_property
    def runs_in_grad_mode(self) -> bool:
        """Whether an op of the graph has a kernel that reads autograd's grad mode (`GRAD_MODE_KERNELS`)."""
        return any(n.target in GRAD_MODE_KERNELS for n in self.gm.graph.nodes)

    @functools.cached_property
    def grads_read(self) -> frozenset[str]:
        """The parameters whose incoming ``.grad`` the step reads (accumulates into)."""
        return frozenset(slot.fqn for slot in self.input_slots if slot.role == Role.GRAD_IN)

    @property
    def fingerprint(self) -> int:
        return fingerprint(self.gm)


def fingerprint(gm: fx.GraphModule) -> int:
    """A hash of the graph's code, with process groups named by first appearance: the same graph on ranks of
    different tensor-parallel groups (whose names differ) has the same fingerprint."""
    code = gm.code
    for i, name in enumerate(dict.fromkeys(_group_names(gm.graph))):
        code = code.replace(repr(name), f"'group{i}'")
    return int.from_bytes(hashlib.sha256(code.encode()).digest()[:8], "little") >> 1


def _group_names(graph: fx.Graph):
    """The process-group names the graph's collectives (functional ones and zerofx's) take, in graph order."""
    for node in graph.nodes:
        if node.op == "call_function":
            for position in _group_positions(node.target):
                if position < len(node.args) and isinstance(node.args[position], str):
                    yield node.args[position]


@functools.cache
def _group_positions(target) -> tuple[int, ...]:
    """Where ``target`` takes a process group's name among its positional arguments (a signature is slow to read:
    once per op, not once per node)."""
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else list(inspect.signature(target).parameters)
    return tuple(i for i, name in enumerate(names) if name in ("group_name", "group"))


@dataclass
class GraphSnapshot:
    """The graph after capture or after a pass, copied so that later passes (which edit in place) leave it alone.
    Its module is built when asked for: building one generates and compiles its code, too slow to do for every
    pass of every trace."""
    root: fx.GraphModule
    graph: fx.Graph
    structure: tuple  # what the copy was taken of (see `_structure`)
    _module: fx.GraphModule | None = None

    @classmethod
    def of(cls, gm: fx.GraphModule, previous: "GraphSnapshot | None" = None) -> "GraphSnapshot":
        """A copy of ``gm``'s graph; ``previous`` itself when the pass in between left the graph as it was."""
        structure = _structure(gm.graph)
        if previous is not None and previous.structure == structure:
            return previous
        graph = fx.Graph()
        graph._codegen = gm.graph._codegen
        graph.output(graph.graph_copy(gm.graph, {}))
        for old, new in zip(gm.graph.nodes, graph.nodes):
            new.meta = dict(old.meta)  # the output node too: it carries the output slots
        return cls(gm, graph, structure)

    def module(self) -> fx.GraphModule:
        if self._module is None:
            self._module = fx.GraphModule(self.root, self.graph)
        return self._module


def _structure(graph: fx.Graph) -> tuple:
    """The graph's nodes, each with its target and arguments: an equal structure means no node was added, removed,
    retargeted or rewired (metadata alone may differ)."""
    return tuple((node, node.target, node.args, node.kwargs) for node in graph.nodes)


def build(train_step, binding: StepBinding, args: tuple, ctx: PassContext, dump_dir: str | None,
          state: ShardedState | None, mixed: MixedPrecision | None,
          checkpoint: UnitRule | None = None, specs: DTensorSpecs | None = None,
          keep_graphs: bool = False, *, arena: SharedArena,
          grads_added_to: frozenset[str] = frozenset(), first_trace: bool = True,
          side_effects_seen: set[str] | None = None) -> CompiledGraph:
    """Capture, then run the stage's passes. Capture first offers every incoming gradient, to learn whether the
    step reads them (and adds to them, `_grads_added_to`), unless earlier traces saw it add to all of them. A
    stand-in for one this call does not have is taken away as backward starts, which tells that backward adds to
    it; if the step reads one before (zeroes it, updates with it), or its code holds one, capture again without.
    ``grads_added_to``: the parameters whose incoming gradient earlier traces of the step added to; ``first_trace``:
    no graph of the step exists yet (then reading any offered gradient makes which exist part of the step's key,
    later only reading one that exists does). ``checkpoint`` picks the modules whose activations backward
    recomputes; ``specs`` names the DTensor inputs; ``keep_graphs`` copies the graph after capture and after each
    pass (a copy per pass: a sixth of the build); ``arena``: the bytes the step's other graphs plan into
    (``memory_plan``), shared with this one. ``side_effects_seen``: the Python side effects earlier traces of the
    step made (`refuse_repeated_side_effects`), added to."""
    override = state.trace_value if state else None
    side_effects_seen = set() if side_effects_seen is None else side_effects_seen
    # once earlier traces saw the step add to every trainable parameter's gradient, offering more teaches nothing
    probe = not set(binding.trainable()) <= grads_added_to
    present = present_grads(binding)
    captured = capture(train_step, binding, args, override, mixed, incoming_grads(binding, probe=probe),
                       checkpoint, specs)
    refuse_repeated_side_effects(captured.side_effects, side_effects_seen)
    read_in_trace = {s.fqn for s in captured.inputs if s.role == Role.GRAD_IN} | captured.standins_handed
    read = read_in_trace | captured.added_to_at_backward  # for the key, backward adding to a gradient reads it
    added_to = grads_added_to | _grads_added_to(StepGraph(captured.gm)) | captured.added_to_at_backward
    if not read_in_trace <= set(present):
        # the first trace's changes to Python state would be the state this one starts from: not what eager runs
        refuse_repeated_side_effects(captured.side_effects, set(captured.side_effects))
        captured = capture(train_step, binding, args, override, mixed, present, checkpoint, specs)
    if ctx.stage >= 1 and any(s.role == Role.NEW_STATE for s in captured.outputs):
        raise CaptureError("the optimizer creates state lazily inside the step (SGD with dampening)",
                           hint=f"stage {ctx.stage} shards state before the first step: use dampening=0 or stage 0")
    captured_sg = StepGraph(captured.gm)  # the checks below read it; keep_grad_outputs then changes the graph
    released = frozenset()
    _refuse_grads_missing_from_the_last_microbatch(captured_sg)
    if ctx.stage >= 1:
        _refuse_grads_set_by_hand(captured)
        _refuse_params_read_after_update(captured_sg)
        _refuse_grads_not_kept(captured, state)
    if ctx.stage >= 1 or mixed is not None:
        ctx.grads_kept, released = _grads_kept_for_next_call(captured, captured_sg, binding, args, mixed, added_to)
        keep_grad_outputs(captured.gm.graph, ctx.grads_kept)  # the others live inside the step
        captured.gm.recompile()
    snapshots = {"capture": GraphSnapshot.of(captured.gm)} if keep_graphs else {}
    if dump_dir:
        dump.write(dump_dir, 0, "capture", captured.gm)

    def after_each(index: int, name: str, gm: fx.GraphModule) -> None:
        if keep_graphs:
            snapshots[name] = GraphSnapshot.of(gm, previous=snapshots[next(reversed(snapshots))])
        if dump_dir:
            dump.write(dump_dir, index, name, gm)

    gm = pipeline(ctx.stage, cast_at_gather=mixed is None or mixed.cast_at_gather).run(captured.gm, ctx, after_each)
    if dump_dir:
        dump.write_units(dump_dir, ctx.artifacts)
        _write_timeline(dump_dir, snapshots)
    sg = StepGraph(gm)
    outputs = sg.output_slots()
    left_grads = {s.fqn for s in outputs if s.role == Role.GRAD_OUT}
    # a step that leaves gradients for its next call reads incoming ones then (its first call may not have: one that
    # opens a window with zero_grad()), so which exist is part of its key
    reads = bool(read if first_trace else read & set(present)) or bool(ctx.grads_kept)
    return CompiledGraph(captured, gm, ctx, sg.input_slots(), outputs, arena, left_grads, reads, added_to,
                         released, snapshots)


def _left_for_next_call(captured: CapturedStep, sg: StepGraph, binding: StepBinding,
                        args: tuple) -> tuple[list[str], list[str]]:
    """The gradients a call leaves in ``.grad`` that an optimizer holds, in two lists. First, those it did not step
    with: the next call adds to them (an update every k-th call, or one optimizer of two stepping). Then, those it
    stepped with, but those it leaves as zeros (adding to zeros adds nothing): eager's next call adds to them unless
    a ``zero_grad()`` comes between, which only the caller knows.
    (A parameter no optimizer holds keeps a gradient nothing reads; one the step updated with and that the step resets
    before backward is dropped, as that reset would; one updated before the backward that left it is kept.)"""
    held = {binding.fqn_of[id(p)] for opt in binding.optimizers(args) for group in opt.param_groups
            for p in group["params"]}
    updates, grads = sg.updated_params(), sg.tagged(Role.GRAD)

    def stepped_with(fqn: str) -> bool:  # a step that updates first and then runs backward keeps the new gradient
        return fqn in updates and (fqn not in grads or sg.order[updates[fqn]] > sg.order[grads[fqn]])

    left, zeroed = captured.grads_left & held, _left_zeroed(sg)
    return (sorted(f for f in left if not stepped_with(f)),
            sorted(f for f in left if stepped_with(f) and f not in zeroed))


def _grads_added_to(sg: StepGraph) -> frozenset[str]:
    """The parameters whose incoming gradient an op of the step reads before anything zeroes it (backward
    accumulates into it): not those ``zero_grad(set_to_none=False)`` zeroes first, nor those a step that runs no
    backward (an evaluation) passes on untouched."""
    added_to = []
    for fqn, node in sg.placeholders(Role.GRAD_IN).items():
        ops = [user for user in node.users if user.op == "call_function"]
        if ops and min(ops, key=sg.order.__getitem__).target not in ZEROING_OPS:
            added_to.append(fqn)
    return frozenset(added_to)


def _left_zeroed(sg: StepGraph) -> frozenset[str]:
    """The parameters whose gradient the step leaves as zeros: zeroing is the last write to the output's storage
    (``zero_grad(set_to_none=False)`` after the update)."""
    last_write = {}
    for node in sg.graph.nodes:
        if is_mutating(node):
            written = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            for target in written:
                if isinstance(target, fx.Node):
                    last_write[storage_root(target)] = node
    return frozenset(slot.fqn for slot, value in zip(sg.output_slots(), sg.output.args[0])
                     if slot.role == Role.GRAD_OUT and isinstance(value, fx.Node)
                     and getattr(last_write.get(storage_root(value)), "target", None) in ZEROING_OPS)


def _refuse_grads_missing_from_the_last_microbatch(sg: StepGraph) -> None:
    """Every stage reduces (or reduce-scatters, and sums) the gradients as the last backward leaves them; a parameter
    an earlier micro-batch gave a gradient and the last did not use would keep this rank's own (at stage 0 the ranks'
    copies would drift apart)."""
    grads = sg.tagged(Role.GRAD)
    with_backward = sorted({tag(n).microbatch for n in sg.graph.nodes if tag(n) and tag(n).has(Role.GRAD)})
    last = sg.tagged(Role.GRAD, with_backward[-1]) if with_backward else {}
    missing = [f for f in grads if f not in last]
    if missing:
        raise CaptureError(
            f"parameter '{missing[0]}' gets a gradient in an earlier micro-batch but is not used in the last of "
            f"{len(with_backward)}: the step reduces the gradients across ranks as the last backward leaves them",
            hint="use every trained parameter in every micro-batch (a task's head in each, or 0 * its output)")


def _refuse_params_read_after_update(sg: StepGraph) -> None:
    """From stage 1 on the optimizer updates this rank's shard, and the whole parameter exists again only once the
    step gathers it (at its end at stages 1-2, in the next call at stage 3): forward or backward after
    ``optimizer.step()`` in the same call (an evaluation of the updated model, an update before backward) would read
    it stale."""
    fqn_of = {node: fqn for fqn, node in sg.params().items()}
    first_write: dict[str, fx.Node] = {}
    for node in sg.graph.nodes:
        if node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            fqn = fqn_of.get(storage_root(arg))
            if fqn in first_write and tag(node).phase in (Phase.FORWARD, Phase.BACKWARD):
                raise CaptureError(
                    f"parameter '{fqn}' is read by {node.target} after optimizer.step() updated it in the same call "
                    f"(at {user_frame_from_stack_trace(first_write[fqn].meta.get('stack_trace'))}); from stage 1 on "
                    "an update writes this rank's shard, and the step gathers the whole parameter only after it",
                    source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
                    hint="end the step with optimizer.step() and run what reads the updated model (an evaluation, a "
                         "backward before the next update) in a call of its own, or use stage 0")
        root = fqn_of.get(storage_root(node))
        if root is not None and is_mutating(node):
            first_write.setdefault(root, node)


def _refuse_grads_not_kept(captured: CapturedStep, state: ShardedState | None) -> None:
    """From stage 1 on a step accumulates only into the gradient shards it kept from its last call; a ``.grad`` set
    otherwise (before the first call, say) has no shard to add."""
    kept = state.kept_grads if state is not None else {}
    unkept = [s.fqn for s in captured.inputs if s.role == Role.GRAD_IN and s.fqn not in kept]
    if unkept:
        raise CaptureError(
            f"parameter '{unkept[0]}' has a .grad the step did not leave, and the step would accumulate into it; "
            "from stage 1 on gradients live with the step, which keeps only those it leaves for its next call",
            hint="call optimizer.zero_grad() before the first call, or use stage 0")


def _refuse_grads_set_by_hand(captured: CapturedStep) -> None:
    """From stage 1 on the optimizer updates this rank's shard with this rank's shard of the reduced gradient: one no
    backward left (``p.grad = g``) has neither."""
    if captured.grads_set_by_hand:
        fqn, source = next(iter(captured.grads_set_by_hand.items()))
        raise CaptureError(
            f"the update reads a gradient of parameter '{fqn}' that no backward() left (set by hand: from "
            "torch.autograd.grad, or zeros for a parameter backward did not reach): from stage 1 on the optimizer "
            "updates this rank's shard with its shard of a gradient reduced across ranks as backward leaves it",
            source=source, hint="compute the gradients with loss.backward() (backward(inputs=...) for some "
                                "parameters; a gradient penalty from torch.autograd.grad added to the loss is fine), "
                                "or use stage 0, which updates with it as set, on each rank, as DDP does")


def _grads_kept_for_next_call(captured: CapturedStep, sg: StepGraph, binding: StepBinding, args: tuple,
                              mixed: MixedPrecision | None,
                              added_to: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
    """From stage 1 on, or under mixed precision, the gradients the step keeps for its next call
    (`_left_for_next_call`): this rank's shard of each from stage 1 on (of a tensor-parallel parameter, of its
    local tensor), the fp32 master's gradient under mixed precision. Those an update used are kept where the step
    adds to incoming gradients (``added_to``). Also returns those an update used that are released because the
    step was not seen adding to them."""
    unused, stepped_with = _left_for_next_call(captured, sg, binding, args)
    scaled = mixed is not None and mixed.scaling is not None
    # an evaluation passing kept gradients on untouched leaves them as they were, unscaled
    computed = sg.tagged(Role.GRAD)
    accumulated = [fqn for fqn in unused if fqn in computed]
    if accumulated and scaled:
        raise CaptureError(
            f"the train step leaves the gradient of '{accumulated[0]}' for its next call under float16 loss scaling; "
            "the scale is updated once per call, where GradScaler's users update it once per optimizer step",
            hint="accumulate inside one step (a loop over micro-batches, each calling backward(), then "
                 "optimizer.step()), or use bfloat16")
    kept = frozenset(f for f in stepped_with if f in added_to)
    return frozenset(unused) | kept, frozenset(f for f in stepped_with if f not in added_to)


def _write_timeline(dump_dir: str, snapshots: dict[str, GraphSnapshot]) -> None:
    """memory.png: the final graph's live bytes by class, and the graph before ``plan_memory`` where it planned."""
    names = list(snapshots)
    shown = names[-2:] if "arena" in {n.name for n in snapshots[names[-1]].graph.nodes} else names[-1:]
    timeline.write(os.path.join(dump_dir, "memory.png"),
                   {f"after {name}": (lifetimes(snapshots[name].graph), len(snapshots[name].graph.nodes))
                    for name in shown})


def execute(compiled: CompiledGraph, binding: StepBinding, args: tuple, state: ShardedState | None,
            probe: StepProbe | None = None, specs: DTensorSpecs | None = None, tp_rank: int = 0):
    """Run the graph on this rank's state and batch; write back what eager would leave behind; return the user's
    output. With a ``probe`` the graph runs node by node and the probe measures its memory. What eager leaves as a
    DTensor (``specs``) is wrapped back into one; ``tp_rank`` is this rank's place in its tensor-parallel group."""

    def lookup(slot: Slot):
        if slot.role == Role.TP_RANK:
            return tp_rank
        if slot.role == Role.ARENA:
            return compiled.arena()
        return state.lookup(slot) if state else None

    keeps_grads = state is not None and state.stage >= 1  # from stage 1 on, what the step leaves it keeps itself
    if keeps_grads:
        state.take_back_grads(binding, compiled.grads_read)
    _release_unread_grads(binding, compiled.grads_read)
    _move_read_grads_out_of_arena(binding, compiled, state)
    compiled.shared_arena.release_if_held_elsewhere()
    needs_lookup = state is not None or compiled.takes_rank_or_arena
    inputs = input_values(binding, args, compiled.input_slots, for_trace=False,
                          override=lookup if needs_lookup else None)
    if compiled.runs_in_grad_mode:  # detached: the kernels see grad mode on, autograd records nothing
        inputs = [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in inputs]
    try:
        with torch.set_grad_enabled(compiled.runs_in_grad_mode):
            # from its second run: rewriting takes a tenth of a build, not worth it for a graph run once
            step = compiled.runnable if compiled.has_run else compiled.gm
            compiled.has_run = True
            outputs = probe.run_step(inputs, roots=[*inputs, *compiled.gm.buffers()]) if probe else step(*inputs)
    finally:
        collectives.settle_pending()  # a step that issued no collective still checks its rank agreement
    user_leaves = dict(compiled.captured.user_out_constants)
    optimizers = binding.optimizers(args)
    kept_grads = {}
    for slot, value in zip(compiled.output_slots, outputs):
        kept_shard = slot.role == Role.GRAD_OUT and keeps_grads  # this rank's flat shard, never a DTensor
        spec = specs.of(slot) if specs and not kept_shard else None
        value = value if spec is None else wrap(value, spec)
        if slot.role == Role.USER_OUTPUT:
            user_leaves[int(slot.key)] = value
        elif kept_shard:
            kept_grads[slot.fqn] = value
        elif slot.role == Role.GRAD_OUT:
            # not a view of a slot or a bucket (it keeps sharing their memory), as eager's is not: a conversion of
            # the model (model.double() sets .grad.data) would leave the view's base in the old dtype
            binding.params[slot.fqn].grad = value.detach() if value._is_view() else value
        elif slot.role == Role.NEW_STATE:
            optimizers[slot.optimizer].state[binding.params[slot.fqn]][slot.key] = value
        elif slot.role == Role.NEW_BUFFER:
            binding.set_buffer(slot.fqn, value)
        elif slot.role == Role.BATCH_GRAD:  # added in place to one left there before, as backward adds
            leaf = pytree.tree_leaves(binding.batch(args))[int(slot.key)]
            if leaf.grad is None:
                leaf.grad = value
            else:
                leaf.grad.add_(value)
    for fqn, p in binding.trainable().items():
        if fqn not in compiled.left_grads:
            p.grad = None  # the step left no gradient (zero_grad at its end, or a sharded stage)
    if keeps_grads:
        state.keep_grads(binding, kept_grads)
    if compiled.captured.modes_left is not None:
        for modules, modes in zip(binding.submodules(args), compiled.captured.modes_left):
            for module, training in zip(modules, modes):
                module.training = training
    leaves = [user_leaves[i] for i in range(len(user_leaves))]
    return pytree.tree_unflatten(leaves, compiled.captured.user_out_spec)


def _release_unread_grads(binding: StepBinding, read: frozenset[str]) -> None:
    """Drop the gradients the step will not read before it runs, as the ``zero_grad()`` it opens with does eagerly:
    the step replaces or clears every trainable parameter's ``.grad`` at its end anyway, and holding the last step's
    through this one would add them to its peak."""
    for fqn, p in binding.trainable().items():
        if p.grad is not None and fqn not in read:  # a frozen parameter's is the user's
            p.grad = None


def _move_read_grads_out_of_arena(binding: StepBinding, compiled: CompiledGraph, state: ShardedState | None) -> None:
    """A step that reads incoming gradients gets them in memory of their own when the last step left them in the
    arena (in ``.grad``, or from stage 1 on kept by the state): this step's planned buffers are about to be written
    there."""
    arena = compiled.shared_arena
    kept = state.kept_grads if state is not None else {}
    for fqn in compiled.grads_read:
        if fqn in kept and arena.holds(kept[fqn]):
            kept[fqn] = kept[fqn].clone()
    in_arena = [p for fqn in compiled.grads_read if fqn not in kept
                and (p := binding.params[fqn]).grad is not None and arena.holds(local(p.grad))]
    # where the caller holds one (or a view), the arena is left to them and the run adds into them in place, as
    # eager's backward does where the caller sees it
    arena.release_if_held_elsewhere(in_arena)
    for p in in_arena:
        if arena.holds(local(p.grad)):
            p.grad = p.grad.clone()


def sync_module_states(binding: StepBinding, group: dist.ProcessGroup | None = None) -> None:
    """As DDP does at construction: every rank of ``group`` starts from its first rank's parameters and buffers
    (of a tensor-parallel parameter, the local shard: the group is then one column of the mesh)."""
    tensors = [local(t.detach()) for t in [*binding.params.values(), *binding.buffers.values()]]
    communicate_flat(tensors, lambda flat: collectives.broadcast_control(flat, src=0, group=group))


def communicate_flat(tensors: list[torch.Tensor], communicate) -> None:
    """``communicate(flat)`` on one flat buffer per dtype and device holding ``tensors``, which then hold its result
    (in place: ``communicate`` completes before it returns)."""
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        communicate(flat)
        for t, piece in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(piece.view_as(t))
