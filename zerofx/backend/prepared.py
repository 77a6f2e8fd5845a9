"""``zerofx.prepare(model, optimizer, stage=...)``: the model and optimizer a user keeps training eagerly, made
ready for ``torch.compile(model, backend=zerofx.backend(...))``.

`Prepared` records what the backend needs to know about the model (the name of every parameter and buffer it will
meet among a compiled region's inputs, the process group) and what a step did (the collectives issued between two
``optimizer.step()`` calls). It carries the attributes ``zerofx.state_dict``, ``zerofx.full_state_dict``,
``zerofx.load_state_dict`` and ``zerofx.checkpoint`` read from a compiled step, so checkpoints have one layout
whichever way a run trains, and a run saved through one path resumes through the other. From stage 1 on it holds
the sharded state, and under mixed precision the fp32 master weights (`zerofx.backend.shards`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from zerofx import collectives, guards, optim_support, ranks, runtime
from zerofx.api import Config
from zerofx.backend.eager_reads import GatheredForRead, ShardedParameter
from zerofx.backend.shards import Shards
from zerofx.binding import StepBinding
from zerofx.collectives import CollectiveRecord
from zerofx.mesh import DTensorSpecs, MeshRanks, mesh_ranks
from zerofx.mixed_precision import MixedPrecision, cast_floating_inputs
from zerofx.sharded_state import refuse_taken
from zerofx.state_dict import load_state_dict as load_step_state, state_dict as step_state
from zerofx.stats import StepStats, model_state_bytes, ring_volume, step_formula, trainable_numel
from zerofx.step_graph import Role, Slot
from zerofx.units import unit_of_params

_PREPARED: "weakref.WeakKeyDictionary[nn.Module, Prepared]" = weakref.WeakKeyDictionary()


class Prepared:
    """A model and optimizer prepared for the zerofx backend, and what their last step did."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.ranks = mesh_ranks(config.mesh)
        self.control_group = _control_group(self.ranks)
        self._binding = StepBinding.from_args((model, optimizer))
        refuse_taken(self._binding)
        self._args = (model, optimizer)
        self.shards: Shards | None = None  # stages 1-3 and mixed precision, from `shard`
        self._owned = None  # the sharded state (`zerofx.state_dict` reads it as a step's)
        self.units = unit_of_params([model], [""], self._binding.param_aliases)  # what stages 2-3 communicate by
        self.bucket_bytes: int | None = None  # the compiling backend's; stages 1-2 gather after the update by it
        self._specs = DTensorSpecs()
        self._slots = {id(p): Slot(Role.PARAM, fqn) for fqn, p in self._binding.params.items()}
        self._slots.update({id(b): Slot(Role.BUFFER, fqn) for fqn, b in self._binding.buffers.items()})
        self._by_storage = self._storage_index()
        self.graphs: dict[str, object] = {}  # "region0.forward", "region0.backward", ...: the graphs as run
        self._pending: list[CollectiveRecord] = []  # issued since the last optimizer.step()
        self.last_records: list[CollectiveRecord] = []
        self._accumulated: set[str] = set()  # parameters autograd accumulated a gradient into in this backward
        self._reduced: set[str] = set()  # parameters whose gradient a compiled backward communicated since then
        # the model's trainable parameters (under mixed precision at stage 0 the binding names the masters instead)
        self._module_params = self._binding.trainable()
        self._compiled_grads: set[tuple[int, int]] = set()  # stage 0: (data_ptr, version) of each compiled gradient
        self._summed_with_eager: set[str] = set()  # stage 0: a compiled gradient arrived summed with another part
        self._end_of_backward_queued = False
        for fqn, p in self._module_params.items():
            p.register_hook(lambda grad, fqn=fqn: self._note_incoming(fqn, grad))
            p.register_post_accumulate_grad_hook(lambda p, fqn=fqn: self._note_accumulated(fqn, p))
        optimizer.register_step_post_hook(lambda *_: self._end_step())

    def shard(self) -> None:
        """Stages 1-3: take this rank's shards of the parameters and the optimizer's state; under mixed precision
        (any stage) put the optimizer on fp32 master weights and the model's parameters in ``param_dtype``."""
        self.shards = Shards(self._binding, self.model, self.optimizer, self.config.stage, self.ranks,
                             self.config.mixed_precision)
        self._owned = self.shards.state
        self._by_storage = self._storage_index()
        if self.config.stage == 3:
            self._gather_on_eager_reads()

    def _gather_on_eager_reads(self) -> None:
        """Stage 3: eager code that reads a parameter (a module whose forward Dynamo leaves to eager, a parameter
        passed to a disabled function, between steps) reads its gathered value (`eager_reads`)."""
        for fqn in self.layouts:
            p = self._module_params[fqn]
            if type(p) is not nn.Parameter:
                raise NotImplementedError(f"zerofx.prepare: parameter {fqn!r} is a {type(p).__name__}; stage 3 through "
                                          "the backend takes plain torch.nn.Parameter objects")
            p.__class__ = ShardedParameter  # the same object: the model, autograd and Dynamo keep meeting it
            p.fqn, p.read_gathered, p.write_full = fqn, self._read_gathered, self.shards.write_full

    def _read_gathered(self, p: ShardedParameter) -> torch.Tensor:
        """Parameter ``p`` whole for one eager read, differentiable to ``p``. The ranks first agree on what is read
        (8 bytes), so a read on one rank only raises `RankMismatchError` on every rank at the others' next
        agreement (a compiled region's, before its first collective) instead of meeting a collective of theirs."""
        if self.ranks.size > 1:
            ranks.verify_same(guards.key_hash({"eager read": (p.fqn,)}), "the parameter eager code reads",
                              lambda: f"parameter {p.fqn} read by eager code", self.control_group)
        with collectives.recording() as records:
            full = GatheredForRead.apply(p, lambda: self.shards.gathered_value(p.fqn))
        self._pending += records
        return full

    def _storage_index(self) -> dict[int, str]:
        """Where each parameter's memory is -> its name; stage 3's parameters hold none, and are known by identity."""
        return {p.untyped_storage().data_ptr(): fqn for fqn, p in self._binding.params.items()
                if p.untyped_storage().nbytes()}

    @property
    def layouts(self) -> dict:
        """fqn -> `ParamLayout` of each parameter stored as shards (none at stage 0)."""
        return self.shards.layouts if self.shards is not None else {}

    def slot_of(self, value) -> Slot | None:
        """What a compiled region's input is: one of this model's parameters or buffers, or None."""
        return self._slots.get(id(value))

    def fqn_of(self, param) -> str | None:
        """The name of a parameter as a compiled graph receives it (itself, or a tensor sharing its storage)."""
        slot = self._slots.get(id(param))
        return slot.fqn if slot is not None else self._by_storage.get(param.untyped_storage().data_ptr())

    def record(self, records: list[CollectiveRecord], reduced: set[str] = frozenset()) -> None:
        """What a compiled graph did: the collectives it issued; for a forward, the parameters it read, whose
        gradients its backward communicates."""
        self._pending.extend(records)
        self._reduced |= reduced

    def note_compiled_grad(self, grad: torch.Tensor) -> None:
        """Stage 0: a compiled backward hands autograd ``grad``, averaged over ranks."""
        self._compiled_grads.add((grad.data_ptr(), grad._version))

    def during_backward(self) -> None:
        """Called from every compiled backward and gradient hook: the eager parts are reduced once this backward
        ends (`_after_backward`), so that code between ``backward()`` and ``step()`` (clipping) reads them reduced."""
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            _at_end_of_backward(self._after_backward)

    def _note_incoming(self, fqn: str, grad: torch.Tensor) -> None:
        """Stage 0, as autograd is about to accumulate ``grad`` into parameter ``fqn``: a parameter a compiled region
        read whose incoming gradient is not one a compiled backward handed over (autograd summed it with a part
        computed eagerly, or with another region's) is averaged once more before the update. Averaging what is
        averaged already changes nothing, so the eager part ends averaged and the rest as it was."""
        self.during_backward()
        if self.shards is not None or grad is None or fqn not in self._reduced:
            return  # from stage 1 on autograd receives only eager parts (compiled backwards hand shards over)
        if (grad.data_ptr(), grad._version) not in self._compiled_grads:
            self._summed_with_eager.add(fqn)

    def _note_accumulated(self, fqn: str, p: nn.Parameter) -> None:
        # autograd calls the hook also where a compiled backward handed the gradient to a shard instead (None here)
        self.during_backward()
        if p.grad is not None:
            self._accumulated.add(fqn)

    def _after_backward(self) -> None:
        """As a backward ends: gradients autograd accumulated outside every compiled backward (eager code read those
        parameters: a graph break Dynamo could not resume from, a disabled function) join the ones compiled
        backwards communicated, as DDP or FSDP2 would have reduced them. The ranks first agree on which parameters
        those are (8 bytes), so a rank whose eager code reads other parameters raises `RankMismatchError` on every
        rank instead of waiting. At stage 0 (fp32) they are averaged in place; from stage 1 on (and under mixed
        precision), where compiled backwards hand their gradients to the optimizer's shards instead of autograd, they
        are reduce-scattered (averaged) into those shards' gradients and the parameters' own cleared."""
        self._end_of_backward_queued = False
        eager = sorted((self._accumulated - self._reduced) | self._summed_with_eager if self.shards is None
                       else self._accumulated)
        self._accumulated, self._compiled_grads, self._summed_with_eager = set(), set(), set()
        if self.ranks.size > 1:
            ranks.verify_same(guards.key_hash({"eager": tuple(eager)}),
                              "the parameters whose gradients were computed outside the compiled regions",
                              lambda: ", ".join(eager) or "none", self.control_group)
        if eager:
            with collectives.recording() as records:
                self._reduce_eager_gradients(eager)
            self._pending += records

    def _reduce_eager_gradients(self, eager: list[str]) -> None:
        grads = {fqn: self._module_params[fqn].grad for fqn in eager}
        if self.shards is not None:
            self.shards.receive_eager_grads(grads)
            for fqn in eager:
                self._module_params[fqn].grad = None
            return
        group, size = self.ranks.group_name, self.ranks.size
        if size > 1:
            runtime.communicate_flat(list(grads.values()), lambda flat: collectives.wait(
                collectives.all_reduce(flat, "avg", group, size)))

    def _end_step(self) -> None:
        if self.shards is not None:
            self._pending += self.shards.after_update(self.bucket_bytes)
        self.last_records, self._pending = self._pending, []
        self._reduced = set()

    def stats(self) -> StepStats:
        """The last step's collectives (forward, backward and ``optimizer.step()``) and communication volume; the
        model-state bytes kept between steps by class, as a whole step counts them (gradients, which live inside a
        step, are not measured here: ``grads`` and ``total`` are None), and the paper's formula."""
        binding, owned = self._binding, self._owned
        records = list(self.last_records)
        return StepStats(self.config.stage, self.ranks.size, trainable_numel(binding, owned), records,
                         ring_volume([r for r in records if r.purpose == "data"]),
                         model_state_bytes(binding, self._args, owned, self.config.mixed_precision, grads=None),
                         formula=step_formula(self.config, binding, self._args, owned))  # one backward a step

    def graph_breaks(self, *args, **kwargs) -> list[str]:
        """Where torch.compile splits the model's forward on these inputs, each break as ``torch._dynamo.explain``
        gives it: the reason and the line of user code. Runs the forward once, without zerofx, and clears
        torch.compile's caches (``explain`` does), so the compiled model compiles again on its next call. At stage 3
        the parameters are gathered for that run. Every rank calls it."""
        with self.shards.gathered(self._binding) if self.shards is not None else contextlib.nullcontext():
            explained = torch._dynamo.explain(self.model)(*args, **kwargs)
        return [_describe_break(b) for b in explained.break_reasons]

    def state_dict(self) -> dict:
        """This rank's state in place, in ``zerofx.state_dict``'s layout (a DCP ``Stateful``, as a step is)."""
        return step_state(self)

    def load_state_dict(self, sd: dict) -> None:
        load_step_state(self, sd)


