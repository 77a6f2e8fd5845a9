"""What a captured graph depends on besides its inputs. A change of any of these re-traces (cached per key).

Parameter and buffer shapes, strides, dtypes, devices and ``requires_grad``; which parameters have a ``.grad`` (for a
step that reads incoming gradients); every module's train/eval mode, plain attributes (numbers, strings, flags: a
temperature annealed from the loop) and hooks; how often a submodule or a name changed since the first call; the plain
values the step function reads from its globals and closure (a loss weight on a schedule); the optimizer's type,
groups, state layout and its hyperparameters that are not graph inputs; the batch's structure, shapes, strides and
dtypes and any non-tensor argument's value. Of a hyperparameter that is a graph input the key holds only the branch
torch.optim takes on it (``momentum != 0``), never its value.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.utils._pytree as pytree

from zerofx import optim_support
from zerofx.binding import StepBinding, present_grads


def _tensor_meta(t: torch.Tensor) -> tuple:
    # read for every parameter and state tensor each step: is_cpu costs a sixth of making a torch.device. The trace
    # runs on stand-ins with the tensor's strides, and kernels and views in the graph follow them (a channels-last
    # batch given to a graph traced on a contiguous one computed wrong gradients)
    return (t.shape, t.stride(), t.dtype, "cpu" if t.is_cpu else t.device.type)


def _state_part(opt: torch.optim.Optimizer, binding: StepBinding) -> tuple:
    # by name: a parameter replaced by one of its kind has its state made anew, last in the optimizer's order
    return tuple(sorted((fqn, tuple((k, _tensor_meta(v) if isinstance(v, torch.Tensor) else repr(v))
                                    for k, v in sorted(s.items())))
                        for fqn, s in binding.optimizer_state(opt)))


_PLAIN = (bool, int, float, str, type(None))  # values a trace reads as constants


def module_attributes(binding: StepBinding, args: tuple) -> tuple:
    """(submodule, name, value) of every plain attribute of the modules but ``training``: a forward
    that reads one bakes its value into the graph. Which attributes are plain is found again only when a module
    gains or loses one (a step reads them all every call)."""
    modules = [m for submodules in binding.submodules(args) for m in submodules]
    sizes = [len(vars(m)) for m in modules]
    if binding.plain_attributes is None or binding.plain_attributes[0] != sizes:
        names = [[name for name, value in vars(m).items()
                  if type(value) in _PLAIN and name != "training" and not name.startswith("_")] for m in modules]
        binding.plain_attributes = sizes, names
    values = []
    for j, (m, names) in enumerate(zip(modules, binding.plain_attributes[1])):
        own = vars(m)
        values += [(j, name, own[name] if type(own[name]) in _PLAIN else "<not plain>") for name in names]
    return tuple(values)


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, "_global" + kind) for kind in _MODULE_HOOKS)


def module_hooks(binding: StepBinding, args: tuple) -> tuple:
    """(submodule, kind, hooks) of every module hook the user registered, and the global ones: the trace runs them,
    so one added, removed or swapped for another of the same name must re-trace. Each hook goes in the key by name
    and by the order in which the binding first met it (`StepBinding.hook_number`), not by id, which differs between
    ranks; a set of hooks met before finds its graph again."""
    return tuple((j, kind, tuple((hook_name(h), binding.hook_number(h)) for h in hooks))
                 for j, kind, hooks in _found_hooks(binding, args))


def hook_objects(binding: StepBinding, args: tuple) -> list:
    """The user's module hooks on ``args``' modules and the global ones, as objects."""
    return [h for _, _, hooks in _found_hooks(binding, args) for h in hooks]


def _found_hooks(binding: StepBinding, args: tuple) -> list[tuple[int, str, list]]:
    modules = [m for submodules in binding.submodules(args) for m in submodules]
    found = [(j, kind, _user_hooks(getattr(m, kind))) for j, m in enumerate(modules) for kind in _MODULE_HOOKS
             if getattr(m, kind)]
    found += [(-1, kind, _user_hooks(hooks)) for kind, hooks in zip(_MODULE_HOOKS, _GLOBAL_HOOKS) if hooks]
    return [(j, kind, hooks) for j, kind, hooks in found if hooks]


def _user_hooks(hooks: dict) -> list:
    # zerofx's own (the refusal of an eager forward over released parameters) are the same on every call, and
    # torch's observe (CommDebugMode's and FlopCounterMode's module trackers around a call)
    return [h for h in hooks.values() if not (getattr(h, "__module__", None) or "").startswith(("zerofx.", "torch."))]


def hook_name(hook) -> str:
    hook = getattr(hook, "func", hook)  # a functools.partial
    return f"{getattr(hook, '__module__', None)}.{getattr(hook, '__qualname__', type(hook).__name__)}"


def function_values(fn) -> tuple:
    """(name, repr) of the plain values ``fn``'s own code reads from its globals and closure cells."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    scope = fn.__globals__
    values = [(name, repr(scope[name])) for name in code.co_names if type(scope.get(name, ...)) in _PLAIN]
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            if type(cell.cell_contents) in _PLAIN:
                values.append((name, repr(cell.cell_contents)))
        except ValueError:  # an empty cell: not yet assigned
            pass
    return tuple(values)


