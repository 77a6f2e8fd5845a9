"""Capture one training step (forward, backward, optimizer update) as a single ATen FX graph.

Why make_fx over the whole step rather than AOTAutograd's joint graph: the user's step calls ``loss.backward()`` and
``optimizer.step()`` itself, and make_fx traces exactly that, optimizer included, into one graph. AOTAutograd would
give forward and backward only and leave the optimizer to a second trace. We do not functionalize: make_fx already
records the optimizer's in-place updates (``param.addcdiv_``, ``exp_avg.lerp_``) on the graph's inputs, so the step
updates parameters and moments where they live and its peak is eager's, with no copy-back of a second set of state.
Passes therefore respect one rule: a node never moves across a write into the storage it reads.

Every placeholder is a parameter, buffer, pre-existing gradient, optimizer state tensor, optimizer hyperparameter or
batch leaf, tagged with a `Slot`. Every node gets a `NodeTag` with its phase and micro-batch, found by recording the
graph as it grows when a module's forward, ``torch.autograd.backward`` and the optimizer's step begin and end
(`zerofx.trace_events`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils import stateless

from zerofx import guards, optim_support
from zerofx.binding import StepBinding, hyperparam_traced_as_tensor, input_slots, input_values, present_grads
from zerofx.errors import CaptureError, raised_in_zerofx, user_frame, user_frame_from_stack_trace
from zerofx.fake_kernels import cpu_dtypes_for_grouped_mm
from zerofx.mesh import DTensorSpecs, local, rebuild
from zerofx.rng import traced_rng_state
from zerofx.mixed_precision import (MixedPrecision, MixedPrecisionTrace, NormsWithStatistics, cast_floating_inputs,
                                    drop_superseded_conversions)
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot, is_mutating, storage_root
from zerofx.trace_events import (HandedToPython, PhaseRecorder, RegionRecorder, at_update_start, hook,
                                 on_optimizer_start, refuse_scheduler_steps, swap_optimizer, track_backward,
                                 traced_node)
from zerofx.units import UnitRule, picked_modules

log = logging.getLogger("zerofx")


@dataclass
class CapturedStep:
    gm: fx.GraphModule
    inputs: list[Slot]
    outputs: list[Slot]
    user_out_spec: pytree.TreeSpec
    user_out_constants: dict[int, Any]  # leaves of the user's output that are not tensors
    grads_left: frozenset[str] = frozenset()  # parameters whose .grad eager leaves set after the step
    # each module argument's modules' ``training`` flags as the step leaves them, where it changes one
    # (``model.train()`` inside the step): a run of the graph sets them again, as the step's code would
    modes_left: tuple[tuple[bool, ...], ...] | None = None
    # parameters whose stand-in gradient was still unread in .grad when backward started: backward would have added
    # to an incoming gradient there (the stand-in was taken away first, so the graph is the call's own)
    added_to_at_backward: frozenset[str] = frozenset()
    # parameters whose stand-in the step's own code held (`HandedToPython`): the graph may be another call's
    standins_handed: frozenset[str] = frozenset()
    # parameters whose gradient, as an update starts, no backward left (set by hand), with the user's line
    grads_set_by_hand: dict[str, str | None] = dataclasses.field(default_factory=dict)
    # what the trace changed in Python (`refuse_repeated_side_effects`): name -> what it did
    side_effects: dict[str, str] = dataclasses.field(default_factory=dict)


def capture(train_step: Callable, binding: StepBinding, args: tuple,
            override: Callable[[Slot], Any] | None = None, mixed: MixedPrecision | None = None,
            grads: list[str] = (), checkpoint: UnitRule | None = None,
            specs: DTensorSpecs | None = None) -> CapturedStep:
    """Trace ``train_step(*args)`` with fake tensors into a tagged ATen graph. Nothing real is computed or changed.
    ``override`` supplies stand-ins for state the module no longer holds (a sharded step re-tracing); ``mixed``
    traces forward and backward in its ``param_dtype`` with the optimizer on fp32 master weights; ``grads`` names
    the parameters whose ``.grad`` the step finds set (the graph keeps those it reads as inputs; one the call has
    none of is a stand-in, which is taken away if still in ``.grad``, unread, when backward starts, and recorded as
    added to: `CapturedStep.added_to_at_backward`); the forward nodes of each module ``checkpoint`` picks are marked
    as a region (`RegionRecorder`) for the pass that recomputes them.
    The inputs ``specs`` names enter as local tensors and are DTensors again inside the trace (`zerofx.mesh`)."""
    optimizers = binding.optimizers(args)
    modules = binding.modules(args)
    for opt in optimizers:
        optim_support.init_lazy_state(opt)
    slots = input_slots(binding, args, mixed, grads)
    real_inputs = input_values(binding, args, slots, for_trace=True, override=override, mixed=mixed)
    dtensor_specs = {i: spec for i, s in enumerate(slots) if specs and (spec := specs.of(s)) is not None}
    for i in dtensor_specs:  # the rebuilt DTensor is the autograd leaf, its local tensor a plain graph input
        real_inputs[i] = real_inputs[i].detach()
    batch_structure = binding.batch(args)
    recorder = PhaseRecorder()
    regions = RegionRecorder(recorder)
    checkpointed = [] if checkpoint is None else picked_modules(modules, binding.module_prefixes, checkpoint)
    if checkpoint is not None and not checkpointed:
        log.warning("zerofx: checkpoint=%r picks no module of the step's models: nothing is recomputed ('blocks' are "
                    "the modules of a ModuleList or Sequential of one class)",
                    getattr(checkpoint, "__name__", checkpoint))
    out_slots: list[tuple[Slot, bool]] = []  # (slot, keep as a graph output)
    out_meta: dict[str, Any] = {}
    mixed_traces: list[MixedPrecisionTrace] = []  # made inside the trace, read after it
    standins = set(grads) - set(present_grads(binding))
    added_to_at_backward: set[str] = set()
    handed_to_python: set[str] = set()  # filled inside the trace
    grads_set_by_hand: dict[str, str | None] = {}  # filled inside the trace
    modes_before = binding.training_modes(args)
    plain_before = (guards.module_attributes(binding, args), guards.function_values(train_step),
                    guards.hook_objects(binding, args))

    def traced(*flat):
        fakes = dict(zip(range(len(slots)), flat))
        for i, spec in dtensor_specs.items():
            s = slots[i]
            fakes[i] = rebuild(fakes[i], spec, s.role == Role.PARAM and binding.params[s.fqn].requires_grad)
        fake_params = {s.fqn: fakes[i] for i, s in enumerate(slots) if s.role == Role.PARAM}
        fake_masters = {s.fqn: fakes[i] for i, s in enumerate(slots) if s.role == Role.MASTER}
        fake_buffers = {s.fqn: fakes[i] for i, s in enumerate(slots) if s.role == Role.BUFFER}
        by_role = {s.role: fakes[i] for i, s in enumerate(slots)}
        # the optimizers update local tensors: every supported update is elementwise, the same on a shard
        local_fakes = {i: local(f) for i, f in fakes.items()}
        optimizer_targets = {fqn: local(p) for fqn, p in {**fake_params, **fake_masters}.items()}
        standins_in = {}  # fqn: (the tensor whose .grad holds a stand-in, the stand-in, its input node)
        incoming_grads = {}
        for i, s in enumerate(slots):
            if s.role == Role.GRAD_IN:  # under mixed precision, the fp32 master's gradient
                holder = (fake_masters if mixed is not None else fake_params)[s.fqn]
                holder.grad = incoming_grads[s.fqn] = fakes[i]
                if s.fqn in standins:
                    standins_in[s.fqn] = holder, fakes[i], traced_node(fakes[i])
        batch_fakes = iter(fakes[i] for i, s in enumerate(slots) if s.role == Role.BATCH)
        batch = pytree.tree_map_only(torch.Tensor, lambda _: next(batch_fakes), batch_structure)
        call_args = list(args)
        rest = iter(batch)
        for i in range(len(call_args)):
            if i not in binding.module_positions and i not in binding.optimizer_positions:
                call_args[i] = next(rest)
        compute_views = _module_views(binding, modules, {**fake_params, **fake_buffers})
        mixed_trace = None if mixed is None else MixedPrecisionTrace(
            mixed.scaling, by_role.get(Role.LOSS_SCALE), by_role.get(Role.GROWTH_TRACKER), fake_params, fake_masters,
            _module_views(binding, modules, {**fake_params, **fake_masters, **fake_buffers}))
        if mixed_trace is not None:
            mixed_traces.append(mixed_trace)

        def forward_start(*_):
            recorder.event("forward_start")
            if mixed_trace is not None:
                mixed_trace.show_compute()

        handed = HandedToPython({fqn: standin for fqn, (_, standin, _) in standins_in.items()}, handed_to_python)

        def withdraw_standins():
            """Backward would add to a stand-in still in .grad. Where no op has read it and the step's code has not
            held it, taking it away now leaves the rest of the trace the call's own, as if it never had one. (This
            counts a parameter backward gives no gradient as added to, as the optimizer's read of the stand-in did.)"""
            for fqn, (holder, standin, node) in standins_in.items():
                if holder.grad is standin and not node.users and fqn not in handed_to_python:
                    holder.grad = None
                    added_to_at_backward.add(fqn)

        def incoming(fqn: str, grad: torch.Tensor) -> bool:
            """An earlier call's gradient, or a stand-in for one (written in place, perhaps), still in .grad."""
            return fqn in incoming_grads and (fqn not in standins or grad is incoming_grads[fqn])

        def optimizer_end(opt):
            if mixed_trace is not None:
                mixed_trace.after_optimizer_step(opt)
            recorder.event("optimizer_end")

        with contextlib.ExitStack() as stack:
            for module, mapping in compute_views:
                stack.enter_context(stateless._reparametrize_module(module, mapping))
                stack.enter_context(hook(module.register_forward_pre_hook(forward_start)))
                if mixed is not None and mixed.cast_forward_inputs:
                    stack.enter_context(hook(module.register_forward_pre_hook(
                        cast_floating_inputs(mixed.param_dtype), with_kwargs=True)))
            if mixed is not None:
                stack.enter_context(NormsWithStatistics())
            if mixed_trace is not None:  # a submodule called directly after backward computes in param_dtype too
                stack.enter_context(hook(torch.nn.modules.module.register_module_forward_pre_hook(
                    lambda *_: mixed_trace.show_compute())))
            for oi, opt in enumerate(optimizers):
                stack.enter_context(swap_optimizer(opt, oi, binding, slots, local_fakes,
                                                   {**fake_params, **fake_masters}, optimizer_targets))
                stack.enter_context(at_update_start(opt, lambda: on_optimizer_start(recorder, fake_params, incoming,
                                                                                       grads_set_by_hand)))
                stack.enter_context(hook(opt.register_step_post_hook(lambda o, *_: optimizer_end(o))))
            stack.enter_context(track_backward(recorder, fake_params, mixed_trace, withdraw_standins))
            stack.enter_context(refuse_scheduler_steps())
            for path, module in checkpointed:
                stack.enter_context(regions.watch(path, module))
            if mixed_trace is not None:
                stack.enter_context(mixed_trace.zero_grad_reaches_both())
            if standins_in:
                stack.enter_context(handed)
            user_out = train_step(*call_args)
            if mixed_trace is not None:
                mixed_trace.at_step_end()
            recorder.event("step_end")
            return _collect_outputs(user_out, binding, modules, optimizers, slots, fakes, fake_params,
                                    fake_masters, out_slots, out_meta)

    # make_fx keeps source lines of frames named "forward" only; the train step's own lines matter as much
    torch.fx.proxy._register_stack_trace_anchor(train_step)
    try:
        # torch.utils.checkpoint's saved generator state: ops in the graph
        with traced_rng_state(), cpu_dtypes_for_grouped_mm():
            gm = make_fx(traced, tracing_mode="fake", record_stack_traces=True)(*real_inputs)
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as e:
        source = user_frame(e.__traceback__)
        if _inside_grad_scaler(e.__traceback__):
            raise CaptureError(
                "torch.amp.GradScaler inside the train step: its step() reads on the host whether a gradient is "
                "not finite, to decide whether to update", source=source,
                hint="drop the scaler (and float16 autocast) from the step and compile with "
                     "mixed_precision=zerofx.MixedPrecision(torch.float16), whose loss scaling does what GradScaler "
                     "does (scale, unscale before your code reads gradients, skip a non-finite update on every rank, "
                     "grow or back off the scale) inside the graph; or autocast to bfloat16, which needs no scaler"
            ) from None
        in_module = _number_read_in_torch_nn(e.__traceback__)
        if in_module:
            raise CaptureError(
                f"a torch.nn module reads a number from a tensor into Python while the step traces ({in_module}): "
                "the trace has a symbol there, not the number", source=source,
                hint="configure the module so that it computes with tensors (BatchNorm with momentum=None divides "
                     "by its batch count read as a number: give it a momentum)") from None
        if source and _NUMBER_READ.search(source):
            raise CaptureError(
                "Python uses a number read from a tensor (.item(), float(), int()) while the step traces (a branch, "
                "a print or format): the trace has a symbol there, not the number, and later calls run no Python",
                source=source, hint="compute with the tensor (torch.where for a branch), or return the tensor and "
                                    "read the number after the step") from None
        if source and _SIZE_READ.search(source):
            raise CaptureError(
                "Python control flow on a size that depends on tensor values (the output of nonzero, unique or "
                "boolean-mask indexing): the graph has one shape for every call", source=source,
                hint="compute with masks of a fixed size (torch.where) instead of selecting elements, or choose the "
                     "branch outside the step (a Hugging Face model: set the config option that decides it)") from None
        raise CaptureError(
            "Python control flow on a tensor value: bool() of a tensor decides a branch",
            source=source,
            hint="compute both branches with torch.where, or move the decision out of the train step",
        ) from None
    except TypeError as e:
        if "FakeTensor" not in str(e) or raised_in_zerofx(e.__traceback__):
            raise
        raise _tensor_as_python_number(e) from None
    except DynamicOutputShapeException as e:
        raise CaptureError(
            f"an op whose output shape depends on tensor values ({e.args[0] if e.args else 'data-dependent'})",
            source=user_frame(e.__traceback__),
        ) from None
    gm.graph._codegen = fx.graph.CodeGen()  # plain positional inputs and a flat list of outputs
    for mixed_trace in mixed_traces:
        drop_superseded_conversions(gm.graph, mixed_trace.conversions)
    recorder.tag_rest(gm.graph)
    for node, slot in recorder.grad_nodes:
        node.meta[TAG].slots.append(slot)
    _refuse_sparse_tensors(gm.graph)
    _refuse_ops_mixing_dtypes(gm.graph, binding, mixed)
    _out_arguments_as_copies(gm.graph)
    _tag_placeholders(gm.graph, slots)
    _check_param_mutations(gm.graph)
    slots = _drop_unread_grads(gm.graph, slots)
    _hyperparams_as_floats(gm.graph, {s for s in slots if s.role == Role.HYPERPARAM
                                      and hyperparam_traced_as_tensor(optimizers[s.optimizer], s)})
    _refuse_numbers_read_into_python(gm.graph)
    kept = _tag_outputs(gm.graph, out_slots)
    # every pass ends with recompile(); a lazy module generates the Python code once, when the step first runs
    gm = _LazyGraphModule.from_graphmodule(gm)
    side_effects = _python_side_effects(plain_before, binding, args, train_step)
    modes_after = binding.training_modes(args)
    return CapturedStep(gm, slots, kept, out_meta["spec"], out_meta["constants"], out_meta["grads_left"],
                        modes_after if modes_after != modes_before else None, frozenset(added_to_at_backward),
                        frozenset(handed_to_python), grads_set_by_hand, side_effects)


