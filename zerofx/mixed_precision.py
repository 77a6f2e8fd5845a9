"""Mixed precision: compute and communicate parameters in ``param_dtype``, keep fp32 master weights.

The names follow FSDP2's ``MixedPrecisionPolicy``. The step is traced with the module's parameters in
``param_dtype`` (so forward and backward run, and gradients come out, in that dtype; frozen parameters too) while
the optimizer is pointed at fp32 master copies: after backward each master's gradient is the compute gradient cast
to fp32 and added to the fp32 gradient an earlier call left where there is one (and the sum unscaled, under loss
scaling), and after the optimizer's step each compute parameter is the updated master cast back.
Passes shard the master weights with the optimizer state
(P_os) and move compute parameters and gradients in the low precision: the paper's b_p = b_g = 2, K = 4 + 8 (a
gradient kept between calls is fp32).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from zerofx.errors import CaptureError, user_frame, user_frame_from_stack_trace
from zerofx.step_graph import is_mutating


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling as ``torch.amp.GradScaler`` does it; used with ``param_dtype=torch.float16``."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None  # gradients are reduced in this dtype; None: param_dtype
    loss_scaling: LossScaling | None = None  # None: on for float16, off otherwise
    # stage 3: all-gathers send casts of the fp32 master shards and no param_dtype shard is kept, as FSDP2 does;
    # False keeps a param_dtype copy of each shard, written once after each update (DeepSpeed's layout and the
    # paper's b_pΨ/N_d): more memory, one cast per step instead of one per gather
    cast_at_gather: bool = True
    # floating tensors passed to the step's modules (an image batch, regression features) are cast to param_dtype
    # as they enter, as FSDP2's policy casts a sharded module's forward inputs by default
    cast_forward_inputs: bool = True

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def scaling(self) -> LossScaling | None:
        return self.loss_scaling or (LossScaling() if self.param_dtype == torch.float16 else None)

    def __post_init__(self):
        if not self.param_dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype, got {self.param_dtype}")


FOUND_INF = "zerofx_found_inf"  # node.meta flag: this rank's "a gradient is not finite", before ranks agree
PER_TENSOR_CHECK = "zerofx_finite_check"  # node.meta flag: a per-gradient finiteness reduction (global once agreed)
MASTER_GRAD = "zerofx_master_grad"  # node.meta flag: an fp32 master gradient, the unscaled image of a gradient


class MixedPrecisionTrace:
    """What mixed precision does while the step is traced, as FSDP2's users see it.

    Forward and backward run on the compute parameters (``param_dtype``). When a backward ends, each master weight
    takes its gradient: the compute gradient cast to fp32, added to the fp32 gradient an earlier call left and, with
    loss scaling, the sum unscaled (GradScaler's ``unscale_``, which divides all that ``.grad`` holds), with "a
    gradient is not finite" computed from all of them once. From then until the next forward
    the module shows the master weights, so user code after backward (``clip_grad_norm_``, logging) reads fp32
    unscaled gradients, and any number of optimizers update masters. After each optimizer's step its compute
    parameters take their masters' values; at the end of the step the scale is updated once
    (``_amp_update_scale_``). ``compute`` and ``masters`` map fqn -> traced tensor; ``views`` are (module, name ->
    master or frozen compute tensor) for showing the masters."""

    def __init__(self, scaling: LossScaling | None, scale, growth, compute: dict, masters: dict, views: list):
        self.scaling, self.scale, self.growth = scaling, scale, growth
        self.compute, self.masters, self.views = compute, masters, views
        self._shown = contextlib.ExitStack()
        self._found = None
        self._incoming: dict = {}  # fqn -> what conversions add to: the master's gradient the first backward found
        self.conversions: list[list] = []  # graph nodes each backward's conversion made; all but the last are dropped
        self._converted: dict = {}  # fqn -> the master's gradient the last conversion made

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaling is None else loss.float() * self.scale

    def after_backward(self) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        graph = get_proxy_mode().tracer.graph
        before = len(graph.nodes)
        inverse = None if self.scaling is None else self.scale.double().reciprocal().float()
        checks = []
        for fqn, m in self.masters.items():
            # what a later micro-batch's conversion adds to: the gradient an earlier call left (or None)
            incoming = self._incoming.setdefault(fqn, m.grad)
            g = self.compute[fqn].grad
            if fqn in self._converted and m.grad is not self._converted[fqn]:
                raise CaptureError(
                    f"the gradient of '{fqn}' was replaced between backward passes (`.grad = ...`) under mixed "
                    "precision: the next conversion to fp32 would still add the earlier backward's low-precision "
                    "gradient", source=user_frame(), hint="reset gradients with zero_grad() (model's or optimizer's)")
            if g is None:
                m.grad = incoming
                continue
            m.grad = g.to(m.dtype)
            _flag(m.grad, MASTER_GRAD)
            if incoming is not None:
                m.grad = incoming + m.grad
                _flag(m.grad, MASTER_GRAD)
            if inverse is not None:  # as GradScaler's unscale_: all that .grad holds, the incoming gradient too
                m.grad.mul_(inverse)
                checks.append(torch.isfinite(m.grad).all())
                _flag(checks[-1], PER_TENSOR_CHECK)
            self._converted[fqn] = m.grad
        if checks:
            self._found = torch.stack(checks).all().logical_not().float()
            _flag(self._found, FOUND_INF)
        self.conversions.append(list(graph.nodes)[before:])
        self.show_masters()

    @contextlib.contextmanager
    def zero_grad_reaches_both(self):
        """``Module.zero_grad()`` and ``Optimizer.zero_grad()`` reset a parameter's compute and master gradients
        together, whichever of the two the module shows or the optimizer holds, and the next backward's conversion
        adds to nothing (not to a gradient an earlier call left, nor to the zeroed one, which may be full-size where
        the conversion is a shard). Before forward the module shows compute parameters whose gradients are not there
        yet, but the user means the gradients the optimizer will read; between micro-batches (the module showing the
        masters) the compute gradients of the earlier ones must not reach the next conversion. A compute gradient is
        the trace's own, so it is dropped rather than zeroed: nothing but the conversions reads it."""
        fqn_of = {id(t): fqn for tensors in (self.compute, self.masters) for fqn, t in tensors.items()}
        originals = torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad

        def reset(tensors, set_to_none: bool) -> None:
            for fqn in {fqn_of[id(t)] for t in tensors if id(t) in fqn_of}:
                master = self.masters.get(fqn)
                if master is not None and master.grad is not None:
                    if set_to_none:
                        master.grad = None
                    else:
                        master.grad.zero_()
                if master is not None or set_to_none:
                    self.compute[fqn].grad = None
                elif self.compute[fqn].grad is not None:  # a frozen parameter's: the user's own
                    self.compute[fqn].grad.zero_()
                self._incoming[fqn] = None  # what the next conversion adds to: nothing (zeros add nothing)
                self._converted.pop(fqn, None)

        def module_zero_grad(module, set_to_none: bool = True):
            originals[0](module, set_to_none)
            reset(list(module.parameters()), set_to_none)

        def optimizer_zero_grad(optimizer, set_to_none: bool = True):
            originals[1](optimizer, set_to_none)
            reset([p for group in optimizer.param_groups for p in group["params"]], set_to_none)

        torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad = module_zero_grad, optimizer_zero_grad
        try:
            yield
        finally:
            torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad = originals

    def show_masters(self) -> None:
        from torch.nn.utils import stateless

        self._shown.close()
        for module, mapping in self.views:
            self._shown.enter_context(stateless._reparametrize_module(module, mapping))

    def show_compute(self) -> None:
        self._shown.close()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
        with torch.no_grad():
            for fqn, m in self.masters.items():
                if id(m) in updated:
                    self.compute[fqn].copy_(m)

    def at_step_end(self) -> None:
        self.show_compute()
        if self.scaling is not None and self._found is not None:
            torch._amp_update_scale_(self.scale, self.growth, self._found, self.scaling.growth_factor,
                                     self.scaling.backoff_factor, self.scaling.growth_interval)


def drop_superseded_conversions(graph, conversions: list[list]) -> None:
    """With several micro-batches every backward converted the gradients accumulated so far; only the last
    conversion is what user code and the optimizer read. Earlier ones nothing outside them reads are removed."""
    for nodes in conversions[:-1]:
        members = set(nodes)
        outside = [user for n in nodes for user in n.users if user not in members]
        zeroings = _zeroed_only(outside)
        if zeroings:  # zeroed by zero_grad(set_to_none=False) and not read again: superseded as well
            for u in reversed(zeroings):
                graph.erase_node(u)
            outside = []
        writes = [u for u in outside if u.op == "call_function" and is_mutating(u)]
        if writes:
            raise CaptureError(
                f"a gradient is written in place between backward passes under mixed precision ({writes[0].target}): "
                "the next conversion to fp32 replaces it, and the write would be lost",
                source=user_frame_from_stack_trace(writes[0].meta.get("stack_trace")),
                hint="change gradients after the last backward (clipping, scaling the loss instead)")
        if outside:
            for n in nodes:  # read between micro-batches: kept, but the last conversion's flags are the step's
                for flag in (FOUND_INF, PER_TENSOR_CHECK, MASTER_GRAD):
                    n.meta.pop(flag, None)
            continue
        for n in reversed(nodes):
            graph.erase_node(n)


def _zeroed_only(users: list) -> list:
    """``users`` and what reads them, in order, where all are in-place zeroings (zero_grad() on a master and on its
    compute gradient); empty otherwise."""
    chain, frontier = [], list(users)
    while frontier:
        node = frontier.pop(0)
        if node.target is not torch.ops.aten.zero_.default:
            return []
        if node in chain:
            continue
        chain.append(node)
        frontier.extend(node.users)
    return chain


def _flag(tensor: torch.Tensor, key: str) -> None:
    """Mark the graph node that computes ``tensor`` (while tracing)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is not None:
        get_proxy_slot(tensor, mode.tracer).proxy.node.meta[key] = True


def cast_floating_inputs(dtype: torch.dtype):
    """A forward pre-hook (``with_kwargs``) casting a module's floating tensor arguments, in containers too, to
    ``dtype``."""
    def hook(module, args, kwargs):
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                                    (args, kwargs))
    return hook


class NormsWithStatistics(TorchFunctionMode):
    """Batch norm with low-precision weights and fp32 running statistics (a model whose parameters mixed precision
    casts, and not its buffers) has no kernel: torch's take a low-precision input only with weight, bias and
    statistics all fp32, or all in the input's dtype. Active while a step is traced, it calls such a norm with its
    weight and bias cast up to the statistics' dtype (exact), where they are used, so the kernel computes as under
    autocast and the statistics stay fp32; the gradients flow back through the casts, into ``param_dtype``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.batch_norm:
            call = _BATCH_NORM.bind(*args, **(kwargs or {}))
            statistics = call.arguments["running_mean"]
            for name in ("weight", "bias"):
                value = call.arguments.get(name)
                if statistics is not None and value is not None and value.itemsize < statistics.itemsize:
                    call.arguments[name] = value.to(statistics.dtype)
            args, kwargs = call.args, call.kwargs
        return func(*args, **(kwargs or {}))


_BATCH_NORM = inspect.signature(F.batch_norm)
