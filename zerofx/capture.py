"""Capture one training step (forward, backward, optimizer update) as a single ATen FX graph.

Why make_fx over the whole step rather than AOTAutograd's joint graph: the user's step calls ``loss.backward()`` and
``optimizer.step()`` itself, and make_fx traces exactly that, optimizer included, into one graph. AOTAutograd would
give forward and backward only and leave the optimizer to a second trace. We do not functionalize: make_fx already
records the optimizer's in-place updates (``param.addcdiv_``, ``exp_avg.lerp_``) on the graph's inputs, so the step
updates parameters and moments where they live and its peak is eager's, with no copy-back of a second set of state.
Passes therefore respect one rule: a node never moves across a write into the storage it reads.

Every placeholder is a parameter, buffer, pre-existing gradient, optimizer state tensor, optimizer hyperparameter or
batch leaf, tagged with a `Slot`. Every node gets a `NodeTag` with its phase and micro-batch, found by recording the
graph's length when a module's forward, ``torch.autograd.backward`` and the optimizer's step begin and end.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest import mock

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils import stateless

from zerofx import optim_support
from zerofx.errors import CaptureError, user_frame, user_frame_from_stack_trace
from zerofx.mixed_precision import MixedPrecision, master_weight_hooks
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot, is_mutating, storage_root


@dataclass
class StepBinding:
    """Where the step's modules, optimizers and batch sit among the user's arguments, and the names of the state."""

    module_positions: list[int]
    optimizer_positions: list[int]
    params: dict[str, nn.Parameter]  # fqn -> parameter (tied parameters under their first name)
    param_aliases: dict[str, str]  # every parameter name -> its fqn in ``params``
    buffers: dict[str, torch.Tensor]
    buffer_aliases: dict[str, str]

    @classmethod
    def from_args(cls, args: tuple) -> "StepBinding":
        module_positions = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizer_positions = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        if not module_positions:
            raise CaptureError("no nn.Module among the train step's arguments",
                               hint="call it as step(model, optimizer, *batch)")
        if not optimizer_positions:
            raise CaptureError("no torch.optim.Optimizer among the train step's arguments",
                               hint="call it as step(model, optimizer, *batch)")
        params, param_aliases, buffers, buffer_aliases = {}, {}, {}, {}
        for pos in module_positions:
            prefix = "" if len(module_positions) == 1 else f"arg{pos}."
            _collect(args[pos].named_parameters(remove_duplicate=False), prefix, params, param_aliases)
            _collect(args[pos].named_buffers(remove_duplicate=False), prefix, buffers, buffer_aliases)
        binding = cls(module_positions, optimizer_positions, params, param_aliases, buffers, buffer_aliases)
        binding._check_optimizers(args)
        return binding

    def _check_optimizers(self, args: tuple) -> None:
        known = {id(p) for p in self.params.values()}
        for pos in self.optimizer_positions:
            opt = args[pos]
            optim_support.spec_for(opt)
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in known:
                        raise CaptureError(
                            f"optimizer parameter not in the module: param_groups[{gi}] of "
                            f"{type(opt).__name__} (argument {pos}) holds a tensor of shape {tuple(p.shape)} that "
                            "no nn.Module argument owns",
                            hint="pass every module whose parameters the optimizer updates to the train step",
                        )

    @functools.cached_property
    def fqn_of(self) -> dict[int, str]:
        """id(parameter) -> its fqn."""
        return {id(p): fqn for fqn, p in self.params.items()}

    def modules(self, args: tuple) -> list[nn.Module]:
        return [args[i] for i in self.module_positions]

    def optimizers(self, args: tuple) -> list[torch.optim.Optimizer]:
        return [args[i] for i in self.optimizer_positions]

    def batch(self, args: tuple) -> list:
        taken = set(self.module_positions) | set(self.optimizer_positions)
        return [a for i, a in enumerate(args) if i not in taken]


def _collect(named, prefix, canonical: dict, aliases: dict) -> None:
    by_id = {id(t): fqn for fqn, t in canonical.items()}
    for name, t in named:
        full = prefix + name
        if id(t) not in by_id:
            canonical[full] = t
            by_id[id(t)] = full
        aliases[full] = by_id[id(t)]


@dataclass
class CapturedStep:
    gm: fx.GraphModule
    inputs: list[Slot]
    outputs: list[Slot]
    user_out_spec: pytree.TreeSpec
    user_out_constants: dict[int, Any]  # leaves of the user's output that are not tensors
    trace_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def input_slots(binding: StepBinding, args: tuple, mixed: MixedPrecision | None = None) -> list[Slot]:
    """The graph's inputs, in order: parameters (and master weights), buffers, existing grads, optimizer state,
    hyperparameters, batch."""
    slots = [Slot(Role.PARAM, fqn) for fqn in binding.params]
    if mixed is not None:
        slots += [Slot(Role.MASTER, fqn) for fqn, p in binding.params.items() if p.requires_grad]
    slots += [Slot(Role.BUFFER, fqn) for fqn in binding.buffers]
    if mixed is not None and mixed.scaling is not None:
        slots += [Slot(Role.LOSS_SCALE), Slot(Role.GROWTH_TRACKER)]
    if mixed is None:
        slots += [Slot(Role.GRAD_IN, fqn) for fqn, p in binding.params.items() if p.requires_grad]
    fqn_of = binding.fqn_of
    for oi, opt in enumerate(binding.optimizers(args)):
        spec = optim_support.spec_for(opt)
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        slots.append(Slot(Role.OPT_STATE, fqn_of[id(p)], key, optimizer=oi))
            for hkey in spec.tensor_hyperparams:
                slots.append(Slot(Role.HYPERPARAM, None, optim_support.hyperparam_name(hkey), gi, oi))
    leaves = pytree.tree_leaves(binding.batch(args))
    slots += [Slot(Role.BATCH, key=str(i)) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    return slots


def input_values(binding: StepBinding, args: tuple, slots: list[Slot], *, for_trace: bool,
                 override: Callable[[Slot], Any] | None = None, mixed: MixedPrecision | None = None) -> list:
    """The values to feed the graph for ``slots``: from ``override`` (the state a sharded step owns) where it has
    one, else from the module, optimizer and batch. For tracing, trainable parameters are leaves requiring grad."""
    optimizers = binding.optimizers(args)
    by_fqn = {}
    for oi, opt in enumerate(optimizers):
        for p, state in opt.state.items():
            by_fqn[(oi, binding.fqn_of.get(id(p)))] = state
    batch_leaves = [leaf for leaf in pytree.tree_leaves(binding.batch(args)) if isinstance(leaf, torch.Tensor)]
    batch_iter = iter(batch_leaves)
    values = []
    for s in slots:
        owned = override(s) if override is not None else None
        if owned is not None:
            values.append(owned.requires_grad_(True) if for_trace and s.role == Role.PARAM
                          and binding.params[s.fqn].requires_grad else owned)
        elif s.role == Role.PARAM:
            p = binding.params[s.fqn]
            compute = p.detach().to(mixed.param_dtype) if mixed is not None and p.requires_grad else p.detach()
            values.append(compute.requires_grad_(p.requires_grad) if for_trace else compute)
        elif s.role == Role.MASTER:
            values.append(binding.params[s.fqn].detach())
        elif s.role == Role.LOSS_SCALE:  # first trace, before the step owns the scale
            values.append(torch.tensor(mixed.scaling.init_scale, dtype=torch.float32))
        elif s.role == Role.GROWTH_TRACKER:
            values.append(torch.tensor(0, dtype=torch.int32))
        elif s.role == Role.BUFFER:
            values.append(binding.buffers[s.fqn])
        elif s.role == Role.GRAD_IN:
            p = binding.params[s.fqn]
            # a step that accumulates into .grad reads zeros where eager would start from None: same values
            if p.grad is not None:
                values.append(p.grad)
            else:  # tracing only needs shape and dtype; an untouched empty tensor costs no resident memory
                values.append(torch.empty_like(p) if for_trace else torch.zeros_like(p))
        elif s.role == Role.OPT_STATE:
            values.append(by_fqn[(s.optimizer, s.fqn)][s.key])
        elif s.role == Role.HYPERPARAM:
            group = optimizers[s.optimizer].param_groups[s.group]
            value = optim_support.read_hyperparam(group, _parse_hyperparam(s.key))
            # traced from a tensor (make_fx lifts tensors, not floats); the graph then takes the float itself
            values.append(torch.tensor(value, dtype=torch.float64) if for_trace else value)
        elif s.role == Role.BATCH:
            values.append(next(batch_iter))
    return values


def _parse_hyperparam(name: str) -> optim_support.HyperparamKey:
    if name.endswith("]"):
        base, index = name[:-1].split("[")
        return base, int(index)
    return name, None


class _PhaseRecorder:
    """Tags nodes with their phase while make_fx traces: at each event (a module's forward begins, backward begins
    or ends, the optimizer's step begins or ends) the nodes created since the last event get the phase they were
    created in. Between a backward and what follows it, the phase is decided by what comes next: gradient
    post-processing before the optimizer (clipping) belongs to the optimizer; before another forward, to backward."""

    def __init__(self):
        self.phase: Phase | None = Phase.FORWARD  # None: after a backward, until the next event decides
        self.microbatch = 0
        self.in_optimizer_step = False
        self.seen_backward = False
        # (node, slot) pairs: the node holding a gradient at the moment of the event. Gradients are updated in
        # place (accumulation, clipping), so the tensor's final node would be the wrong one.
        self.grad_nodes: list[tuple[fx.Node, Slot]] = []

    def note_grads(self, fake_params: dict, role: Role) -> None:
        mode = get_proxy_mode()
        for fqn, p in fake_params.items():
            if p.grad is not None:
                self.grad_nodes.append((get_proxy_slot(p.grad, mode.tracer).proxy.node, Slot(role, fqn)))

    def _flush(self, pending_phase: Phase) -> None:
        mode = get_proxy_mode()
        if mode is None:
            return
        for node in mode.tracer.graph.nodes:
            if TAG not in node.meta:
                node.meta[TAG] = NodeTag(self.phase or pending_phase, self.microbatch, [], self.in_optimizer_step)

    def event(self, name: str) -> None:
        if name == "forward_start":
            self._flush(Phase.BACKWARD)
            if self.phase != Phase.FORWARD:
                self.microbatch += 1 if self.seen_backward else 0
                self.phase = Phase.FORWARD
        elif name == "backward_start":
            self._flush(Phase.FORWARD)
            self.phase, self.seen_backward = Phase.BACKWARD, True
        elif name == "backward_end":
            self._flush(Phase.BACKWARD)
            self.phase = None
        elif name == "optimizer_start":
            self._flush(Phase.OPTIMIZER)
            self.phase, self.in_optimizer_step = Phase.OPTIMIZER, True
        elif name == "optimizer_end":
            self._flush(Phase.OPTIMIZER)
            self.in_optimizer_step = False
        elif name == "step_end":
            self._flush(Phase.OPTIMIZER)

    def tag_rest(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            if TAG not in node.meta:
                node.meta[TAG] = NodeTag(Phase.OPTIMIZER if node.op == "output" else Phase.FORWARD, self.microbatch)


def capture(train_step: Callable, binding: StepBinding, args: tuple,
            override: Callable[[Slot], Any] | None = None, mixed: MixedPrecision | None = None) -> CapturedStep:
    """Trace ``train_step(*args)`` with fake tensors into a tagged ATen graph. Nothing real is computed or changed.
    ``override`` supplies stand-ins for state the module no longer holds (a sharded step re-tracing); ``mixed``
    traces forward and backward in its ``param_dtype`` with the optimizer on fp32 master weights."""
    import time

    start = time.perf_counter()
    optimizers = binding.optimizers(args)
    modules = binding.modules(args)
    for opt in optimizers:
        optim_support.init_lazy_state(opt)
    slots = input_slots(binding, args, mixed)
    real_inputs = input_values(binding, args, slots, for_trace=True, override=override, mixed=mixed)
    batch_structure = binding.batch(args)
    recorder = _PhaseRecorder()
    out_slots: list[tuple[Slot, bool]] = []  # (slot, keep as a graph output)
    out_meta: dict[str, Any] = {}

    def traced(*flat):
        fakes = dict(zip(range(len(slots)), flat))
        fake_params = {s.fqn: fakes[i] for i, s in enumerate(slots) if s.role == Role.PARAM}
        fake_masters = {s.fqn: fakes[i] for i, s in enumerate(slots) if s.role == Role.MASTER}
        fake_buffers = {s.fqn: fakes[i] for i, s in enumerate(slots) if s.role == Role.BUFFER}
        by_role = {s.role: fakes[i] for i, s in enumerate(slots)}
        scaling = (mixed.scaling, by_role[Role.LOSS_SCALE], by_role[Role.GROWTH_TRACKER]) \
            if mixed is not None and mixed.scaling is not None else None
        for i, s in enumerate(slots):
            if s.role == Role.GRAD_IN:
                fake_params[s.fqn].grad = fakes[i]
        batch_fakes = iter(fakes[i] for i, s in enumerate(slots) if s.role == Role.BATCH)
        batch = pytree.tree_map_only(torch.Tensor, lambda _: next(batch_fakes), batch_structure)
        call_args = list(args)
        rest = iter(batch)
        for i in range(len(call_args)):
            if i not in binding.module_positions and i not in binding.optimizer_positions:
                call_args[i] = next(rest)
        with contextlib.ExitStack() as stack:
            for pos, module in zip(binding.module_positions, modules):
                prefix = "" if len(modules) == 1 else f"arg{pos}."
                mapping = {n: fake_params[binding.param_aliases[prefix + n]]
                           for n, _ in module.named_parameters(remove_duplicate=False)}
                mapping.update({n: fake_buffers[binding.buffer_aliases[prefix + n]]
                                for n, _ in module.named_buffers(remove_duplicate=False)})
                stack.enter_context(stateless._reparametrize_module(module, mapping))
                stack.enter_context(_hook(module.register_forward_pre_hook(
                    lambda *_: recorder.event("forward_start"))))
            for oi, opt in enumerate(optimizers):
                stack.enter_context(_swap_optimizer(opt, oi, binding, slots, fakes, {**fake_params, **fake_masters}))
                stack.enter_context(_hook(opt.register_step_pre_hook(
                    lambda *_: _on_optimizer_start(recorder, fake_params))))
                if mixed is not None:
                    stack.enter_context(master_weight_hooks(opt, fake_params, fake_masters, scaling))
                stack.enter_context(_hook(opt.register_step_post_hook(
                    lambda *_: recorder.event("optimizer_end"))))
            stack.enter_context(_track_backward(recorder, fake_params, scaling[1] if scaling else None))
            user_out = train_step(*call_args)
            recorder.event("step_end")
            return _collect_outputs(user_out, binding, modules, optimizers, slots, fakes, fake_params,
                                    fake_masters, out_slots, out_meta)

    # make_fx keeps source lines of frames named "forward" only; the train step's own lines matter as much
    torch.fx.proxy._register_stack_trace_anchor(train_step)
    try:
        gm = make_fx(traced, tracing_mode="fake", record_stack_traces=True)(*real_inputs)
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as e:
        source = user_frame(e.__traceback__)
        construct = ("Python control flow on .item(): a number read from a tensor decides a branch"
                     if source and ".item()" in source else
                     "Python control flow on a tensor value: bool() of a tensor decides a branch")
        raise CaptureError(
            construct,
            source=source,
            hint="compute both branches with torch.where, or move the decision out of the train step",
        ) from None
    except DynamicOutputShapeException as e:
        raise CaptureError(
            f"an op whose output shape depends on tensor values ({e.args[0] if e.args else 'data-dependent'})",
            source=user_frame(e.__traceback__),
        ) from None
    gm.graph._codegen = fx.graph.CodeGen()  # plain positional inputs and a flat list of outputs
    recorder.tag_rest(gm.graph)
    for node, slot in recorder.grad_nodes:
        node.meta[TAG].slots.append(slot)
    _tag_placeholders(gm.graph, slots)
    _check_param_mutations(gm.graph)
    slots = _drop_unread_grads(gm.graph, slots)
    _hyperparams_as_floats(gm.graph)
    kept = _tag_outputs(gm.graph, out_slots)
    gm.recompile()
    return CapturedStep(gm, slots, kept, out_meta["spec"], out_meta["constants"],
                        trace_seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _hook(handle):
    try:
        yield
    finally:
        handle.remove()


def _on_optimizer_start(recorder: _PhaseRecorder, fake_params: dict) -> None:
    recorder.event("optimizer_start")
    recorder.note_grads(fake_params, Role.OPTIMIZER_GRAD)


@contextlib.contextmanager
def _track_backward(recorder: _PhaseRecorder, fake_params: dict, loss_scale: torch.Tensor | None):
    """Phase events around ``torch.autograd.backward``; with loss scaling, backward starts from loss * scale."""
    real_backward = torch.autograd.backward

    def backward(*a, **k):
        if loss_scale is not None:
            if not (a and isinstance(a[0], torch.Tensor) and a[0].numel() == 1):
                raise CaptureError("loss scaling needs backward() of one scalar loss",
                                   hint="call loss.backward() on the scalar loss")
            a = (a[0].float() * loss_scale,) + a[1:]
        recorder.event("backward_start")
        try:
            return real_backward(*a, **k)
        finally:
            recorder.event("backward_end")
            recorder.note_grads(fake_params, Role.GRAD)

    with mock.patch.object(torch.autograd, "backward", backward):
        yield


@contextlib.contextmanager
def _swap_optimizer(opt, oi: int, binding: StepBinding, slots: list[Slot], fakes: dict, fake_params: dict):
    """Point the optimizer at the traced parameters (``fake_params``: fqn -> what it updates, the master weights
    under mixed precision), state and tensor hyperparameters; restore it after."""
    spec = optim_support.spec_for(opt)
    fqn_of = binding.fqn_of
    fake_state = {(s.fqn, s.key): fakes[i] for i, s in enumerate(slots)
                  if s.role == Role.OPT_STATE and s.optimizer == oi}
    hyper = {(s.group, s.key): fakes[i] for i, s in enumerate(slots)
             if s.role == Role.HYPERPARAM and s.optimizer == oi}
    saved_groups = [dict(g) for g in opt.param_groups]
    saved_state = opt.state
    new_state = type(saved_state)(dict) if isinstance(saved_state, dict) else {}
    for gi, group in enumerate(opt.param_groups):
        fakes_in_group = []
        for p in group["params"]:
            fp = fake_params[fqn_of[id(p)]]
            fakes_in_group.append(fp)
            if p in saved_state:
                new_state[fp] = {k: fake_state.get((fqn_of[id(p)], k), v) for k, v in saved_state[p].items()}
        group["params"] = fakes_in_group
        for hkey in spec.tensor_hyperparams:
            # .item() in the graph: the optimizer computes with a Python float, in double, exactly as eager does
            value = hyper[(gi, optim_support.hyperparam_name(hkey))].item()
            optim_support.write_hyperparam(group, hkey, value)
        for flag, value in optim_support.KERNEL_FLAGS.items():
            if flag in group:
                group[flag] = value
    opt.state = new_state
    try:
        yield
    finally:
        for group, saved in zip(opt.param_groups, saved_groups):
            group.clear()
            group.update(saved)
        opt.state = saved_state


def _collect_outputs(user_out, binding, modules, optimizers, slots, fakes, fake_params, fake_masters,
                     out_slots, out_meta) -> list:
    """Flatten what the graph must return (user outputs, write-backs) and what capture only tags."""
    values = []

    def emit(value, slot, keep=True):
        values.append(value)
        out_slots.append((slot, keep))

    leaves, spec = pytree.tree_flatten(user_out)
    constants = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            emit(leaf, Slot(Role.USER_OUTPUT, key=str(i)))
        elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise CaptureError(
                f"the train step returns a Python number computed from a tensor (output leaf {i})",
                hint="return the tensor itself (e.g. loss, not loss.item()); read .item() after the step",
            )
        else:
            constants[i] = leaf
    out_meta["spec"], out_meta["constants"] = spec, constants
    for fqn, p in fake_params.items():
        if p.grad is not None and not any(s.role == Role.MASTER for s in slots):  # mixed: grads stay inside
            emit(p.grad, Slot(Role.GRAD_OUT, fqn))
    input_fakes = {id(fakes[i]) for i in range(len(slots))}
    fqn_of_fake = {id(p): fqn for fqn, p in {**fake_params, **fake_masters}.items()}
    for oi, opt in enumerate(optimizers):
        for fp, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and id(value) not in input_fakes:
                    emit(value, Slot(Role.NEW_STATE, fqn_of_fake[id(fp)], key, optimizer=oi))
    fake_buffers = {id(fakes[i]) for i, s in enumerate(slots) if s.role == Role.BUFFER}
    for pos, module in zip(binding.module_positions, modules):
        prefix = "" if len(modules) == 1 else f"arg{pos}."
        for name, buf in module.named_buffers(remove_duplicate=False):
            if buf is not None and id(buf) not in fake_buffers:
                emit(buf, Slot(Role.NEW_BUFFER, binding.buffer_aliases.get(prefix + name, prefix + name)))
    for fqn, p in fake_params.items():
        if p.requires_grad:
            emit(p, Slot(Role.UPDATED_PARAM, fqn), keep=False)
    return values


def _tag_placeholders(graph: fx.Graph, slots: list[Slot]) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, slots):
        node.meta[TAG] = NodeTag(Phase.FORWARD, 0, [slot])
        node._rename(_placeholder_name(slot))  # readable dumps: p__wte_weight, state__exp_avg__wte_weight
        node.target = node.name


def _drop_unread_grads(graph: fx.Graph, slots: list[Slot]) -> list[Slot]:
    """Most steps reset .grad before backward: then incoming gradients are not inputs, and not part of the key."""
    kept = []
    for node, slot in zip([n for n in graph.nodes if n.op == "placeholder"], slots):
        if slot.role == Role.GRAD_IN and not node.users:
            graph.erase_node(node)
        else:
            kept.append(slot)
    return kept


def _hyperparams_as_floats(graph: fx.Graph) -> None:
    """Each hyperparameter was traced as a 0-dim tensor read once with .item(): make the graph input the float."""
    for node in graph.nodes:
        if node.op == "placeholder" and node.meta[TAG].has(Role.HYPERPARAM):
            for reader in list(node.users):
                if reader.target is torch.ops.aten._local_scalar_dense.default:
                    node.meta["val"] = reader.meta["val"]
                    reader.replace_all_uses_with(node)
                    graph.erase_node(reader)


def _placeholder_name(slot: Slot) -> str:
    stem = {Role.PARAM: "p", Role.MASTER: "master", Role.LOSS_SCALE: "loss_scale",
            Role.GROWTH_TRACKER: "growth_tracker", Role.BUFFER: "buf", Role.GRAD_IN: "grad", Role.OPT_STATE: "state",
            Role.HYPERPARAM: "hp", Role.BATCH: "batch"}[slot.role]
    parts = [stem] + [x for x in (slot.key, slot.fqn) if x]
    if slot.group is not None:
        parts.append(f"g{slot.group}")
    if slot.optimizer:
        parts.append(f"o{slot.optimizer}")
    name = "__".join(parts)
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def _tag_outputs(graph: fx.Graph, out_slots: list[tuple[Slot, bool]]) -> list[Slot]:
    output = next(n for n in graph.nodes if n.op == "output")
    flat = list(output.args[0])
    kept_values, kept_slots = [], []
    for value, (slot, keep) in zip(flat, out_slots):
        if keep:
            kept_values.append(value)
            kept_slots.append(slot)
        elif isinstance(value, fx.Node):
            value.meta[TAG].slots.append(slot)
    output.args = (kept_values,)
    output.meta[TAG].slots = kept_slots  # passes that drop or add outputs keep this list in step
    return kept_slots


def _check_param_mutations(graph: fx.Graph) -> None:
    """A parameter may only be written by the optimizer: anything else would train something else when sharded."""
    for node in graph.nodes:
        if not is_mutating(node) or node.meta[TAG].in_optimizer_step:
            continue
        root = storage_root(node)
        tag = root.meta.get(TAG)
        if root.op == "placeholder" and tag and tag.has(Role.PARAM):
            fqn = tag.slots[0].fqn
            raise CaptureError(
                f"in-place update of parameter '{fqn}' outside the optimizer ({node.target})",
                source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
                hint="update parameters only through optimizer.step(), or make the tensor a buffer",
            )