def _number_read_in_torch_nn(tb) -> str | None:
    """Where the traceback ``tb`` passes through a torch.nn module's code that reads a number from a tensor (the
    file from ``torch/nn`` on, the line and its code), or None."""
    for frame in traceback.extract_tb(tb):
        path = os.path.relpath(frame.filename, os.path.dirname(os.path.dirname(torch.__file__)))
        if path.startswith(os.path.join("torch", "nn", "")) and _NUMBER_READ.search(frame.line or ""):
            return f"{path}:{frame.lineno}: {frame.line.strip()}"
    return None


def _inside_grad_scaler(tb) -> bool:
    """Whether the traceback ``tb`` passes through ``torch.amp.GradScaler`` (or its ``torch.cuda.amp`` subclass)."""
    return any(frame.f_code.co_filename.endswith(os.path.join("amp", "grad_scaler.py"))
               for frame, _ in traceback.walk_tb(tb))


def _python_side_effects(before: tuple, binding: StepBinding, args: tuple, train_step: Callable) -> dict[str, str]:
    """What the trace changed in Python that later calls, which run the graph, would not change again: a plain value
    (a counter in ``forward``, a global it assigns) or a module hook it registered; by name, with what it did. One
    that removes itself as it runs is gone at the next call, which traces once more."""
    attributes, values = ({value[:-1]: value[-1] for value in part} for part in before[:2])
    added = [guards.hook_name(h) for h in guards.hook_objects(binding, args) if not any(h is b for b in before[2])]
    effects = {f"{_HOOK} {name}": f"registers a module hook in Python ({name})" for name in added}
    for (j, name), new in {a[:-1]: a[-1] for a in guards.module_attributes(binding, args)}.items():
        if attributes.get((j, name), "unset") != new:
            paths = [f"arg{pos}.{n}" if len(binding.module_positions) > 1 else n
                     for pos, module in zip(binding.module_positions, binding.modules(args))
                     for n, _ in module.named_modules()]
            where = f"'{paths[j]}.{name}'" if paths[j] else f"'{name}' of the model"
            old = repr(attributes[j, name]) if (j, name) in attributes else "unset"
            effects[f"module attribute {where}"] = f"changes module attribute {where} in Python ({old} -> {new!r})"
    for (name,), new in {v[:-1]: v[-1] for v in guards.function_values(train_step)}.items():
        if values.get((name,), "unset") != new:
            effects[f"global '{name}'"] = f"changes global '{name}' in Python ({values.get((name,), 'unset')} -> {new})"
    return effects


