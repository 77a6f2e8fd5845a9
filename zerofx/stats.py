"""What a step reports about itself: `StepStats`, read with ``step.stats()``.

Bytes are measured, never derived from the formula: persistent state by the storages the step holds between steps,
gradients and the peak by `StepProbe` over live storages (``track_memory=True``). Communication is counted from the
records of the collectives the step actually issued, by ring accounting: each rank sends (N-1)/N of the full buffer
per all-gather or reduce-scatter and 2(N-1)/N per all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerofx import formulas
from zerofx.collectives import CollectiveRecord
from zerofx.memory import storage_bytes
from zerofx.step_graph import StepGraph

_c10d = torch.ops._c10d_functional
_TP_COLLECTIVES = (_c10d.all_reduce.default, _c10d.all_gather_into_tensor.default,
                   _c10d.reduce_scatter_tensor.default)


@dataclass
class StepStats:
    stage: int
    world_size: int
    num_params: int  # Ψ: elements of the distinct trainable parameters
    collectives: list[CollectiveRecord] = field(default_factory=list)  # the last step's, in issue order
    comm_volume: float = 0.0  # elements this rank sent for parameters and gradients in the last step
    model_state_bytes: dict[str, int | None] = field(default_factory=dict)
    peak_bytes: int | None = None
    formula: formulas.Formula | None = None
    traces: int = 0  # graphs captured so far (one per guard key; a key seen again after eviction traces again)
    # what the communication differs from the formula by: (what, elements sent per rank), summing to the difference
    comm_vs_formula: list[tuple[str, float]] = field(default_factory=list)
    units: list[str] = field(default_factory=list)  # each communication unit: path or parameters, bytes, why cut
    activation_bytes: int | None = None  # the most bytes forward and backward allocate alive at once (track_memory)
    # activation checkpointing: regions recomputed, the FLOPs backward spends recomputing, the saved inputs' bytes
    recomputed_regions: int = 0
    recomputed_flops: int = 0
    checkpoint_bytes: int = 0
    resident_checkpoint_bytes: int | None = None  # the most checkpoint bytes resident at once (track_memory)
    offloaded_bytes: int | None = None  # the most checkpoint bytes waiting in host memory at once (track_memory)
    # tensor parallelism: elements this rank sends per step in the tp collectives the model's DTensors issue (from the
    # graph), and in P_a's all-gathers of partitioned checkpoints (from the records)
    tp_comm_volume: float = 0.0
    activation_comm_volume: float = 0.0
    # M_D, from the final graph's lifetimes: the step's own buffers (not its inputs) in one planned arena
    lower_bound_bytes: int = 0  # the most bytes they hold at once: no placement needs less
    arena_bytes: int = 0  # the planned arena: the smaller of one joint plan and one pool per lifetime class
    arena_bytes_by_layout: dict[str, int] = field(default_factory=dict)  # both ("joint", "pools by class")
    largest_at_peak: list[tuple[str, str, int]] = field(default_factory=list)  # (buffer, class, bytes), inputs too
    # memory_plan: what the step keeps between steps for it (0: unplanned): the arena its graphs share (as large as
    # the largest plan, the gradients left in .grad inside it) and the last graph's scalar operands
    held_plan_bytes: int = 0
    # plans: the activation bytes alive when the most are (activation_bytes), by the op that made them
    activations_at_peak: dict[str, int] = field(default_factory=dict)

    @property
    def fragmentation(self) -> float:
        """arena / lower bound - 1: the bytes a plan loses to gaps, as a fraction of what must be held."""
        return self.arena_bytes / self.lower_bound_bytes - 1 if self.lower_bound_bytes else 0.0

    @property
    def comm_volume_psi(self) -> float:
        return self.comm_volume / self.num_params

    def data_collectives(self) -> list[CollectiveRecord]:
        return [r for r in self.collectives if r.purpose == "data"]

    def other_collectives(self) -> list[CollectiveRecord]:
        """Buffer broadcasts and control exchanges (rank agreement): small, listed apart from the formula's."""
        return [r for r in self.collectives if r.purpose != "data"]


