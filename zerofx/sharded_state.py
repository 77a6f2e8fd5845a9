"""The state a compiled step owns: from stage 1 on, this rank's parameter and optimizer-state shards.

On its first call (or `bind`) the step takes the module's parameters and the optimizer's state, keeps what the stage
stores (stages 1-2: every full parameter, padded; stage 3: this rank's shard, none in ``param_dtype`` under mixed
precision unless ``cast_at_gather=False``, as the gathers cast the masters; stages 1-3: this rank's shard of each
optimizer state tensor and, under mixed precision, of each fp32 master weight), and releases the originals: their
memory is freed and reading them gives an empty tensor. At stage 0 it owns only the low-precision compute copies of
mixed precision; the module's fp32 parameters are the master weights. `zerofx.state_dict(step)` shows this state in
place, `zerofx.full_state_dict(step)` gathers it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zerofx import optim_support
from zerofx.binding import REPLACED_AFTER_TAKEN, StepBinding
from zerofx.errors import CaptureError, user_frame
from zerofx.mesh import local, release, released
from zerofx.mixed_precision import MixedPrecision
from zerofx.sharding import ParamLayout
from zerofx.step_graph import ZEROING_OPS, Role, Slot


@dataclass
class ShardedState:
    stage: int
    rank: int
    layouts: dict[str, ParamLayout]
    mixed: MixedPrecision | None = None
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # what forward reads or gathers (param_dtype if
    # mixed; none at stage 3 under mixed precision with cast_at_gather, whose all-gathers cast the masters)
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # mixed, stages 1-3: fp32 master shards
    opt_state: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict)  # (optimizer, fqn, key)
    sharded_state_keys: set[tuple[int, str, str]] = field(default_factory=set)
    loss_scale: torch.Tensor | None = None  # float16: the dynamic loss scale and its growth tracker
    growth_tracker: torch.Tensor | None = None
    module_params: dict[str, torch.Tensor] = field(default_factory=dict)  # the module's, by fqn (frozen ones stay)
    frozen_casts: dict[str, tuple[tuple, torch.Tensor]] = field(default_factory=dict)  # mixed: frozen, in param_dtype
    group: dist.ProcessGroup | None = None  # the ranks the shards are spread over (the mesh's "dp"; None: all)
    # stages 1-3: this rank's reduced shard of each gradient the last call left for the next to add to (an update
    # every k-th call); the parameter's ``.grad`` meanwhile holds an empty marker (`keep_grads`)
    kept_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    _markers: dict[str, weakref.ref] = field(default_factory=dict)  # to the empty tensor of each kept shard's marker
    # each optimizer's parameters (fqns) when the step took its own: one the optimizer takes on later is refused
    optimizer_members: list[frozenset[str]] = field(default_factory=list)
    # each taken parameter's (storage, version, dtype) in the module as the step last left it: a write since shows
    module_versions: dict[str, tuple] = field(default_factory=dict)
    # from stage 1 on: the empty tensor the step left in the optimizer's state for each entry it took, and its version
    released_state: dict[tuple[int, str, str], tuple[torch.Tensor, int]] = field(default_factory=dict)
    # the per-element state names each (optimizer, group) had when `add_state_turned_on` last looked
    _state_names_met: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def take(cls, binding: StepBinding, args: tuple, layouts: dict[str, ParamLayout], stage: int,
             rank: int, mixed: MixedPrecision | None = None,
             group: dist.ProcessGroup | None = None) -> "ShardedState":
        state = cls(stage, rank, {}, mixed, module_params=binding.params, group=group)
        if mixed is not None and mixed.scaling is not None:
            device = next(iter(binding.params.values())).device
            state.loss_scale = torch.tensor(mixed.scaling.init_scale, dtype=torch.float32, device=device)
            state.growth_tracker = torch.tensor(0, dtype=torch.int32, device=device)
        state.absorb(binding, args, layouts)
        return state

    def absorb(self, binding: StepBinding, args: tuple, layouts: dict[str, ParamLayout]) -> bool:
        """Take the trainable parameters of ``layouts`` not yet owned (all of them on the first call, a parameter
        unfrozen later) with their optimizer state, and release the originals. True if it took any."""
        new = {fqn: layout for fqn, layout in layouts.items() if fqn not in self.layouts}
        self.layouts.update(new)
        self.optimizer_members = _members(binding, args)
        mixed = self.mixed
        for fqn, layout in new.items():
            p = local(binding.params[fqn])
            compute = p.to(mixed.param_dtype) if mixed else p
            self.frozen_casts.pop(fqn, None)
            if self.stage == 0:
                self.params[fqn] = compute.clone()
                continue
            if mixed:
                self.masters[fqn] = layout.shard_of(p, self.rank)
            if self.stage < 3:
                self.params[fqn] = layout.padded_flat(compute)
            elif not mixed or not mixed.cast_at_gather:  # else the gathers cast the masters: no param_dtype shard
                self.params[fqn] = layout.shard_of(compute, self.rank)
        if self.stage == 0 or not new:
            return bool(new)
        for oi, opt in enumerate(binding.optimizers(args)):
            for fqn, entries in binding.optimizer_state(opt):
                if fqn not in new:
                    continue
                for key, value in entries.items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    value = local(value)
                    if new[fqn].shards(key, value.shape):
                        self.opt_state[(oi, fqn, key)] = new[fqn].shard_of(value, self.rank)
                        self.sharded_state_keys.add((oi, fqn, key))
                    else:
                        self.opt_state[(oi, fqn, key)] = value  # scalars (Adam's step) stay whole
        self._release(binding, args, new)
        return True

    def add_state_turned_on(self, binding: StepBinding, args: tuple) -> None:
        """From stage 1 on: a zero shard, as the optimizer would create it, of each per-element state that a
        hyperparameter turned on after the step took the parameter (SGD's momentum raised from zero; other optimizers
        create state on a parameter's first step only, and fail eagerly on one turned on later). torch.optim
        starts SGD's buffer as a copy of the gradient, which a zero buffer updated once equals bit for bit; with
        dampening it does not, and the trace that creates the buffer is refused."""
        if self.stage == 0:
            return
        for oi, opt in enumerate(binding.optimizers(args)):
            spec = optim_support.spec_for(opt)
            for gi, group in enumerate(opt.param_groups if spec.creates_missing_state else ()):
                names = spec.per_element_state(group)
                if spec.starts_from_gradient(group) or self._state_names_met.get((oi, gi)) == names:
                    continue  # a call's cost: one look per group while no hyperparameter turns state on
                self._state_names_met[(oi, gi)] = names
                for p in group["params"]:
                    fqn = binding.fqn_of.get(id(p))
                    for name in names if fqn in self.layouts else ():
                        if (oi, fqn, name) not in self.opt_state:
                            self._add_zero_state(opt.state[p], oi, fqn, name, spec.initial_value(group))

    def _add_zero_state(self, entries: dict, oi: int, fqn: str, name: str, value: float) -> None:
        stored = self.stored(fqn)
        self.opt_state[(oi, fqn, name)] = torch.full((self.layouts[fqn].shard_numel,), value, dtype=stored.dtype,
                                                     device=stored.device)
        self.sharded_state_keys.add((oi, fqn, name))
        self._leave_empty(entries, oi, fqn, name, stored)

    def _release(self, binding: StepBinding, args: tuple, fqns) -> None:
        for fqn in fqns:
            release(binding.params[fqn])
            binding.params[fqn].grad = None
        for oi, opt in enumerate(binding.optimizers(args)):
            for fqn, entries in binding.optimizer_state(opt):
                if fqn not in fqns:
                    continue
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        self._leave_empty(entries, oi, fqn, key, value)

    def _leave_empty(self, entries: dict, oi: int, fqn: str, key: str, like: torch.Tensor) -> None:
        """In the optimizer's state, an empty tensor where the step holds the entry; its version shows a write."""
        entries[key] = torch.empty(0, dtype=like.dtype, device=like.device)
        self.released_state[(oi, fqn, key)] = entries[key], entries[key]._version

    def note_module_versions(self, binding: StepBinding) -> None:
        """After a run: the taken parameters as the step leaves them in the module."""
        self.module_versions = {fqn: _version(binding.params[fqn]) for fqn in self.layouts}

    def reconcile_writes(self, binding: StepBinding, args: tuple) -> None:
        """Before a run, what the loop wrote since the last one into what the step took. At stage 0 the module's
        parameter is the fp32 master under mixed precision: a write to it (``p.copy_(...)``, ``p.data = ...``) is
        cast again into the copy forward computes with. From stage 1 on the step holds the values, and the module's
        parameters and the optimizer's state are empty: a write there (weight clipping, ``nn.init``,
        ``optimizer.load_state_dict``, ``optimizer.state.clear()``) would be lost, and is refused by name."""
        written = [fqn for fqn, version in self.module_versions.items() if _version(binding.params[fqn]) != version]
        if self.stage == 0:
            for fqn in written:
                new = local(binding.params[fqn])
                if new.shape != self.params[fqn].shape:
                    raise CaptureError(f"parameter '{fqn}' was given data of another shape ({tuple(new.shape)}, not "
                                       f"{tuple(self.params[fqn].shape)}) after the step took it",
                                       hint=REPLACED_AFTER_TAKEN)
                self.params[fqn].copy_(new)
            return
        if written:
            raise CaptureError(
                f"parameter '{written[0]}' was written or converted after the step took it ({len(written)} such): "
                f"from stage {self.stage} on the step holds its values, and the module keeps an empty tensor, so the "
                "write would be lost", hint=_WRITE_THROUGH_THE_STEP)
        optimizers, params = binding.optimizers(args), binding.params
        for (oi, fqn, key), (empty, version) in self.released_state.items():
            entry = optimizers[oi].state.get(params[fqn], {}).get(key)
            if entry is not empty or entry._version != version:
                raise CaptureError(
                    f"the state '{key}' of parameter '{fqn}' in optimizer {oi} ({type(optimizers[oi]).__name__}) was "
                    f"written, replaced or removed after the step took it (optimizer.load_state_dict, "
                    f"state.clear(), exp_avg.zero_()): from "
                    f"stage {self.stage} on the step holds it, and the change would be lost",
                    hint=_WRITE_THROUGH_THE_STEP)

    def stored(self, fqn: str) -> torch.Tensor:
        """Parameter ``fqn`` as the step stores it in its master precision: the fp32 master under mixed precision."""
        return self.masters[fqn] if fqn in self.masters else self.params[fqn]

    def frozen_compute(self, fqn: str, param: torch.Tensor) -> torch.Tensor:
        """A frozen parameter in ``param_dtype``, cast once and again only after the parameter changed."""
        version = (param.data_ptr(), param._version)
        cached = self.frozen_casts.get(fqn)
        if cached is None or cached[0] != version:
            cached = self.frozen_casts[fqn] = (version, param.detach().to(self.mixed.param_dtype))
        return cached[1]

    def lookup(self, slot: Slot):
        """The tensor (or rank) the graph input ``slot`` takes from this state; None where the module owns it."""
        if slot.role == Role.RANK:
            return self.rank
        if slot.role == Role.LOSS_SCALE:
            return self.loss_scale
        if slot.role == Role.GROWTH_TRACKER:
            return self.growth_tracker
        if slot.role == Role.PARAM:
            owned = self.params.get(slot.fqn)
            frozen = self.module_params.get(slot.fqn)
            if owned is None and self.mixed is not None and frozen is not None and frozen.is_floating_point():
                return self.frozen_compute(slot.fqn, frozen)
            return owned
        if slot.role == Role.MASTER:
            return self.masters.get(slot.fqn)
        if slot.role == Role.OPT_STATE:
            return self.opt_state.get((slot.optimizer, slot.fqn, slot.key))
        if slot.role == Role.GRAD_IN:
            return self.kept_grads.get(slot.fqn)
        return None

    def keep_grads(self, binding: StepBinding, grads: dict[str, torch.Tensor]) -> None:
        """Hold ``grads`` (this rank's shards) for the next call, and drop those held before. Each parameter's
        ``.grad`` becomes an empty `KeptGradMarker`, so that the caller sees a gradient exists and the step sees
        what the caller does to it between calls (`take_back_grads`); a shard goes as soon as nothing holds its
        marker (``zero_grad()`` set ``.grad`` to None), as eager's gradient would."""
        self.kept_grads, self._markers = grads, {}
        for fqn in grads:
            p = binding.params[fqn]
            p.grad = KeptGradMarker.of(p, fqn)
            # the empty tensor itself (a DTensor marker's local tensor): model.to() swaps a DTensor gradient with its
            # conversion, which refuses tensors weakly referenced
            self._markers[fqn] = weakref.ref(local(p.grad), functools.partial(self._drop_kept, fqn))

    def _drop_kept(self, fqn: str, marker: weakref.ref) -> None:
        if self._markers.get(fqn) is marker:
            del self.kept_grads[fqn], self._markers[fqn]

    def take_back_grads(self, binding: StepBinding, read: frozenset[str]) -> None:
        """Before a call: drop the kept gradients it will not read, or whose marker ``zero_grad()`` set to None;
        zero those whose marker it zeroed (``set_to_none=False``). Refused: reading a gradient the step does not
        keep (a ``.grad`` set outside it), a ``.grad`` replaced or written in place otherwise."""
        unkept = sorted(read - set(self.kept_grads))
        if unkept:
            raise CaptureError(
                f"parameter '{unkept[0]}' has a .grad the step did not leave; from stage {self.stage} on gradients "
                "live with the step, and it accumulates only into those it kept from its last call",
                source=user_frame(), hint="call optimizer.zero_grad() before the step, or use stage 0")
        for fqn in list(self.kept_grads):
            grad, held = binding.params[fqn].grad, self._markers[fqn]()
            if grad is None or fqn not in read:
                del self.kept_grads[fqn], self._markers[fqn]  # first: the marker's going then finds nothing to drop
                binding.params[fqn].grad = None
                continue
            replaced = local(grad) is not held or not isinstance(grad, KeptGradMarker)
            writes = [] if replaced else grad.writes
            if replaced or any(op not in KeptGradMarker.ZEROING for op in writes):
                what = "replaced" if replaced else f"written in place ({writes[0]})"
                raise CaptureError(
                    f"the .grad of parameter '{fqn}' was {what} between calls; from stage {self.stage} on the step "
                    "keeps this rank's shard of the gradient it left there, and .grad holds only an empty marker",
                    source=user_frame(),
                    hint="leave .grad to the step (zero_grad() is fine); clip or read gradients inside the step")
            if writes:
                self.kept_grads[fqn].zero_()
                writes.clear()

    def trace_value(self, slot: Slot):
        """A stand-in of the full shape for a re-trace after the originals were released (never read)."""
        if slot.role in (Role.LOSS_SCALE, Role.GROWTH_TRACKER):
            return self.lookup(slot)
        if self.stage == 0:
            return None  # nothing was released
        if slot.role in (Role.PARAM, Role.MASTER) and slot.fqn in self.layouts:
            layout = self.layouts[slot.fqn]
            stored = self.stored(slot.fqn)
            dtype = stored.dtype if slot.role == Role.MASTER else layout.dtype
            return torch.empty(layout.shape, dtype=dtype, device=stored.device)
        if slot.role == Role.GRAD_IN and slot.fqn in self.kept_grads:  # the fp32 master's under mixed precision
            kept = self.kept_grads[slot.fqn]
            return torch.empty(self.layouts[slot.fqn].shape, dtype=kept.dtype, device=kept.device)
        if slot.role == Role.OPT_STATE and (slot.optimizer, slot.fqn, slot.key) in self.sharded_state_keys:
            layout = self.layouts[slot.fqn]
            value = self.opt_state[(slot.optimizer, slot.fqn, slot.key)]
            return torch.empty(layout.shape, dtype=value.dtype, device=value.device)
        return self.opt_state.get((slot.optimizer, slot.fqn, slot.key)) if slot.role == Role.OPT_STATE else None


class KeptGradMarker(torch.Tensor):
    """The empty tensor in ``.grad`` of a parameter whose gradient shard the step keeps between calls: it records the
    in-place ops the caller runs on it (``zero_grad(set_to_none=False)`` zeroes it; ``clip_grad_norm_`` would scale
    it), which the next call applies or refuses, and refuses at once to be read (a norm logged between calls would
    be an empty tensor's)."""

    ZEROING = tuple(op.overloadpacket.__name__ for op in ZEROING_OPS)  # the torch functions' names, as seen here
    _METADATA = ("requires_grad_", "detach_")  # what zero_grad() also calls: no values change
    # what the marker is, not its values (the properties but .data: ``__get__``), and what ``model.to()`` does to a
    # gradient (converts it, then sets the result as its .data)
    _CONVERTING = ("to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type")
    _DESCRIBING = ("__get__", "__repr__", "__format__", "__len__", "numel", "nelement", "size", "dim", "ndimension",
                   "stride", "element_size", "is_contiguous", "storage_offset", "is_floating_point", "is_complex",
                   *_CONVERTING, "_has_compatible_shallow_copy_type")
    _IN_PLACE = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")

    @classmethod
    def of(cls, param: torch.Tensor, fqn: str) -> "KeptGradMarker":
        empty = torch.empty(0, dtype=param.dtype, device=param.device)
        # a DTensor parameter takes only a DTensor of its spec as .grad: one over the empty tensor
        marker = (_KeptDTensorGradMarker(empty, param._spec, requires_grad=False) if isinstance(param, DTensor)
                  else empty.as_subclass(cls))
        marker.__dict__["fqn"] = fqn
        return marker

    @property
    def writes(self) -> list[str]:
        return self.__dict__.setdefault("_writes", [])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        markers = [t for arg in args for t in (arg if isinstance(arg, (list, tuple)) else (arg,))
                   if isinstance(t, KeptGradMarker)]
        setting_data = name == "__set__" and getattr(func, "__self__", None) is torch.Tensor.data
        written = []
        if (name.endswith("_") and not name.startswith("__")) or name in cls._IN_PLACE or setting_data:
            empty = setting_data and args[1].numel() == 0  # model.to() converting the marker itself
            if name not in cls._METADATA and not empty:
                written = markers[:1] if name in cls._IN_PLACE or setting_data else markers
        elif getattr(func, "__self__", None) is torch.Tensor.data or name not in cls._DESCRIBING:
            _refuse_between_calls(markers[0] if markers else None, name if name != "__get__" else ".data")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        for marker in written:  # once it ran: a write torch refused leaves the kept shard as it was
            marker.writes.append(".data =" if setting_data else name)
        return result


class _KeptDTensorGradMarker(KeptGradMarker, DTensor):
    """`KeptGradMarker` for a tensor-parallel parameter, a DTensor of its spec over an empty local tensor: torch
    functions reach it as they reach the plain marker. DTensor's own Python methods reach the local tensor without
    one; those that read it refuse here. ``model.to()`` swaps a DTensor gradient with its conversion
    (`torch.utils.swap_tensors`): converted to its own dtype and device the marker is itself, to another refused."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if name not in cls._CONVERTING or not isinstance(result, torch.Tensor):
            return result
        marker = args[0]
        if (result.dtype, result.device) != (marker.dtype, marker.device):
            _refuse_between_calls(marker, f"{name}: {result.dtype} on {result.device}", done="converted")
        return marker

    def to_local(self, *args, **kwargs):
        _refuse_between_calls(self, "to_local")

    def full_tensor(self, *args, **kwargs):
        _refuse_between_calls(self, "full_tensor")

    def redistribute(self, *args, **kwargs):
        _refuse_between_calls(self, "redistribute")

    def __repr__(self):
        return f"KeptGradMarker(of '{self.__dict__.get('fqn', '?')}', a DTensor over {self.placements})"


def _refuse_between_calls(marker: KeptGradMarker | None, what: str, done: str = "read"):
    """Refuse what the caller did to a kept gradient's marker (``done``: read, converted), naming the parameter."""
    fqn = marker.__dict__.get("fqn", "?") if marker is not None else "?"
    raise CaptureError(
        f"the .grad of parameter '{fqn}' is {done} between calls ({what}); from stage 1 on the step keeps this "
        "rank's shard of the gradient it left, and .grad holds only an empty marker", source=user_frame(),
        hint="read or clip gradients inside the step, after backward(); zero_grad() between calls is fine")


def _members(binding: StepBinding, args: tuple) -> list[frozenset[str]]:
    fqn_of = binding.fqn_of
    return [frozenset(fqn_of.get(id(p)) for group in opt.param_groups for p in group["params"]) - {None}
            for opt in binding.optimizers(args)]


def refuse_joining_an_optimizer(state: ShardedState, binding: StepBinding, args: tuple) -> None:
    """From stage 1 on, refuse, naming it, a parameter the step took that an optimizer has taken on since
    (``add_param_group``): the optimizer would make its state from the emptied original, and its values live in the
    step's shards."""
    optimizers = binding.optimizers(args)
    if state.stage == 0 or [sum(len(g["params"]) for g in opt.param_groups) for opt in optimizers] == \
            [len(members) for members in state.optimizer_members]:  # each call: count before naming
        return
    for oi, (members, now) in enumerate(zip(state.optimizer_members, _members(binding, args))):
        joined = sorted((now - members) & state.layouts.keys())
        if joined:
            raise CaptureError(
                f"parameter '{joined[0]}' joined optimizer {oi} ({type(optimizers[oi]).__name__}, "
                "add_param_group) after the step took it: from stage 1 on its values live in the step's shards, "
                "and the optimizer has no state for it",
                hint="give the optimizer every parameter before the first call (a group with lr=0 holds some "
                     "until their time), or freeze them with requires_grad_(False) until then: the step takes a "
                     "parameter when it is unfrozen")


_WRITE_THROUGH_THE_STEP = ("write model and optimizer state through the step: zerofx.load_state_dict(step, sd) with "
                           "a full state dict (zerofx.full_state_dict(step) gives the current one), or "
                           "zerofx.checkpoint.load; for weight clipping, clip inside the train step after the update")


def _version(p: torch.Tensor) -> tuple:
    """What changes when a tensor is written in place, given other memory or converted (another device is other
    memory)."""
    t = local(p)
    return t.data_ptr(), t._version, t.dtype


def refuse_taken(binding: StepBinding) -> None:
    """Refuse, naming it, a parameter another compiled step took and emptied: its values live with that step, and
    tracing its empty original would fail deep inside the model."""
    for fqn, p in binding.params.items():
        if released(p):
            raise CaptureError(
                f"parameter '{fqn}' was taken by another zerofx step, which owns its values from stage 1 on and "
                "left the original empty",
                hint="keep calling the step that took it (eval mode, a new batch shape or an unfrozen parameter "
                     "re-trace that step), or load zerofx.full_state_dict(that step) into a new model and optimizer")


_REFUSES_EAGER_USE = "_zerofx_refuses_eager_use"  # an attribute of a module `refuse_eager_use` hooked


def refuse_eager_use(module: torch.nn.Module) -> None:
    """From now on, calling ``module`` or loading a state dict into it while one of its parameters is released raises,
    naming the parameter, instead of failing inside the model or in torch's shape check on an empty tensor. The
    step's own traces run it on stand-ins and pass."""
    if not getattr(module, _REFUSES_EAGER_USE, False):
        module.register_forward_pre_hook(_refuse_if_released)
        module.register_load_state_dict_pre_hook(_refuse_loading_if_released)
        setattr(module, _REFUSES_EAGER_USE, True)


def _refuse_loading_if_released(module: torch.nn.Module, *_) -> None:
    fqn = next((name for name, p in module.named_parameters() if released(p)), None)
    if fqn is not None:
        raise CaptureError(
            f"a state dict is loaded into the model whose parameters a zerofx step took: parameter '{fqn}' lives "
            "with the step from stage 1 on (this rank's shard), and the module's own tensor is empty",
            source=user_frame(), hint=_WRITE_THROUGH_THE_STEP)


def _refuse_if_released(module: torch.nn.Module, _inputs) -> None:
    fqn = next((name for name, p in module.named_parameters() if released(p)), None)
    if fqn is not None:
        raise CaptureError(
            f"the model is called outside the zerofx step that took its parameters: parameter '{fqn}' lives with "
            "the step from stage 1 on (this rank's shard), and the module's own tensor is empty",
            source=user_frame(),
            hint="evaluate through the step (a call with the model in eval mode under torch.no_grad() traces an "
                 "evaluation graph once), load zerofx.full_state_dict(step) into another model, or use "
                 "zerofx.prepare with torch.compile(model, backend=zerofx.backend(...)), whose model runs eagerly too")