_HOOK = "module hook"  # how `_python_side_effects` names a hook the trace registered


def values_changed(effects: dict[str, str]) -> list[str]:
    """What of ``effects`` changed a value (an attribute, a global), not a hook, which stays registered."""
    return [what for name, what in effects.items() if not name.startswith(_HOOK)]


def refuse_repeated_side_effects(effects: dict[str, str], seen: set[str]) -> None:
    """A Python side effect of a trace is what eager does too on that call, and one the step makes once (a hook
    installed behind a flag, as transformers installs its output-capturing hooks) does not recur when the changed
    step traces again. One that an earlier trace of the step made too (``seen``) would happen on every eager call that
    makes it and only on traces here: refused, naming it. (The step does not run a graph whose trace made one again
    without tracing: `CompiledStep._prepare`.)"""
    again = [name for name in effects if name in seen]
    if again:
        raise CaptureError(f"the step {effects[again[0]]} again as it traces again: a compiled step runs its Python "
                           "only when it traces, so a change eager makes on more than one call would happen on "
                           "traces only",
                           hint="make the change outside the step (in the training loop), keep the value in a tensor "
                                "(a buffer) the step updates in place, or register hooks before the first call (a "
                                "library's hooks that its model installs on its first forward: run one forward "
                                "eagerly, under torch.no_grad(), before the first call)")
    seen.update(effects)


