"""Where a train step's modules, optimizers and batch sit among its arguments, and the graph inputs they give."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from zerofx import optim_support
from zerofx.errors import CaptureError
from zerofx.mesh import local, released
from zerofx.mixed_precision import MixedPrecision
from zerofx.sharding import ParamLayout
from zerofx.step_graph import Role, Slot


@dataclass
class StepBinding:
    """Where the step's modules, optimizers and batch sit among the user's arguments, and the names of the state."""

    module_positions: list[int]
    optimizer_positions: list[int]
    params: dict[str, nn.Parameter]  # fqn -> parameter (tied parameters under their first name)
    param_aliases: dict[str, str]  # every parameter name -> its fqn in ``params``
    buffers: dict[str, torch.Tensor]
    buffer_aliases: dict[str, str]
    _submodules: list[list[nn.Module]] | None = None
    # every parameter and buffer name -> its place in its module (the module's ``_parameters`` or ``_buffers`` dict,
    # its name there) and the tensor found there: a conversion of the model (``model.double()``) and accelerate's
    # loaders put new tensors there without registering them
    placements: dict[str, tuple[dict, str, torch.Tensor]] = field(default_factory=dict)
    # how often, since the first binding, a submodule was replaced or a parameter or buffer name came or went: each
    # makes a new trace
    structure_changes: int = 0
    registrations: int = 0  # `_registrations` when made: a module has registered nothing since while they are equal
    # every module hook the guard key has met, in the order met; held, so that no other object takes its id (a
    # removed hook, and what it holds, live as long as the step)
    hooks_met: list = field(default_factory=list)
    # `zerofx.guards.module_attributes`' cache: each submodule's attribute count, and its plain attributes' names
    plain_attributes: tuple[list[int], list[list[str]]] | None = None

    def trainable(self) -> dict[str, nn.Parameter]:
        """The parameters the step trains: those that require grad, by fqn."""
        return {fqn: p for fqn, p in self.params.items() if p.requires_grad}

    def trainable_layouts(self, param_dtype: torch.dtype | None, world_size: int) -> dict[str, ParamLayout]:
        """How each trainable parameter is sharded over ``world_size`` ranks (in ``param_dtype``, else its own)."""
        return {fqn: ParamLayout(fqn, tuple(p.shape), param_dtype or p.dtype, world_size)
                for fqn, p in self.trainable().items()}

    @classmethod
    def from_args(cls, args: tuple, check_optimizers: bool = True) -> "StepBinding":
        _watch_registrations()
        registrations = _registrations
        module_positions = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizer_positions = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        for i, a in enumerate(args):
            nested = [leaf for leaf in pytree.tree_leaves(a) if leaf is not a
                      and isinstance(leaf, (nn.Module, torch.optim.Optimizer))]
            if nested:
                raise CaptureError(
                    f"argument {i} of the train step is a {type(a).__name__} holding {type(nested[0]).__name__}: "
                    "zerofx finds models and optimizers only among the arguments themselves",
                    hint="pass each model and optimizer as an argument of its own: step(model, opt_a, opt_b, *batch)")
        if not module_positions:
            raise CaptureError("no nn.Module among the train step's arguments",
                               hint="call it as step(model, optimizer, *batch)")
        if not optimizer_positions:
            raise CaptureError("no torch.optim.Optimizer among the train step's arguments",
                               hint="call it as step(model, optimizer, *batch)")
        params, param_aliases, buffers, buffer_aliases, placements = {}, {}, {}, {}, {}
        for pos in module_positions:
            prefix = _prefix(pos, module_positions)
            _collect(args[pos].named_parameters(remove_duplicate=False), prefix, params, param_aliases)
            _collect(args[pos].named_buffers(remove_duplicate=False), prefix, buffers, buffer_aliases)
            for path, module in args[pos].named_modules(remove_duplicate=False):
                owner = prefix + (f"{path}." if path else "")
                for home in (module._parameters, module._buffers):
                    placements.update({owner + name: (home, name, t) for name, t in home.items() if t is not None})
        binding = cls(module_positions, optimizer_positions, params, param_aliases, buffers, buffer_aliases,
                      placements=placements, registrations=registrations)
        if check_optimizers:
            binding.check_optimizers(args)
        return binding

    def rebound(self, args: tuple) -> "StepBinding | None":
        """A new binding of ``args`` where one of their modules now holds another parameter, buffer or submodule
        than this binding found (a new head, ``load_state_dict(assign=True)``, a buffer assigned, the model
        converted); None where nothing changed. While no module anywhere has registered anything, it costs an identity
        test per parameter and buffer. The caller checks the new binding's optimizers (`check_optimizers`) after what a
        step that owns parameters refuses first."""
        if _registrations == self.registrations and all(home.get(name) is t
                                                        for home, name, t in self.placements.values()):
            return None
        fresh = StepBinding.from_args(args, check_optimizers=False)
        restructured = not (self.param_aliases == fresh.param_aliases and self.buffer_aliases == fresh.buffer_aliases
                            and all(map(_same_objects, self.submodules(args), fresh.submodules(args))))
        if not restructured and _same_objects(self.params, fresh.params) and _same_objects(self.buffers,
                                                                                          fresh.buffers):
            self.registrations = fresh.registrations
            return None
        # a tensor replaced by one of the same kind is a new input of the same graph; another module a new graph
        fresh.structure_changes = self.structure_changes + restructured
        fresh.hooks_met = self.hooks_met
        return fresh

    def hook_number(self, hook) -> int:
        """The order in which the guard key first met ``hook``: the same on every rank that registers the same."""
        number = next((i for i, h in enumerate(self.hooks_met) if h is hook), None)
        if number is None:
            number = len(self.hooks_met)
            self.hooks_met.append(hook)
        return number

    def set_buffer(self, fqn: str, value: torch.Tensor) -> None:
        """Put ``value`` in place of buffer ``fqn`` under each of its names (what eager's assignment in forward
        leaves), without registering it: the step's own write-back is no change to look for."""
        for alias, canonical in self.buffer_aliases.items():
            if canonical == fqn:
                home, name, _ = self.placements[alias]
                home[name] = value
                self.placements[alias] = home, name, value
        self.buffers[fqn] = value

    def check_optimizers(self, args: tuple) -> None:
        known = {id(p) for p in self.params.values()}
        for pos in self.optimizer_positions:
            opt = args[pos]
            optim_support.spec_for(opt)
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in known and released(p):
                        raise CaptureError(
                            f"param_groups[{gi}] of {type(opt).__name__} (argument {pos}) holds a parameter a zerofx "
                            "step took that the model no longer holds: it was replaced in the model after the step's "
                            "first call", hint=REPLACED_AFTER_TAKEN)
                    if id(p) not in known:
                        raise CaptureError(
                            f"optimizer parameter not in the module: param_groups[{gi}] of "
                            f"{type(opt).__name__} (argument {pos}) holds a tensor of shape {tuple(p.shape)} that "
                            "no nn.Module argument owns",
                            hint="pass every module whose parameters the optimizer updates to the train step; "
                                 "where the model's parameters were replaced (a new submodule, "
                                 "load_state_dict(assign=True)), make the optimizer over the new ones",
                        )

    def optimizer_state(self, opt: torch.optim.Optimizer) -> list[tuple[str, dict]]:
        """(fqn, state) of each module parameter ``opt`` holds state for: the state a parameter replaced in the model
        and in its group leaves behind is never read again."""
        fqn_of = self.fqn_of
        return [(fqn_of[id(p)], entries) for p, entries in opt.state.items() if id(p) in fqn_of]

    @functools.cached_property
    def fqn_of(self) -> dict[int, str]:
        """id(parameter) -> its fqn."""
        return {id(p): fqn for fqn, p in self.params.items()}

    @property
    def module_prefixes(self) -> list[str]:
        """The prefix of each module argument's parameter names ("" when the step takes one module)."""
        return [_prefix(pos, self.module_positions) for pos in self.module_positions]

    def modules(self, args: tuple) -> list[nn.Module]:
        return [args[i] for i in self.module_positions]

    def submodules(self, args: tuple) -> list[list[nn.Module]]:
        """Each module argument's modules, as they were when first asked for (walking them costs more than the
        rest of a step's guard; the parameters are fixed when the binding is made)."""
        if self._submodules is None:
            self._submodules = [list(module.modules()) for module in self.modules(args)]
        return self._submodules

    def training_modes(self, args: tuple) -> tuple[tuple[bool, ...], ...]:
        """Each module argument's modules' ``training`` flags."""
        return tuple(tuple(m.training for m in modules) for modules in self.submodules(args))

    def optimizers(self, args: tuple) -> list[torch.optim.Optimizer]:
        return [args[i] for i in self.optimizer_positions]

    def batch(self, args: tuple) -> list:
        taken = set(self.module_positions) | set(self.optimizer_positions)
        return [a for i, a in enumerate(args) if i not in taken]