def step_key(binding: StepBinding, args: tuple, owned_parts: dict[str, tuple] | None = None,
             reads_incoming_grads: bool = False, step_fn=None) -> dict[str, tuple]:
    """The guard key as named parts, so a re-trace can say what changed. ``owned_parts`` replaces the parts
    describing state a sharded step has taken from the module and optimizer (recorded before it released them).
    Which parameters have a ``.grad`` is part of the key only for a step that reads incoming gradients."""
    fqn_of = binding.fqn_of
    owned_parts = owned_parts or {}  # not recomputed: reading them is most of a step's guard cost
    key = {
        "params": owned_parts["params"] if "params" in owned_parts
        else tuple((fqn, _tensor_meta(p)) for fqn, p in binding.params.items()),
        "requires_grad": tuple(binding.trainable()),
        "buffers": tuple((fqn, _tensor_meta(b)) for fqn, b in binding.buffers.items()),
        "training": binding.training_modes(args),
        "attributes": module_attributes(binding, args),
        "hooks": module_hooks(binding, args),
        "structure_changes": (binding.structure_changes,),
        "globals": function_values(step_fn),
        "grad_enabled": (torch.is_grad_enabled(),),
    }
    for oi, opt in enumerate(binding.optimizers(args)):
        spec = optim_support.spec_for(opt)
        inputs = {optim_support.hyperparam_name(k) for k in spec.tensor_hyperparams}
        zero_tested = {optim_support.hyperparam_name(k) for k in spec.zero_tested}
        groups = []
        for group in opt.param_groups:
            guarded = []
            for name, value in sorted(group.items()):
                if name == "params":
                    guarded.append((name, tuple(fqn_of[id(p)] for p in value)))
                elif isinstance(value, tuple):
                    guarded.append((name, tuple(_input_kind(v) if f"{name}[{i}]" in inputs else v
                                                for i, v in enumerate(value))))
                elif name in zero_tested:
                    guarded.append((name, optim_support.zero_side(value)))
                elif name in inputs:
                    guarded.append((name, _input_kind(value)))
                else:
                    guarded.append((name, repr(value)))
            groups.append(tuple(guarded))
        key[f"optimizer{oi}"] = (type(opt).__name__, tuple(groups))
        state_part = f"optimizer{oi}_state"
        key[state_part] = owned_parts[state_part] if state_part in owned_parts else _state_part(opt, binding)
    leaves, spec = pytree.tree_flatten(binding.batch(args))
    # requires_grad: backward leaves a gradient in such an input's .grad
    key["batch"] = (str(spec),) + tuple((*_tensor_meta(x), x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)
                                        for x in leaves)
    if reads_incoming_grads:
        key["grads"] = tuple(present_grads(binding))
    return key


def _input_kind(value) -> str:
    """What the key holds for a hyperparameter the graph takes as an input: a number, or a tensor of a dtype on a
    device, and whether it requires grad (torch.optim branches on that)."""
    if not isinstance(value, torch.Tensor):
        return "<input>"
    return f"<input: {value.dtype} tensor on {value.device}{', requiring grad' if value.requires_grad else ''}>"


def owned_parts(key: dict[str, tuple]) -> dict[str, tuple]:
    """The parts of ``key`` that describe parameters and optimizer state: fixed once a sharded step owns them."""
    return {part: value for part, value in key.items() if part == "params" or part.endswith("_state")}


def freeze(key: dict[str, tuple]) -> tuple:
    return tuple(sorted(key.items()))


def key_hash(key: dict[str, tuple]) -> int:
    """A 63-bit hash, equal on every rank for equal keys (no Python hash randomisation)."""
    return _frozen_hash(freeze(key))


@functools.lru_cache(maxsize=64)
def _frozen_hash(frozen: tuple) -> int:
    # the key repeats step after step; its repr and digest cost more than finding it here
    return int.from_bytes(hashlib.sha256(repr(frozen).encode()).digest()[:8], "little") >> 1


def varying_parts(keys: list[dict[str, tuple]]) -> list[str]:
    """The parts whose value differs among ``keys``: what keeps causing new traces."""
    return sorted(part for part in set().union(*keys) if len({key.get(part) for key in keys}) > 1)


def describe_change(old: dict[str, tuple], new: dict[str, tuple]) -> str:
    changed = []
    for part in sorted(set(old) | set(new)):
        a, b = old.get(part), new.get(part)
        if a != b:  # each difference once (a mode flipped in every module, one size of several tensors)
            changed.append(f"{part}: " + "; ".join(list(dict.fromkeys(_differences(a, b)))[:3]))
    return ", ".join(changed)


def _differences(a, b) -> list[str]:
    """Where two values of the key differ: into tuples of equal length, and into a (name, tuple) pair under its name,
    down to a (name, value) pair or a leaf."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) != len(b):  # entries added or removed (hooks)
        return [_listed(what, entries) for what, entries in (("added", _minus(b, a)), ("removed", _minus(a, b)))
                if entries]
    if not (isinstance(a, tuple) and isinstance(b, tuple)):
        return [f"{a!r} -> {b!r}"]
    if len(a) == 2 and isinstance(a[0], str) and a[0].isidentifier() and a[0] == b[0]:
        if isinstance(a[1], tuple) and isinstance(b[1], tuple):
            return [f"{a[0]}: {d}" for d in _differences(a[1], b[1])]
        return [f"{a!r} -> {b!r}"]
    return [d for x, y in zip(a, b) if x != y for d in _differences(x, y)]


def _listed(what: str, items: list) -> str:
    return f"{what} {items[0]!r}" + (f" and {len(items) - 1} more" if len(items) > 1 else "")


def _minus(items: tuple, others: tuple) -> list:
    """``items`` less one of them for each equal one in ``others`` (a hook registered twice counts twice)."""
    rest, left = list(others), []
    for item in items:
        if item in rest:
            rest.remove(item)
        else:
            left.append(item)
    return left