def _module_views(binding: StepBinding, modules: list, tensors: dict) -> list[tuple[Any, dict]]:
    """(module, name -> tensor) for every module argument and every name its parameters and buffers go by."""
    views = []
    for pos, module in zip(binding.module_positions, modules):
        prefix = "" if len(modules) == 1 else f"arg{pos}."
        mapping = {n: tensors[binding.param_aliases[prefix + n]]
                   for n, _ in module.named_parameters(remove_duplicate=False)}
        mapping.update({n: tensors[binding.buffer_aliases[prefix + n]]
                        for n, _ in module.named_buffers(remove_duplicate=False)})
        views.append((module, mapping))
    return views


def _collect_outputs(user_out, binding, modules, optimizers, slots, fakes, fake_params, fake_masters,
                     out_slots, out_meta) -> list:
    """Flatten what the graph must return (user outputs, write-backs) and what capture only tags."""
    values = []

    def emit(value, slot, keep=True):
        values.append(local(value))
        out_slots.append((slot, keep))

    leaves, spec = pytree.tree_flatten(user_out)
    constants = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DTensor):
            raise CaptureError(f"the train step returns a DTensor (output leaf {i}, placements {leaf.placements})",
                               hint="return leaf.full_tensor() or a plain tensor such as the loss")
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
    out_meta["grads_left"] = frozenset(f for f, p in {**fake_params, **fake_masters}.items() if p.grad is not None)
    # under mixed precision the fp32 masters' (which runtime.build keeps only for a later call)
    for fqn, p in (fake_masters or fake_params).items():
        if p.grad is not None:
            emit(p.grad, Slot(Role.GRAD_OUT, fqn))
    with_grads = set()  # a batch input that requires grad, as eager leaves it: once, where it is passed twice
    for i, s in enumerate(slots):
        if s.role == Role.BATCH and fakes[i].grad is not None and id(fakes[i]) not in with_grads:
            with_grads.add(id(fakes[i]))
            emit(fakes[i].grad, Slot(Role.BATCH_GRAD, key=s.key))
    input_fakes = {id(local(fakes[i])) for i in range(len(slots))}
    fqn_of_fake = {id(local(p)): fqn for fqn, p in {**fake_params, **fake_masters}.items()}
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