def ring_volume(records: list[CollectiveRecord]) -> float:
    """Elements each rank sends, by ring accounting, but those carrying the rank agreement beside the data."""
    total = 0.0
    for r in records:
        share = (r.group_size - 1) / r.group_size
        total += (r.numel - r.carried) * share * (2 if r.kind == "all_reduce" else 1)
    return total


def _k_optimizer(binding, args, owned) -> float:
    """K of fp32 optimizer state over every optimizer of the step, weighted by the elements each one updates."""
    numel = {fqn: layout.numel for fqn, layout in owned.layouts.items()} if owned and owned.layouts else \
        {fqn: p.numel() for fqn, p in binding.trainable().items()}
    weighted, total = 0.0, 0
    for opt in binding.optimizers(args):
        updated = sum(numel.get(binding.fqn_of[id(p)], 0) for group in opt.param_groups for p in group["params"])
        weighted += formulas.optimizer_bytes_per_param(opt) * updated
        total += updated
    k = weighted / total if total else 0.0
    return int(k) if k == int(k) else k


def trainable_numel(binding, owned) -> int:
    """Ψ: the elements of the distinct trainable parameters."""
    return sum(layout.numel for layout in owned.layouts.values()) if owned else \
        sum(p.numel() for p in binding.trainable().values())


