"""The public entry point: ``zerofx.compile(train_step, stage=...)`` and the step it returns."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from zerofx import collectives, guards, optim_support, ranks, runtime
from zerofx.mesh import DTensorSpecs, local, mesh_ranks
from zerofx.binding import REPLACED_AFTER_TAKEN, StepBinding, refuse_tensor_hooks
from zerofx.capture import values_changed
from zerofx.errors import CaptureError
from zerofx.memory import StepProbe
from zerofx.mixed_precision import MixedPrecision
from zerofx.passes import PassContext
from zerofx.sharded_state import ShardedState, refuse_eager_use, refuse_joining_an_optimizer, refuse_taken
from zerofx.state_dict import load_state_dict as load_step_state, state_dict as step_state
from zerofx.stats import StepStats, measure
from zerofx.units import UNIT_CAP_BYTES, UnitRule, check_rule, unit_of_params

log = logging.getLogger("zerofx")

UNSHARDED_BUCKET_BYTES = 25 * 2**20  # DDP's bucket size, for collectives that free nothing (all-reduce, stage 1-2)


@dataclass(frozen=True)
class Config:
    stage: int = 0
    bucket_bytes: int | None = None  # None: units from the model's blocks; an int: buckets of that size everywhere
    prefetch: int = 1  # stage 3: all-gathers issued this many buckets ahead of their first use
    reshard_after_forward: bool = True  # stage 3: free gathered parameters after forward, gather again in backward
    dump_dir: str | None = None
    # ranks check every step that they run the same graph (an 8-byte all-gather, or at stage 0 an element riding on
    # the first bucket): a rank that diverges raises instead of hanging
    verify_ranks: bool = True
    track_memory: bool = False  # run node by node and measure peak and gradient bytes (slower)
    mixed_precision: MixedPrecision | None = None
    max_traces: int = 8  # graphs kept, one per guard key; beyond it the least recently used is evicted
    units: UnitRule = "blocks"  # what a communication unit is (zerofx.units), unless bucket_bytes is given
    unit_cap_bytes: int = UNIT_CAP_BYTES  # no unit is larger (C_B)
    checkpoint: UnitRule | None = None  # modules whose activations backward recomputes ("blocks", classes, predicate)
    activation_budget: float | None = None  # fraction of the checkpointed regions' activations kept (knapsack)
    recompute_pointwise: bool = True  # backward recomputes cheap pointwise outputs instead of keeping them
    offload_activations: bool = False  # checkpoints wait in host memory between forward and backward (P_a+cpu)
    mesh: object = None  # a DeviceMesh ("dp",) or ("dp", "tp"): ZeRO over "dp", the model's DTensors over "tp"
    partition_activations: bool = False  # P_a: checkpoints replicated over "tp" kept as 1/tp slices
    memory_plan: bool = False  # M_D: intermediates written into one preplanned arena, reused every step
    keep_graphs: bool = False  # keep the graph after capture and after each pass for step.graph(name)

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        check_rule(self.units)
        if self.checkpoint is not None:
            check_rule(self.checkpoint, "checkpoint")
        if self.activation_budget is not None and not 0.0 <= self.activation_budget <= 1.0:
            raise ValueError(f"activation_budget must be a fraction in [0, 1], got {self.activation_budget!r}")
        if self.unit_cap_bytes <= 0:
            raise ValueError(f"unit_cap_bytes must be positive, got {self.unit_cap_bytes}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if not isinstance(self.max_traces, int) or self.max_traces < 1:
            raise ValueError(f"max_traces must be a positive int, got {self.max_traces!r}")
        if self.mesh is not None and self.mixed_precision is not None:
            raise ValueError("mesh= with mixed_precision= is not supported: tensor-parallel steps run in fp32")


def compile(train_step=None, *, stage: int = 0, bucket_bytes: int | None = None, prefetch: int = 1,
            reshard_after_forward: bool = True, mixed_precision: MixedPrecision | None = None,
            dump_dir: str | None = None, verify_ranks: bool = True, track_memory: bool = False,
            max_traces: int = 8, units: UnitRule = "blocks", unit_cap_bytes: int = UNIT_CAP_BYTES,
            checkpoint: UnitRule | None = None, activation_budget: float | None = None,
            recompute_pointwise: bool = True, offload_activations: bool = False, mesh=None,
            partition_activations: bool = False, memory_plan: bool | None = None, keep_graphs: bool = False):
    """Capture ``train_step(model, optimizer, *batch)`` into one graph on its first call and run it with ZeRO
    ``stage`` (0: data parallel; 1: optimizer state sharded; 2: and gradients; 3: and parameters).

    Usable as ``step = zerofx.compile(train_step, stage=3)`` or as a decorator ``@zerofx.compile(stage=3)``.
    ``mixed_precision=zerofx.MixedPrecision(param_dtype=torch.bfloat16)`` computes and communicates in bf16 with
    fp32 master weights (stage 3 gathers casts of the master shards; ``cast_at_gather=False`` keeps bf16 shards
    instead). ``dump_dir`` (or the environment variable ``ZEROFX_DUMP``) writes the graph after capture
    and after each pass; ``keep_graphs`` (implied by ``dump_dir``) keeps them for ``step.graph(name)``. At most
    ``max_traces`` graphs are kept (one per guard key, least recently used evicted).
    Stage 3 gathers parameters, and stages 2-3 reduce-scatter gradients, by the model's ``units`` (each repeated block
    by default; module classes or a predicate ``(path, module) -> bool`` otherwise; at most ``unit_cap_bytes``);
    ``bucket_bytes=N`` instead groups every collective into buckets of at most N bytes. ``checkpoint`` (the same
    kinds of rule as ``units``) keeps only the inputs of each picked module's forward and recomputes the rest in
    backward, drawing the same random numbers; ``activation_budget`` (a fraction; checkpointing the blocks unless
    ``checkpoint`` says otherwise) keeps that share of what backward reads from them, chosen by recompute cost.
    ``recompute_pointwise`` (on by default) lets backward remake cheap outputs (GELU's, a LayerNorm's) from inputs
    it keeps anyway instead of keeping them from forward; results are bitwise the same. ``offload_activations``
    moves what checkpointed blocks keep to host memory until backward needs it (P_a+cpu). ``mesh`` (a DeviceMesh
    with dimensions ``("dp", "tp")``) shards ZeRO state over ``"dp"`` only, for a model whose layers
    ``parallelize_module`` split over ``"tp"``: the tensor-parallel collectives are captured as DTensor issues them.
    ``partition_activations`` (P_a) keeps each checkpoint that the tp ranks hold alike as this rank's 1/tp slice,
    all-gathered over tp before its recompute (with ``offload_activations``, the slices wait in host memory).
    ``memory_plan`` (M_D) writes the step's intermediates into one arena planned from their lifetimes, allocated
    once and reused every step (kept between steps: ``release_arena()`` frees it until the next step); results are
    bitwise the same. By default it is on at stage 0 and off at 1-3.
    """
    if (activation_budget is not None or offload_activations or partition_activations) and checkpoint is None:
        checkpoint = "blocks"
    if memory_plan is None:
        # planned, a stage-0 step reuses one arena every step instead of taking its memory back from the system
        # and faulting it in again (on CPU, thousands of page faults a step); from stage 1 on, collectives'
        # results stay with the allocator and planning is opt-in
        memory_plan = stage == 0
    elif not isinstance(memory_plan, bool):
        raise TypeError(f"memory_plan must be True, False or None (on at stage 0 only), got {memory_plan!r}")
    config = Config(stage, bucket_bytes, prefetch, reshard_after_forward,
                    dump_dir or os.environ.get("ZEROFX_DUMP"), verify_ranks, track_memory, mixed_precision,
                    max_traces, units, unit_cap_bytes, checkpoint, activation_budget, recompute_pointwise,
                    offload_activations, mesh, partition_activations, memory_plan, keep_graphs)
    if train_step is None:
        return functools.partial(CompiledStep, config=config)
    return CompiledStep(train_step, config=config)


def _refuse_complex_shards(binding: StepBinding) -> None:
    """From stage 1 on a parameter is sharded as a flat range of real elements; torch.optim updates a complex one
    through ``view_as_real``, which no such range can take."""
    for fqn, p in binding.trainable().items():
        if p.is_complex():
            raise CaptureError(f"parameter '{fqn}' is {p.dtype}: zerofx shards real parameters only (stages 1-3)",
                               hint="train the model at stage 0, or keep the parameter as two real ones (its real "
                                    "and imaginary parts)")


def _refuse_replacing_owned(old: StepBinding, new: StepBinding, owned) -> None:
    """A step that owns parameters (from stage 1 on, or under mixed precision) trains the ones it took: refuse,
    naming it, one the model no longer holds."""
    for fqn in owned:
        if new.params.get(fqn) is not old.params[fqn]:
            raise CaptureError(
                f"parameter '{fqn}' of the model is not the one the step took on its first call (it was replaced: a "
                "new submodule, load_state_dict(assign=True), an assignment): the step owns the parameters it took "
                "and would go on training those",
                hint=REPLACED_AFTER_TAKEN)


def _refuse_prepared(modules) -> None:
    from zerofx.backend.prepared import is_prepared  # the backend builds on this module

    for module in modules:
        if is_prepared(module):
            raise CaptureError(
                f"the {type(module).__name__} passed to the step was given to zerofx.prepare: the backend path owns "
                "its parameters",
                hint="train it with torch.compile(model, backend=zerofx.backend(...)), or compile a step over a model "
                     "that was not prepared")


class CompiledStep:
    def __init__(self, train_step, *, config: Config):
        functools.update_wrapper(self, train_step)
        self.train_step = train_step
        self.config = config
        self._cache: OrderedDict[tuple, runtime.CompiledGraph] = OrderedDict()  # least recently used first
        self._arena = runtime.SharedArena()  # memory_plan: one arena for every cached graph
        self._traces = 0
        self._binding: StepBinding | None = None
        self._binding_ids: tuple = ()
        self._args: tuple = ()
        self._owned: ShardedState | None = None
        self._owned_parts: dict | None = None
        self._last_key: dict | None = None
        self._last_hash: int | None = None  # key_hash(self._last_key)
        self._ran_twice = False  # the last step ran the graph of the step before it, on every rank (they agreed)
        self._last: runtime.CompiledGraph | None = None
        self._last_records: list = []
        self._last_probe: StepProbe | None = None
        self._reads_incoming_grads = False  # learned from the traces
        self._grads_added_to: frozenset[str] = frozenset()  # whose incoming .grad a trace's backward added to
        self._side_effects_seen: set[str] = set()  # what the step's traces changed in Python, by name
        self._evicting = False  # the cache holds max_traces graphs: each new one evicts the least recently used
        self._specs = DTensorSpecs()  # the DTensors among parameters and optimizer state, before they are taken
        self._dp = mesh_ranks(config.mesh)
        if config.partition_activations and self._dp.tp_size == 1:
            log.warning("zerofx: partition_activations (P_a) splits checkpoints across a tensor-parallel group; "
                        "without a mesh with a 'tp' dimension larger than 1 it changes nothing")

    def __call__(self, *args, **kwargs):
        args = self._positional(args, kwargs)
        with collectives.recording() as records:
            out = self._step(args)
        self._last_records = records
        return out

    def bind(self, *args, **kwargs) -> "CompiledStep":
        """Bind the step to its model, optimizer and an example batch, called as the step is, without training:
        capture the graph and take the sharded state, so that ``zerofx.state_dict(self)`` is the target
        ``torch.distributed.checkpoint.load`` fills before the first step. Every rank calls it."""
        compiled = self._prepare(self._positional(args, kwargs), carried=False)
        collectives.settle_pending()  # nothing runs: the rank agreement is awaited here
        changed = values_changed(compiled.captured.side_effects)
        if changed:  # a hook the trace installed stays and serves the first call; a value it changed was used up
            raise CaptureError(f"bind() traced the step, which {changed[0]}: the call that makes that change with "
                               "it is not run, and the first step would start from the changed value",
                               hint="bind with the value as the first step should find it after the change, or call "
                                    "the step instead of bind()")
        return self

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The call's arguments by position: a keyword argument goes where the train step's signature puts it (the
        step finds models, optimizers and the batch by position), a default it skips to get there with it."""
        if not kwargs:
            return args
        signature = inspect.signature(self.train_step)
        given = signature.bind(*args, **kwargs).arguments
        by_keyword = [name for name, p in signature.parameters.items()
                      if name in given and p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
        if by_keyword:
            raise TypeError(f"the train step's signature takes {by_keyword} by keyword only (after * or as **kwargs): "
                            "zerofx passes the step's arguments by position; make them positional parameters")
        positional = [p for p in signature.parameters.values() if p.kind != p.KEYWORD_ONLY]
        last = max(i for i, p in enumerate(positional) if p.name in given)
        values = []
        for p in positional[:last + 1]:
            if p.kind == p.VAR_POSITIONAL:
                values += given.get(p.name, ())
            else:
                values.append(given[p.name] if p.name in given else p.default)
        return tuple(values)

    def state_dict(self) -> dict:
        """This rank's shards in place (``zerofx.state_dict``); with ``load_state_dict`` the step is a DCP
        ``Stateful``: ``dcp.save({"train": step}, ...)`` and ``dcp.load`` work on it directly."""
        return step_state(self)

    def load_state_dict(self, sd: dict) -> None:
        load_step_state(self, sd)

    def _step(self, args: tuple):
        compiled = self._prepare(args)
        self._last_probe = StepProbe(compiled.gm) if self.config.track_memory else None
        out = runtime.execute(compiled, binding=self._binding, args=args, state=self._owned,
                              probe=self._last_probe, specs=self._specs, tp_rank=self._dp.tp_rank)
        if self._owned is not None and self._owned.stage == 0:  # its update wrote them; from stage 1 on they are empty
            self._owned.note_module_versions(self._binding)
        return out

    def _prepare(self, args: tuple, carried: bool = True) -> runtime.CompiledGraph:
        """Bind, guard, capture on a new key, take the sharded state on the first call: all but running. With
        ``carried`` (a step that runs), the rank agreement may ride on the graph's first collective."""
        binding = self._bind(args)
        taken = set(binding.module_positions) | set(binding.optimizer_positions)
        self._args = tuple(a if i in taken else None for i, a in enumerate(args))  # not the batch: it would live on
        if self._owned is not None:
            refuse_joining_an_optimizer(self._owned, binding, args)  # before its lazy state is made
            self._owned.reconcile_writes(binding, args)
            self._owned.add_state_turned_on(binding, args)  # before init_lazy_state would make it whole
        for opt in binding.optimizers(args):
            optim_support.init_lazy_state(opt)
        world_size, rank, group_name = self._dp.size, self._dp.rank, self._dp.group_name
        key = guards.step_key(binding, args, self._owned_parts, self._reads_incoming_grads, self.train_step)
        # the common case: no freezing, hashing or cache lookup; a graph whose trace changed Python state is not run
        # again: its call traces anew, and refuses a change made again (`refuse_repeated_side_effects`)
        same = key == self._last_key and not self._last.captured.side_effects
        if not same:
            self._refuse_refreezing(binding)
        several_ranks = dist.is_initialized() and dist.get_world_size() > 1  # tensor-parallel peers included
        if several_ranks and self.config.verify_ranks:
            self._agree(key, same, carried and self._ran_twice)
        self._ran_twice = same
        built = False
        if same:
            compiled = self._last
        else:
            frozen = guards.freeze(key)
            compiled = self._cache.get(frozen)
            built = compiled is None
            if built:
                compiled, key = self._build(binding, args, key, world_size, group_name)
            else:
                self._cache.move_to_end(frozen)
            self._last_hash = guards.key_hash(key)
        if several_ranks and not compiled.verified:
            ranks.verify_same(compiled.fingerprint, "the captured graph",
                              lambda: f"graph fingerprint {compiled.fingerprint:x}")
            compiled.verified = True
        if (self.config.stage >= 1 or self.config.mixed_precision) and (self._owned is None or built):
            self._take_state(binding, args, compiled, key, world_size, rank)
        self._last_key, self._last = key, compiled
        return compiled

    def _agree(self, key: dict, same: bool, ran_twice: bool) -> None:
        """Ranks agree that they run the same graph (`zerofx.ranks`). Once every rank has run the last graph twice,
        and that graph carries the agreement on its first collective, an unchanged step issues nothing of its own
        and a changed one replays that graph's collectives; else an 8-byte all-gather, awaited before the step's
        first collective when the step is unchanged, at once when it changed."""
        value, what, last_key = self._last_hash if same else guards.key_hash(key), "the step's inputs", self._last_key

        def describe() -> str:
            if last_key is None:  # a line per part: the mismatch shows the parts that differ
                return "\n".join(f"{part}: {value!r}" for part, value in sorted(key.items()))
            return guards.describe_change(last_key, key) or "same as its last step"

        carried = self._last.ctx.artifacts.get("carried_agreement") if ran_twice else None
        if carried is not None and same:
            ranks.expect_carried(value, what, describe)
        elif carried is not None:
            ranks.replay_carried(carried, value, what, describe)
        elif same:
            collectives.before_next_collective(ranks.agree(value, what, describe))  # overlaps the step up to then
        else:
            ranks.agree(value, what, describe)()

    def _take_state(self, binding, args, compiled, key, world_size, rank) -> None:
        """Own the trainable parameters and their optimizer state: all of them on the first call, a parameter
        unfrozen since when the graph that trains it is built."""
        mixed, stage = self.config.mixed_precision, self.config.stage
        layouts = compiled.ctx.artifacts.get("layouts") or binding.trainable_layouts(
            mixed.param_dtype if mixed else None, world_size)
        if self._owned is not None:
            self._owned.absorb(binding, args, layouts)
            self._owned.note_module_versions(binding)
            return
        self._owned = ShardedState.take(binding, args, layouts, stage, rank, mixed, self._dp.group)
        self._owned.note_module_versions(binding)
        if stage >= 1:
            self._owned_parts = guards.owned_parts(key)  # as they were before the originals were released
            for module in binding.modules(args):
                refuse_eager_use(module)

    def _owned_params(self, binding: StepBinding) -> frozenset[str]:
        """The parameters the step owns once this call has run: those it owns, or on its first call every trainable
        one, whether or not the graph being built computes a gradient for it (an evaluation first)."""
        if self._owned is not None:
            return frozenset(self._owned.layouts)
        return frozenset(binding.trainable())

    def _refuse_refreezing(self, binding: StepBinding) -> None:
        if self._owned is None or self.config.stage == 0:
            return
        for fqn in self._owned.layouts:
            if not binding.params[fqn].requires_grad:
                raise CaptureError(
                    f"parameter '{fqn}' was frozen (requires_grad=False) after the step took its shards at stage "
                    f"{self.config.stage}; the step keeps training what it owns",
                    hint="freeze parameters before the first call, or compile a new step from a full state dict")

    def _bind(self, args: tuple) -> StepBinding:
        ids = tuple(id(a) for a in args if isinstance(a, (nn.Module, torch.optim.Optimizer)))
        if self._binding is not None and ids == self._binding_ids:
            rebound = self._binding.rebound(args)
            if rebound is None:
                refuse_tensor_hooks(self._binding)  # one registered since the last call
                return self._binding
            if self._owned is not None:
                _refuse_replacing_owned(self._binding, rebound, self._owned.layouts)
            rebound.check_optimizers(args)
            if self._owned is not None:
                self._owned.module_params = rebound.params  # frozen ones are read from the module
            for p in set(self._binding.params.values()) - set(rebound.params.values()):
                if p.grad is not None and self._arena.holds(local(p.grad)):  # the replaced one keeps its gradient,
                    p.grad = p.grad.clone()                                  # not the whole arena
            self._binding = rebound
        else:
            if self._owned is not None:
                raise RuntimeError("this step owns the sharded state of the model and optimizer it first ran with; "
                                   "compile a new step for other ones")
            first = self._binding is None
            self._binding, self._binding_ids = StepBinding.from_args(args), ids
            self._side_effects_seen.clear()  # what traces changed in Python was the other models'
            refuse_taken(self._binding)
            if first and self._dp.size > 1:
                runtime.sync_module_states(self._binding, self._dp.group)
        _refuse_prepared(self._binding.modules(args))
        refuse_tensor_hooks(self._binding)
        if self.config.stage >= 1:
            _refuse_complex_shards(self._binding)
        return self._binding

    def _build(self, binding, args, key, world_size, group_name) -> tuple[runtime.CompiledGraph, dict]:
        """A new graph for ``key``, cached; the key it is cached under (with the gradients' presence once the
        step is known to read incoming gradients)."""
        self._specs.record(binding, args, self.config.mesh)  # before the step takes (and releases) what they describe
        if self._last_key is not None:
            log.warning("zerofx: re-tracing %s because %s", self._name,
                        guards.describe_change(self._last_key, key) or "its last trace changed Python state ("
                        + ", ".join(self._last.captured.side_effects) + ")")
        dump_dir = self.config.dump_dir
        if dump_dir and self._traces:
            dump_dir = os.path.join(dump_dir, f"trace{self._traces}")
        if dump_dir and world_size > 1 and dist.get_rank() != 0:
            dump_dir = None  # the graph is the same on every rank: rank 0 writes it
        c = self.config
        reduce_dtype = c.mixed_precision.reduce_dtype if c.mixed_precision else None
        units = None if c.bucket_bytes is not None else unit_of_params(
            binding.modules(args), binding.module_prefixes, binding.param_aliases, c.units)
        ctx = PassContext(c.stage, world_size, group_name, c.bucket_bytes or UNSHARDED_BUCKET_BYTES, c.prefetch,
                          c.reshard_after_forward, reduce_dtype, units, c.unit_cap_bytes,
                          activation_budget=c.activation_budget, offload_activations=c.offload_activations,
                          recompute_pointwise=c.recompute_pointwise, tp_size=self._dp.tp_size,
                          tp_group_name=self._dp.tp_group_name, tp_sharded=self._specs.split(),
                          partition_activations=c.partition_activations, memory_plan=c.memory_plan,
                          owned_params=self._owned_params(binding),
                          carry_agreement=c.verify_ranks and dist.is_initialized()
                          and world_size == dist.get_world_size())
        compiled = runtime.build(self.train_step, binding, args, ctx, dump_dir, self._owned, c.mixed_precision,
                                 checkpoint=c.checkpoint,
                                 specs=self._specs, keep_graphs=c.keep_graphs or c.dump_dir is not None,
                                 arena=self._arena, grads_added_to=self._grads_added_to,
                                 first_trace=self._traces == 0, side_effects_seen=self._side_effects_seen)
        learned = compiled.grads_added_to - self._grads_added_to
        stale = [k for k, graph in self._cache.items() if graph.grads_released & learned]
        if stale:  # graphs that released gradients this one adds to: traced again, keeping them
            log.warning("zerofx: %s adds to the gradients it finds on this call (no zero_grad() before backward), "
                        "where an earlier graph of it released the gradients its update used, as a zero_grad() "
                        "would: this call may lack gradients eager would still hold; those graphs are traced again "
                        "and keep them from now on", self._name)
            for k in stale:
                del self._cache[k]
        self._grads_added_to = compiled.grads_added_to
        # the key again, with the gradients' presence, unless the trace changed in Python what the key holds: the
        # next call then traces again, and refuses what it changes again (`refuse_repeated_side_effects`)
        if compiled.reads_incoming_grads and not self._reads_incoming_grads and not compiled.captured.side_effects:
            key = guards.step_key(binding, args, self._owned_parts, reads_incoming_grads=True, step_fn=self.train_step)
        self._reads_incoming_grads = self._reads_incoming_grads or compiled.reads_incoming_grads
        if not compiled.captured.side_effects:  # see `_prepare`
            self._cache[guards.freeze(key)] = compiled
        self._traces += 1
        if len(self._cache) > c.max_traces:
            if not self._evicting:  # once: from here on, every new key evicts
                log.warning("zerofx: %s has traced %d graphs, more than max_traces=%d: the least recently used is "
                            "evicted from now on; what keeps changing: %s",
                            self._name, self._traces, c.max_traces,
                            ", ".join(guards.varying_parts([dict(k) for k in self._cache])))
            self._cache.popitem(last=False)
            self._evicting = True
        return compiled, key

    @property
    def _name(self) -> str:
        """The train step's name for messages; a ``functools.partial`` has none of its own."""
        return getattr(self.train_step, "__name__", None) or repr(self.train_step)

    def graph(self, name: str | None = None) -> fx.GraphModule:
        """The final graph of the last step, or (with ``keep_graphs``) the graph after capture ("capture") or after
        the named pass."""
        if self._last is None:
            raise RuntimeError("the step has not run yet: call it once before asking for its graph")
        if name is None:
            return self._last.gm
        if not self._last.snapshots:
            raise KeyError(f"the graph after {name!r} was not kept: compile with keep_graphs=True (or dump_dir=)")
        if name not in self._last.snapshots:
            raise KeyError(f"no graph named {name!r}; known: {', '.join(self._last.snapshots)}")
        return self._last.snapshots[name].module()

    @property
    def loss_scale(self) -> float | None:
        """float16 mixed precision: the current dynamic loss scale."""
        owned = self._owned
        return None if owned is None or owned.loss_scale is None else owned.loss_scale.item()

    @property
    def ranks(self):
        """This rank's place among the data-parallel ranks (as a prepared model's ``ranks``)."""
        return self._dp

    def release_arena(self) -> None:
        """Free the arena ``memory_plan`` keeps between steps (before evaluation or other work outside the step,
        say); the next step allocates it again. Gradients the last step left in it keep its bytes until they are
        dropped (``zero_grad()``)."""
        self._arena.release()

    def stats(self) -> StepStats:
        """What the last step did: its collectives and communication volume, model-state bytes and peak."""
        if self._last is None:
            raise RuntimeError("the step has not run yet: call it once before asking for its stats")
        return measure(self.config, self._last, self._binding, self._args, self._owned, self._last_records,
                       self._last_probe, traces=self._traces)