def _out_arguments_as_copies(graph: fx.Graph) -> None:
    """An op writing its result into an ``out=`` argument (Adamax's ``torch.maximum(a, b, out=exp_inf)``) becomes the
    functional op and ``copy_(out, result)``: the passes follow a write through an op's first argument, as for
    ``add_`` (float16's skipped steps keep the old value of what a step writes; sharding sees the write's target).
    Only where the functional op gives what ``out`` holds, dtype and shape: an ``out`` of another dtype makes the op
    compute in that dtype, one of another shape is resized; those stay as they are."""
    for node in list(graph.nodes):
        functional = _functional_of(node.target) if node.op == "call_function" else None
        if functional is None:
            continue
        kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        out = node.kwargs["out"]
        fake_args, fake_kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, kwargs))
        with out.meta["val"].fake_mode:
            value = functional(*fake_args, **fake_kwargs)
        if (value.dtype, value.shape) != (out.meta["val"].dtype, out.meta["val"].shape):
            continue
        with graph.inserting_before(node):
            result = graph.call_function(functional, node.args, kwargs)
            written = graph.call_function(torch.ops.aten.copy_.default, (out, result))
        result.meta.update(node.meta, **{TAG: dataclasses.replace(node.meta[TAG], slots=[]), "val": value})
        written.meta.update(node.meta)
        node.replace_all_uses_with(written)
        graph.erase_node(node)