def _control_group(dp: MeshRanks) -> dist.ProcessGroup | None:
    """The data-parallel ranks again, for the ranks' agreements alone: the eager loop decides which compiled graphs
    run, so a rank may run one the others do not, and its agreement must then meet another agreement (and fail),
    never a collective of gradients or parameters (and hang). Every rank creates it, in ``prepare``."""
    if dp.size == 1:
        return None
    return dist.new_group(ranks=dist.get_process_group_ranks(dp.group or dist.group.WORLD))


def _at_end_of_backward(callback) -> None:
    """Run ``callback`` once the running backward pass has finished (autograd's engine callback, as DDP's and FSDP2's
    end-of-backward work uses it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _describe_break(reason) -> str:
    frame = reason.user_stack[-1] if reason.user_stack else None
    where = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else ""
    return f"{reason.reason.strip()}{where}"


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int = 0,
            mixed_precision: MixedPrecision | None = None, mesh=None):
    """Make ``model`` and ``optimizer`` ready for ``torch.compile(model, backend=zerofx.backend(stage=...))`` and
    return the two objects to keep using: every rank starts from the first rank's parameters and buffers, as DDP
    does, and the optimizer's state exists before its first step (as torch.optim would create it), so a checkpoint
    can be loaded into it (``zerofx.checkpoint.load(zerofx.prepared(model), ...)``). From ``stage`` 1 on the
    optimizer's ``param_groups`` then hold this rank's shards in place of the trainable parameters (its state, and
    the gradients ``optimizer.zero_grad()`` clears, are theirs), and at stage 3 the model's parameters keep their
    shapes but no memory (`zerofx.backend.shards`). ``mixed_precision=zerofx.MixedPrecision(param_dtype=
    torch.bfloat16)`` runs forward and backward in ``param_dtype`` (the model's trainable parameters are cast to it)
    and reduces gradients in ``grad_dtype``, while the optimizer updates fp32 master weights in their place, as
    ``zerofx.compile`` does with the same option. Every rank calls it, once, before the model first runs."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"zerofx.prepare takes one torch.optim.Optimizer, got {type(optimizer).__name__}: the backend "
                        "path updates the shards through it; for several optimizers use zerofx.compile, whose train "
                        "step takes each")
    _check_mixed_precision(model, mixed_precision, stage)
    if mesh is not None:
        raise NotImplementedError("zerofx.prepare: mesh= is not supported by the backend path yet; use "
                                  "zerofx.compile for tensor parallelism")
    if model in _PREPARED:
        raise ValueError("zerofx.prepare: this model was prepared already")
    if stage >= 1 or mixed_precision is not None:
        _refuse_trainable_outside(model, optimizer)
    prepared = Prepared(model, optimizer, Config(stage=stage, mixed_precision=mixed_precision, mesh=mesh))
    optim_support.init_lazy_state(optimizer)
    if prepared.ranks.size > 1:
        runtime.sync_module_states(prepared._binding, prepared.ranks.group)
    if stage >= 1 or mixed_precision is not None:
        prepared.shard()
    if mixed_precision is not None and mixed_precision.cast_forward_inputs:  # the compiled forward traces the hook
        model.register_forward_pre_hook(cast_floating_inputs(mixed_precision.param_dtype), with_kwargs=True)
    _PREPARED[model] = prepared
    return model, optimizer