def model_state_bytes(binding, args, owned, mixed, grads: int | None) -> dict[str, int | None]:
    """Bytes by class of what is kept between steps: the owned shards (``owned``, from stage 1 on or under mixed
    precision), else the module's parameters and the optimizer's state; ``grads`` as measured (None: not measured,
    and then no total)."""
    module_params = list(binding.trainable().values())
    module_state = [v for opt in binding.optimizers(args) for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
    params = storage_bytes(owned.params.values()) if owned else storage_bytes(module_params)
    if mixed:  # fp32 master weights: the step's shards, or at stage 0 the module's own parameters
        masters = storage_bytes(owned.masters.values()) if owned.masters else storage_bytes(module_params)
    else:
        masters = 0
    optimizer = storage_bytes(owned.opt_state.values()) if owned and owned.stage >= 1 else storage_bytes(module_state)
    state = {"params": params, "grads": grads, "master_params": masters, "optimizer_states": optimizer}
    state["total"] = None if grads is None else params + grads + masters + optimizer
    return state


def step_formula(config, binding, args, owned, micro: int = 1) -> formulas.Formula:
    """The paper's formula for ``config``'s stage, with the step's element sizes and optimizer."""
    mixed = config.mixed_precision
    element = next(iter(binding.params.values())).dtype.itemsize
    return formulas.formula(config.stage,
                            b_param=mixed.param_dtype.itemsize if mixed else element,
                            b_grad=mixed.grad_dtype.itemsize if mixed else element,
                            k_optimizer=_k_optimizer(binding, args, owned) + (4 if mixed else 0),
                            reshard_after_forward=config.reshard_after_forward,
                            micro_batches=micro, casts_masters=mixed is not None and mixed.cast_at_gather)


def measure(config, compiled, binding, args, owned, records, probe, traces: int) -> StepStats:
    state = model_state_bytes(binding, args, owned, config.mixed_precision, probe.grad_bytes if probe else None)
    micro = StepGraph(compiled.gm).num_microbatches()
    formula = step_formula(config, binding, args, owned, micro)
    recomputed = compiled.ctx.artifacts.get("recomputed", {}).values()
    memory = compiled.memory_plan()
    return StepStats(config.stage, compiled.ctx.world_size, trainable_numel(binding, owned), list(records),
                     ring_volume([r for r in records if r.purpose == "data"]), state,
                     probe.peak_bytes if probe else None, formula, traces,
                     _comm_vs_formula(compiled.ctx, owned, formula, micro), _describe_units(compiled.ctx),
                     probe.activation_bytes if probe else None, len(recomputed),
                     sum(r.flops for r in recomputed), sum(r.checkpoint_bytes for r in recomputed),
                     probe.high_water.get("checkpoints", 0) if probe else None,
                     probe.high_water.get("offloaded", 0) if probe else None,
                     _tp_volume(compiled.gm.graph, compiled.ctx),
                     ring_volume([r for r in records if r.purpose == "activations"]),
                     memory.placement.lower_bound_bytes, memory.placement.arena_bytes,
                     memory.placement.arena_bytes_by_layout,
                     [(s.name, s.category, s.nbytes) for s in memory.largest_at_peak()],
                     _held_plan_bytes(compiled))


def _held_plan_bytes(compiled) -> int:
    scalars = compiled.ctx.artifacts.get("scalar_operands")
    return compiled.shared_arena.nbytes + (scalars.nbytes if scalars else 0)


def _tp_volume(graph, ctx) -> float:
    """Ring volume of the functional collectives over the tp group in ``graph`` (what DTensor issued)."""
    if ctx.tp_size == 1:
        return 0.0
    share = (ctx.tp_size - 1) / ctx.tp_size
    total = 0.0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _TP_COLLECTIVES and node.args[-1] == ctx.tp_group_name:
            # ring accounting counts the full buffer: a reduce-scatter's input, an all-gather's output
            full = node.args[0] if node.target is _c10d.reduce_scatter_tensor.default else node
            total += full.meta["val"].numel() * share * (2 if node.target is _c10d.all_reduce.default else 1)
    return total


def _comm_vs_formula(ctx, owned, formula: formulas.Formula, micro: int) -> list[tuple[str, float]]:
    """The formula counts Ψ elements per gather or reduction of every trainable parameter; the step moves padded
    parameters, reduces only the gradients something reads (an optimizer over some of the parameters), gathers after
    the update only what it updated, and at stage 3 gathers only what each phase reads, some parameters twice (a tied
    embedding read again at the head)."""
    if ctx.world_size == 1 or owned is None or owned.stage == 0:
        return []
    layouts = owned.layouts
    share = (ctx.world_size - 1) / ctx.world_size
    multiple = formula.evaluate(formula.comm, 1, ctx.world_size) / share  # 2, M+1, 3M or 2M
    padding = sum(l.padded_numel - l.numel for l in layouts.values())
    items = [("padding to a multiple of N_d", padding * multiple * share)] if padding else []
    reduced = {f for b in ctx.artifacts.get("grad_buckets", []) for f in b.names}
    if reduced and (unreduced := [f for f in layouts if f not in reduced]):
        reductions = 1 if owned.stage == 1 else micro  # stage 1 reduces the accumulated gradient once
        items.append((f"gradients not reduced, which nothing reads: {_names(unreduced)}",
                      -sum(layouts[f].padded_numel for f in unreduced) * reductions * share))
    if owned.stage < 3 and "param_buckets" in ctx.artifacts:
        gathered = {f for b in ctx.artifacts["param_buckets"] for f in b.names}
        if not_updated := [f for f in layouts if f not in gathered]:
            items.append((f"not gathered after the update, which leaves them as they were: {_names(not_updated)}",
                          -sum(layouts[f].padded_numel for f in not_updated) * share))
    gathers = ctx.artifacts.get("gathers", [])
    for phase in sorted({p for p, _ in gathers}, key=lambda p: p.value, reverse=True):
        buckets = [b for p, b in gathers if p == phase]
        gathered = {f for b in buckets for f in b.names}
        unread = [f for f in layouts if f not in gathered]
        if unread:
            items.append((f"not gathered in {phase.value}, which does not read them: {_names(unread)}",
                          -sum(layouts[f].padded_numel for f in unread) * micro * share))
        for b in buckets:
            if b.reason == "read again later":
                items.append((f"gathered again in {phase.value} for a later read: {_names(b.names)}",
                              sum(layouts[f].padded_numel for f in b.names) * micro * share))
    return items


def _describe_units(ctx) -> list[str]:
    buckets = ctx.artifacts.get("gather_buckets") or ctx.artifacts.get("grad_buckets") or []
    return [f"{b.unit or _names(b.names)}: {b.nbytes:,} bytes ({b.reason})" for b in buckets]


def _names(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