def _functional_of(op) -> torch._ops.OpOverload | None:
    """For an ATen op whose one written argument is a tensor ``out=``, its overload that takes the other arguments and
    returns a new tensor (``maximum.out`` -> ``maximum.default``); None for any other op."""
    schema = getattr(op, "_schema", None)
    if schema is None or not isinstance(op, torch._ops.OpOverload):
        return None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if [(a.name, a.kwarg_only, str(a.type)) for a in written] != [("out", True, "Tensor")]:
        return None
    inputs = [(a.name, str(a.type)) for a in schema.arguments if a.name != "out"]
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)._schema
        if [(a.name, str(a.type)) for a in candidate.arguments] == inputs and not candidate.is_mutable:
            return getattr(packet, name)
    return None


def _hyperparams_as_floats(graph: fx.Graph, as_tensors: set[Slot]) -> None:
    """Each hyperparameter given as a number was traced as a 0-dim tensor read once with .item(): make the graph
    input the float. Those in ``as_tensors`` stay the tensors the user gave, and a write into one is refused: the
    graph reads them at every call, so a value the step sets (a scheduler filling a tensor lr) would be lost."""
    for node in graph.nodes:
        if node.op != "placeholder" or not node.meta[TAG].has(Role.HYPERPARAM):
            continue
        if as_tensors.intersection(node.meta[TAG].slots):
            _refuse_writes_into(node)
            continue
        for reader in list(node.users):
            if reader.target is torch.ops.aten._local_scalar_dense.default:
                node.meta["val"] = reader.meta["val"]
                reader.replace_all_uses_with(node)
                graph.erase_node(reader)


_SIZE_READ = re.compile(r"\.size\(|\.shape\b|\.numel\(\)|\blen\(")  # in a source line: Python reads a size
_NUMBER_READ = re.compile(r"\.item\(\)|\.tolist\(\)|\b(float|int)\(")  # in a source line: Python takes a number


def _refuse_numbers_read_into_python(graph: fx.Graph) -> None:
    """A number the step reads from a tensor (``.item()``, ``float()``, ``.tolist()``) that no op of the graph uses
    went to Python alone (a log list, a print): the trace hands Python a symbol there, once, and the graph's runs
    run no Python. Refused, naming the line. (Hyperparameters' reads are the graph's inputs by now; what an optimizer
    reads from its state, a step count, is read from an input.)"""
    for node in graph.nodes:
        if node.target is torch.ops.aten._local_scalar_dense.default and not node.users \
                and storage_root(node.args[0]).op != "placeholder":
            raise CaptureError(
                "the train step reads a number from a tensor into Python (.item(), float(), .tolist()) and no op of "
                "the step uses it: a compiled step runs its Python only when it traces, so a log or a print there "
                "gets a symbol, once, not the number on every call",
                source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
                hint="return the tensor (the loss, or a dict of what to log) and read .item() after the step")