def _refuse_trainable_outside(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A parameter that requires grad goes into the optimizer's shards: refuse, naming it, one the optimizer does
    not hold (another optimizer stepping it would find no gradient and leave it as it is, silently)."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    outside = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if outside:
        raise ValueError(
            f"zerofx.prepare: parameter '{outside[0]}' requires grad but is not in the optimizer given to prepare "
            f"({len(outside)} such): from stage 1 on, and under mixed precision, the backend path keeps each "
            "trainable parameter's values and gradient in that optimizer's shards. Give the optimizer every trainable "
            "parameter (a param group of their own keeps their lr and weight decay), freeze the others with "
            "requires_grad_(False), or use zerofx.compile, whose train step takes several optimizers")


def _check_mixed_precision(model: nn.Module, mixed: MixedPrecision | None, stage: int) -> None:
    if mixed is None:
        return
    if not isinstance(mixed, MixedPrecision):
        raise TypeError(f"zerofx.prepare: mixed_precision must be a zerofx.MixedPrecision, got {type(mixed).__name__}")
    if mixed.scaling is not None:
        raise NotImplementedError(
            f"zerofx.prepare: mixed_precision with loss scaling (param_dtype={mixed.param_dtype}, loss_scaling="
            f"{mixed.loss_scaling}) is not supported by the backend path yet; use param_dtype=torch.bfloat16, or "
            "zerofx.compile for float16 with loss scaling")
    if stage == 3 and not mixed.cast_at_gather:
        raise NotImplementedError(
            "zerofx.prepare: mixed_precision with cast_at_gather=False (a param_dtype shard kept at stage 3) is not "
            "supported by the backend path yet: its stage 3 gathers casts of the fp32 masters; use zerofx.compile")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()]
    if frozen:
        raise NotImplementedError(
            f"zerofx.prepare: mixed_precision with frozen floating parameters ({frozen[:4]}) is not supported by the "
            "backend path yet: they would stay fp32 where the rest computes in param_dtype; use zerofx.compile")


def is_prepared(model: nn.Module) -> bool:
    return getattr(model, "_orig_mod", model) in _PREPARED


def prepared(model: nn.Module) -> Prepared:
    """The `Prepared` record of a model given to ``zerofx.prepare`` (or of ``torch.compile``'s wrapper of it)."""
    model = getattr(model, "_orig_mod", model)
    if model not in _PREPARED:
        raise ValueError(f"{type(model).__name__} was not given to zerofx.prepare")
    return _PREPARED[model]


def owner_of(inputs) -> Prepared | None:
    """The prepared model whose parameters are among a compiled region's inputs; None for a region that reads no
    parameter (nothing to communicate)."""
    for p in _PREPARED.values():
        if any(p.slot_of(x) is not None and p.slot_of(x).role == Role.PARAM for x in inputs):
            return p
    if any(isinstance(x, nn.Parameter) for x in inputs):
        raise ValueError("zerofx.backend: the compiled region reads parameters of a model not given to "
                         "zerofx.prepare; call model, optimizer = zerofx.prepare(model, optimizer, stage=...) "
                         "before torch.compile")
    return None