def refuse_tensor_hooks(binding: StepBinding) -> None:
    """A hook on a parameter tensor runs on the tensor itself, which the trace replaces by a stand-in: the step
    would train without it."""
    for fqn, p in binding.params.items():
        kind = ("register_hook" if p._backward_hooks else
                "register_post_accumulate_grad_hook" if p._post_accumulate_grad_hooks else None)
        if kind is not None:
            raise CaptureError(
                f"parameter {fqn!r} has a hook registered with Tensor.{kind}: the traced step would not run it",
                hint="do what the hook does in the train step, between backward() and the update "
                     "(p.grad.mul_(10), say), and remove the hook")


REPLACED_AFTER_TAKEN = ("replace parameters before the first call; to go on with a new part, build a new model and "
                         "optimizer, load zerofx.full_state_dict(step) into them, replace the part there and compile a "
                         "new step for them")


def _prefix(pos: int, module_positions: list[int]) -> str:
    return "" if len(module_positions) == 1 else f"arg{pos}."


def _same_objects(a, b) -> bool:
    """Two dicts (or lists) holding the same objects."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


_registrations = 0  # parameters, buffers and submodules any module has registered since zerofx began to count


def _count_registration(*_) -> None:
    # Dynamo inlines a module's setattr, and a count it read would be a guard: one made inside a torch.compile'd
    # region goes uncounted (a tensor it puts under a known name is still found by its placement)
    if torch.compiler.is_compiling():
        return
    global _registrations
    _registrations += 1


@functools.cache
def _watch_registrations() -> None:
    """Count every registration from now on (torch's global registration hooks, installed once)."""
    torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
    torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
    torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


def _collect(named, prefix, canonical: dict, aliases: dict) -> None:
    by_id = {id(t): fqn for fqn, t in canonical.items()}
    for name, t in named:
        full = prefix + name
        if id(t) not in by_id:
            canonical[full] = t
            by_id[id(t)] = full
        aliases[full] = by_id[id(t)]


def incoming_grads(binding: StepBinding, *, probe: bool) -> list[str]:
    """The trainable parameters whose incoming ``.grad`` a trace gives the step: those that have one as the step is
    called, or with ``probe`` every one (stand-ins where there is none), to learn whether the step reads them at all
    (it does not when it resets gradients before backward). Under mixed precision it is the fp32 master's gradient
    (`MixedPrecisionTrace`)."""
    return list(binding.trainable()) if probe else present_grads(binding)


def present_grads(binding: StepBinding) -> list[str]:
    return [fqn for fqn, p in binding.trainable().items() if p.grad is not None]


def input_slots(binding: StepBinding, args: tuple, mixed: MixedPrecision | None = None,
                grads: list[str] = ()) -> list[Slot]:
    """The graph's inputs, in order: parameters (and master weights), buffers, the incoming ``grads``, optimizer
    state, hyperparameters, batch."""
    slots = [Slot(Role.PARAM, fqn) for fqn in binding.params]
    if mixed is not None:
        slots += [Slot(Role.MASTER, fqn) for fqn in binding.trainable()]
    slots += [Slot(Role.BUFFER, fqn) for fqn in binding.buffers]
    if mixed is not None and mixed.scaling is not None:
        slots += [Slot(Role.LOSS_SCALE), Slot(Role.GROWTH_TRACKER)]
    slots += [Slot(Role.GRAD_IN, fqn) for fqn in grads]
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
    one, else from the module, optimizer and batch. For tracing, trainable parameters are leaves requiring grad
    (a DTensor's local tensor does not: the DTensor rebuilt over it in the trace is the leaf)."""
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
            # frozen floating parameters too (integer or bool ones, such as index tables, stay as they are)
            compute = p.detach().to(mixed.param_dtype) if mixed is not None and p.is_floating_point() else p.detach()
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
            grad = binding.params[s.fqn].grad
            if grad is None:  # a probing trace's stand-in: shape and dtype only, never read for its values
                # under mixed precision the fp32 master's gradient, which the step keeps apart once it owns it
                owned = Slot(Role.MASTER if mixed is not None else Role.PARAM, s.fqn)
                param = override(owned) if override is not None else None
                grad = torch.empty_like(binding.params[s.fqn] if param is None else param)
            values.append(grad)
        elif s.role == Role.OPT_STATE:
            values.append(by_fqn[(s.optimizer, s.fqn)][s.key])
        elif s.role == Role.HYPERPARAM:
            values.append(_hyperparam_value(optimizers[s.optimizer], s, for_trace))
        elif s.role == Role.BATCH:
            values.append(next(batch_iter))
    return [local(v) for v in values]


def hyperparam_traced_as_tensor(opt: torch.optim.Optimizer, slot: Slot) -> bool:
    """Whether the graph takes hyperparameter ``slot`` as the user's tensor (`optim_support.traced_as_tensor`)."""
    return optim_support.traced_as_tensor(optim_support.spec_for(opt), opt.param_groups[slot.group],
                                          _parse_hyperparam(slot.key))


def _hyperparam_value(opt: torch.optim.Optimizer, slot: Slot, for_trace: bool):
    group, key = opt.param_groups[slot.group], _parse_hyperparam(slot.key)
    if hyperparam_traced_as_tensor(opt, slot):
        return optim_support.raw_hyperparam(group, key)  # read at every call: a scheduler fills it in place
    value = optim_support.read_hyperparam(group, key)
    # traced from a tensor (make_fx lifts tensors, not floats); the graph then takes the float itself
    return torch.tensor(value, dtype=torch.float64) if for_trace else value


def _parse_hyperparam(name: str) -> optim_support.HyperparamKey:
    if name.endswith("]"):
        base, index = name[:-1].split("[")
        return base, int(index)
    return name, None