def _tensor_as_python_number(e: TypeError) -> CaptureError:
    """torch refused a traced tensor where its signature wants Python numbers (a size, a list of ints): eagerly the
    tensor's value would be read there."""
    through_rnn = any(frame.f_code.co_filename.endswith(os.path.join("nn", "modules", "rnn.py"))
                      for frame, _ in traceback.walk_tb(e.__traceback__))
    hint = ("a packed sequence's batch sizes are tensor values: run the RNN on the padded batch and mask the padded "
            "positions" if through_rnn else
            "compute the number from tensor shapes or pass it to the step as a Python int")
    return CaptureError(f"a tensor's value used as a Python number while the step traces ({e}): the trace has no "
                        "value there, and the graph would fix one size for every call",
                        source=user_frame(e.__traceback__), hint=hint)


# ops torch refuses eagerly when their floating inputs differ in dtype, which fake kernels let through
_SAME_DTYPE_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "dot", "vdot", "convolution"))


def _refuse_ops_mixing_dtypes(graph: fx.Graph, binding: StepBinding, mixed: MixedPrecision | None) -> None:
    """No op of `_SAME_DTYPE_OPS` meets floating inputs of two dtypes (the graph would fail as it first ran, naming
    no line). Under mixed precision the parameters compute in ``param_dtype`` while buffers keep theirs (as under
    FSDP2's policy): the hint names the buffers that may have brought in the other."""
    for node in graph.nodes:
        if node.target not in _SAME_DTYPE_OPS:
            continue
        dtypes = {a.meta["val"].dtype for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point()}
        if len(dtypes) < 2:
            continue
        what = f"an op meets tensors of different dtypes ({node.target} on {' and '.join(sorted(map(str, dtypes)))})"
        source = user_frame_from_stack_trace(node.meta.get("stack_trace"))
        if mixed is None:
            raise CaptureError(what, source=source)
        others = [f"'{fqn}' ({b.dtype})" for fqn, b in binding.buffers.items()
                  if b.is_floating_point() and b.dtype != mixed.param_dtype]
        held = f"; the step's floating buffers not in {mixed.param_dtype}: {', '.join(others[:4])}" if others else ""
        raise CaptureError(
            f"{what} under mixed_precision", source=source,
            hint=f"parameters compute in {mixed.param_dtype} while buffers keep their dtype, as under FSDP2's "
                 f"policy{held}: cast a buffer where forward reads it (buf.to(x.dtype)), or compile without "
                 "mixed_precision and autocast inside the step, which casts each op's inputs")


def _refuse_sparse_tensors(graph: fx.Graph) -> None:
    """Every tensor the step computes is dense (strided): the passes shard, bucket and plan dense storage. A sparse
    gradient (``nn.Embedding(sparse=True)``) is refused naming its parameter."""
    sparse = [n for n in graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor) and v.layout != torch.strided]
    if not sparse:
        return
    grads = [(n, slot.fqn) for n in sparse for slot in n.meta[TAG].slots if slot.role == Role.GRAD]
    node, what = grads[0] if grads else (sparse[0], None)
    what = f"the gradient of parameter '{what}'" if what else f"a tensor of {node.target}"
    raise CaptureError(
        f"{what} is sparse ({node.meta['val'].layout}): zerofx shards, reduces and plans dense tensors only",
        source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
        hint="construct nn.Embedding / nn.EmbeddingBag with sparse=False (the default): its gradient is then dense, "
             "as FSDP2 requires too")


def _refuse_writes_into(hyperparam: fx.Node) -> None:
    for node in hyperparam.graph.nodes:
        if is_mutating(node) and storage_root(node) is hyperparam:
            raise CaptureError(
                f"the train step writes into hyperparameter {hyperparam.meta[TAG].slots[0].describe()}, a tensor "
                "(as an LR scheduler's step() inside the step fills a tensor lr): it would be traced once, not "
                "applied at every call",
                source=user_frame_from_stack_trace(node.meta.get("stack_trace")),
                hint="step schedulers and set hyperparameters outside the compiled step; it reads them at every call")


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
