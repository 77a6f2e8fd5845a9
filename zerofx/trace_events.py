"""What capture hooks into while make_fx traces: phase events, backward (and loss scaling), the optimizer swap."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable
from unittest import mock

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.overrides import TorchFunctionMode

from zerofx import optim_support
from zerofx.binding import StepBinding
from zerofx.errors import CaptureError, is_library_file, user_frame
from zerofx.mesh import local
from zerofx.step_graph import TAG, NodeTag, Phase, Role, Slot


class PhaseRecorder:
    """Tags nodes with their phase while make_fx traces: at each event (a module's forward begins, backward begins
    or ends, the optimizer's step begins or ends) the nodes created since the last event get the phase they were
    created in. Between a backward and what follows it, the phase is decided by what comes next: gradient
    post-processing before the optimizer (clipping) belongs to the optimizer; before another forward, to backward."""

    def __init__(self):
        self.phase: Phase | None = Phase.FORWARD  # None: after a backward, until the next event decides
        self.microbatch = 0
        self.in_optimizer_step = False
        self.seen_backward = False
        self.stepped_after_backward = False
        # (node, slot) pairs: the node holding a gradient at the moment of the event. Gradients are updated in
        # place (accumulation, clipping), so the tensor's final node would be the wrong one.
        self.grad_nodes: list[tuple[fx.Node, Slot]] = []

    def note_grads(self, fake_params: dict, role: Role) -> None:
        mode = get_proxy_mode()
        for fqn, p in fake_params.items():
            if p.grad is not None:
                self.grad_nodes.append((get_proxy_slot(local(p.grad), mode.tracer).proxy.node, Slot(role, fqn)))

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
            if self.stepped_after_backward:
                raise CaptureError(
                    "backward() after optimizer.step() has updated with an earlier backward's gradients in the same "
                    "call: a call's gradients are reduced across ranks once, after its last backward, so that update "
                    "would read this rank's own gradients",
                    source=user_frame(), hint="take one update per call (micro-batches accumulate inside a call: "
                                              "backward() for each, then one optimizer.step())")
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
            self.stepped_after_backward = self.seen_backward
        elif name == "step_end":
            self._flush(Phase.OPTIMIZER)

    def tag_rest(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            if TAG not in node.meta:
                node.meta[TAG] = NodeTag(Phase.OPTIMIZER if node.op == "output" else Phase.FORWARD, self.microbatch)


REGION = "zerofx_region"  # node.meta: the checkpointed module call whose forward made the node


class RegionRecorder:
    """Marks the nodes each forward call of a checkpointed module makes with ``node.meta[REGION]``: its path and
    the call's number (a block called twice, or once per micro-batch, is two regions). A module picked inside a
    picked module belongs to the outer region; a module run again during backward (reentrant checkpointing) is no
    region."""

    def __init__(self, recorder: PhaseRecorder):
        self.recorder = recorder
        self.depth = 0
        self.start: fx.Node | None = None
        self.calls: dict[str, int] = {}

    def watch(self, path: str, module) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(hook(module.register_forward_pre_hook(lambda *_: self._enter())))
        stack.enter_context(hook(module.register_forward_hook(lambda *_: self._leave(path))))
        return stack

    def _enter(self) -> None:
        if self.depth == 0:
            self.start = next(iter(reversed(get_proxy_mode().tracer.graph.nodes)))
        self.depth += 1

    def _leave(self, path: str) -> None:
        self.depth -= 1
        if self.depth or self.recorder.phase != Phase.FORWARD:
            return
        call = self.calls.get(path, 0)
        self.calls[path] = call + 1
        node = self.start.next
        while node.op != "root":
            node.meta[REGION] = f"{path}#{call}"
            node = node.next


@contextlib.contextmanager
def hook(handle):
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def at_update_start(opt, callback):
    """Call ``callback`` as ``opt.step()`` starts updating: at once, or, given a closure (``step(closure)``
    re-evaluates the loss), once the closure has run its forward and backward, which belong to the step's forward
    and backward, not to its update."""

    def pre_hook(_, args, kwargs):  # args: the optimizer, then step()'s own
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            callback()
            return None

        def closure_then_update():
            loss = closure()
            callback()
            return loss

        if len(args) > 1:
            return (args[0], closure_then_update, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_update}

    with hook(opt.register_step_pre_hook(pre_hook)):
        yield


def on_optimizer_start(recorder: PhaseRecorder, fake_params: dict, incoming: Callable[[str, torch.Tensor], bool],
                       set_by_hand: dict[str, str | None]) -> None:
    """``incoming(fqn, grad)``: whether ``grad`` is one the step found set (an earlier call's backward left it).
    Records in ``set_by_hand`` the parameters whose gradient, as the update starts, no backward left (``p.grad = g``
    from ``torch.autograd.grad``, zeros for a parameter backward did not reach), with the user's line."""
    recorder.event("optimizer_start")
    from_backward = {slot.fqn for _, slot in recorder.grad_nodes if slot.role == Role.GRAD}
    for fqn, p in fake_params.items():
        if p.grad is not None and fqn not in from_backward and not incoming(fqn, p.grad):
            set_by_hand.setdefault(fqn, user_frame())
    recorder.note_grads(fake_params, Role.OPTIMIZER_GRAD)
    for p in fake_params.values():
        if local(p) is not p:  # a DTensor: the optimizer updates its local tensor, from the local gradient
            local(p).grad = None if p.grad is None else local(p.grad)


class HandedToPython(TorchFunctionMode):
    """Records into ``handed`` which of ``tensors`` (by name) a torch function hands to the user's code (``p.grad``
    returning a stand-in, an in-place method returning it): code that holds one may branch on it (``p.grad is
    None``), which no graph node shows. torch's and zerofx's own code do not count: ``zero_grad()`` looks at a
    gradient to drop it (which ends where a call without one starts) or zeroes it (an op), an optimizer reads it."""

    def __init__(self, tensors: dict[str, torch.Tensor], handed: set[str]):
        super().__init__()
        self._names = {id(t): name for name, t in tensors.items()}
        self.handed = handed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        # the code that called it: C++ calls the mode straight from the caller's frame (``p.grad``, ``g.mul_()``)
        if id(result) in self._names and not is_library_file(sys._getframe(1).f_code.co_filename):
            self.handed.add(self._names[id(result)])
        return result


def traced_node(traced: torch.Tensor) -> fx.Node:
    """The node whose value ``traced`` (or a DTensor's local tensor) holds now: an op that later writes into it in
    place becomes its node from then on, and takes this one as an argument."""
    return get_proxy_slot(local(traced), get_proxy_mode().tracer).proxy.node


@contextlib.contextmanager
def track_backward(recorder: PhaseRecorder, fake_params: dict, mixed_trace=None,
                   at_start: Callable[[], None] | None = None):
    """Phase events around ``torch.autograd.backward``; under mixed precision (a `MixedPrecisionTrace`) backward
    starts from the scaled loss and ends by giving the master weights their gradients. ``at_start`` runs as each
    backward starts."""
    real_backward = torch.autograd.backward

    def backward(*a, **k):
        if mixed_trace is not None and mixed_trace.scaling is not None:
            if not (a and isinstance(a[0], torch.Tensor) and a[0].numel() == 1):
                raise CaptureError("loss scaling needs backward() of one scalar loss",
                                   hint="call loss.backward() on the scalar loss")
            a = (mixed_trace.scale_loss(a[0]),) + a[1:]
        recorder.event("backward_start")
        if at_start is not None:
            at_start()
        result = real_backward(*a, **k)
        recorder.event("backward_end")
        recorder.note_grads(fake_params, Role.GRAD)
        if mixed_trace is not None:
            mixed_trace.after_backward()
        return result

    with mock.patch.object(torch.autograd, "backward", backward):
        yield


@contextlib.contextmanager
def refuse_scheduler_steps():
    """An LR scheduler's ``step()`` inside the train step runs only while it traces: the graph would replay what
    that one call set (nothing, where the schedule keeps the rate then: a StepLR between its steps) at every call.
    Refused, naming the line, whatever the call sets."""
    def refused(scheduler, *args, **kwargs):
        raise CaptureError(
            f"an LR scheduler's step() ({type(scheduler).__name__}) is called inside the train step: a compiled "
            "step runs its Python only when it traces, so the schedule would advance once, not at every call",
            source=user_frame(),
            hint="call scheduler.step() after the compiled step; the step reads the hyperparameters it sets at "
                 "every call")

    schedulers = torch.optim.lr_scheduler
    with contextlib.ExitStack() as stack:
        for cls in vars(schedulers).values():
            if isinstance(cls, type) and issubclass(cls, schedulers.LRScheduler) and "step" in vars(cls):
                stack.enter_context(mock.patch.object(cls, "step", refused))
        yield


def _refuse_hyperparameter_writes(opt, oi: int, as_traced: list[dict]) -> None:
    """The graph reads hyperparameters at every call; one the step sets itself (a scheduler's ``step()`` inside it)
    would be traced once and then lost."""
    for gi, (group, traced) in enumerate(zip(opt.param_groups, as_traced)):
        keys = [*traced, *(k for k in group if k not in traced)]  # in order: every rank names the same one
        changed = [k for k in keys if k != "params" and group.get(k) is not traced.get(k)]
        if changed:
            raise CaptureError(
                f"the train step sets hyperparameter '{changed[0]}' of param group {gi} of optimizer {oi} "
                f"({type(opt).__name__}), as an LR scheduler's step() inside the step does: it would be traced once, "
                "not applied at every call",
                hint="step schedulers and set hyperparameters outside the compiled step; it reads them at every call")


@contextlib.contextmanager
def swap_optimizer(opt, oi: int, binding: StepBinding, slots: list[Slot], fakes: dict, fake_params: dict,
                   step_params: dict):
    """Point the optimizer at the traced parameters (``fake_params``: fqn -> what it updates, the master weights
    under mixed precision), state and tensor hyperparameters; restore it after. While it steps, it holds
    ``step_params`` instead (the local tensors of DTensor parameters; ``zero_grad`` outside a step still sees the
    DTensors), and its state is keyed by them."""
    spec = optim_support.spec_for(opt)
    fqn_of = binding.fqn_of
    fake_state = {(s.fqn, s.key): fakes[i] for i, s in enumerate(slots)
                  if s.role == Role.OPT_STATE and s.optimizer == oi}
    hyper = {(s.group, s.key): fakes[i] for i, s in enumerate(slots)
             if s.role == Role.HYPERPARAM and s.optimizer == oi}
    saved_groups = [dict(g) for g in opt.param_groups]
    saved_state = opt.state
    new_state = type(saved_state)(dict) if isinstance(saved_state, dict) else {}
    outside, inside = [], []
    for gi, group in enumerate(opt.param_groups):
        outside.append([fake_params[fqn_of[id(p)]] for p in group["params"]])
        inside.append([step_params[fqn_of[id(p)]] for p in group["params"]])
        for p, sp in zip(group["params"], inside[-1]):
            if p in saved_state:
                new_state[sp] = {k: fake_state.get((fqn_of[id(p)], k), v) for k, v in saved_state[p].items()}
        group["params"] = outside[-1]
        for hkey in spec.tensor_hyperparams:
            value = hyper[(gi, optim_support.hyperparam_name(hkey))]
            if not optim_support.traced_as_tensor(spec, group, hkey):
                # .item() in the graph: the optimizer computes with a Python float, in double, exactly as eager does
                value = value.item()
            if hkey in spec.zero_tested:
                optim_support.assume_zero_side(value, optim_support.read_hyperparam(group, hkey))
            optim_support.write_hyperparam(group, hkey, value)
        for flag, value in optim_support.KERNEL_FLAGS.items():
            if flag in group:
                group[flag] = value
    opt.state = new_state
    as_traced = [dict(g) for g in opt.param_groups]  # what the step must leave as it is

    def hold(params):
        for group, ps in zip(opt.param_groups, params):
            group["params"] = ps

    try:
        with at_update_start(opt, lambda: hold(inside)), hook(opt.register_step_post_hook(lambda *_: hold(outside))):
            yield
        _refuse_hyperparameter_writes(opt, oi, as_traced)
    finally:
        for group, saved in zip(opt.param_groups, saved_groups):
            group.clear()
            group.update(saved)
        opt.state = saved_state
