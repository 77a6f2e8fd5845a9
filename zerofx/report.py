"""``zerofx.report(step)``: the last step's measured model states and communication next to the paper's formula."""

from __future__ import annotations

from tabulate import tabulate

from zerofx.formulas import N_d, Psi


def report(step, *, print_output: bool = True) -> str:
    stats = step.stats()
    f = stats.formula
    n, psi = stats.world_size, stats.num_params
    measured = stats.model_state_bytes
    rows = []
    for name, expr, value in [
        ("params", f.params, measured["params"]),
        ("grads (end of backward)", f.grads, measured["grads"]),
        ("master params + optimizer states", f.optimizer,
         measured["master_params"] + measured["optimizer_states"]),
        ("model states total", f.model_states, measured["total"]),
    ]:
        rows.append([name, _fmt(value), str(expr), _fmt(f.evaluate(expr, psi, n))])
    rows.append(["communication (elements sent)", _fmt(stats.comm_volume), str(f.comm),
                 _fmt(f.evaluate(f.comm, psi, n))])
    rows.append(["activations (most alive at once)", _fmt(stats.activation_bytes), "", ""])
    rows.append(["peak (all live tensors)", _fmt(stats.peak_bytes), "", ""])
    bytes_per = ", ".join(f"{k}={v}" for k, v in f.bytes_per_element.items() if str(k) != "M" or v != 1)
    title = (f"zerofx stage {stats.stage}: {n} ranks, Psi = {psi} parameters ({bytes_per}); "
             f"bytes per rank unless noted")
    text = title + "\n" + tabulate(rows, headers=["", "measured", "formula", "formula value"],
                                   colalign=("left", "right", "left", "right"))
    if stats.recomputed_regions:
        text += (f"\nactivation checkpointing: {stats.recomputed_regions} regions recomputed in backward, "
                 f"{stats.recomputed_flops:,} FLOPs, {stats.checkpoint_bytes:,} bytes of saved inputs")
    placed = step._last.ctx.artifacts.get("memory_plan")
    whose = "the buffers left outside the arena" if placed is not None else "the step's own buffers"
    text += (f"\nmemory plan (M_D): {whose} need at least {stats.lower_bound_bytes:,} bytes at once; "
             f"planned in one arena of {stats.arena_bytes:,} (fragmentation {stats.fragmentation:.2%}; "
             + ", ".join(f"{layout} {nbytes:,}" for layout, nbytes in stats.arena_bytes_by_layout.items())
             + "); largest alive at the peak: " + ", ".join(f"{name} ({category}, {nbytes:,})"
                                               for name, category, nbytes in stats.largest_at_peak[:3]))
    if placed is not None:
        text += (f"\nmemory_plan: {placed.buffers} buffers written into one arena of {placed.arena_bytes:,} bytes, "
                 f"{placed.layout} (lower bound {placed.lower_bound_bytes:,}; "
                 + ", ".join(f"{layout} {nbytes:,}" for layout, nbytes in placed.arena_bytes_by_layout.items())
                 + f"), allocated once and kept between steps ({stats.held_plan_bytes:,} bytes with the scalar "
                 "operands; release_arena() frees them); left to the allocator: "
                 + ", ".join(f"{reason} {nbytes:,}" for reason, nbytes in sorted(placed.left.items(),
                                                                            key=lambda item: -item[1])))
    scalars = step._last.ctx.artifacts.get("scalar_operands")
    if scalars is not None:
        text += (f"\nscalar operands: {scalars.calls} fp32 calls read numbers from 0-dim tensors the graph keeps "
                 f"({scalars.constants} constants, {scalars.computed} numbers filled each step), not fresh ones")
    if stats.tp_comm_volume:
        text += f"\ntensor parallelism: {stats.tp_comm_volume:,.0f} elements sent in the tp collectives"
        if stats.activation_comm_volume:
            text += (f"; P_a's all-gathers of partitioned checkpoints {stats.activation_comm_volume:,.0f} "
                     f"({stats.activation_comm_volume / stats.tp_comm_volume:.0%} of them)")
    if step.config.partition_activations and step._dp.tp_size == 1:
        text += "\npartition_activations (P_a) needs a mesh with a 'tp' dimension larger than 1: nothing was split"
    if stats.other_collectives():
        text += f"\n+ {len(stats.other_collectives())} small collectives outside the formula (rank check, buffers)"
    if print_output:
        print(text)
    return text


def _fmt(value) -> str:
    if value is None:
        return "n/a (track_memory=False)"
    return f"{value:,.0f}"


def paper_table(psi: float = 7.5e9, world_size: int = 64) -> str:
    """The paper's model-state figures for mixed-precision Adam (b_p = b_g = 2, K = 12), in GB."""
    from zerofx.formulas import formula

    rows = []
    for stage in range(4):
        f = formula(stage, b_param=2, b_grad=2, k_optimizer=12)
        rows.append([stage, str(f.model_states), f"{f.evaluate(f.model_states, psi, world_size) / 1e9:.3g}"])
    return tabulate(rows, headers=["stage", f"model states ({Psi}, {N_d})", f"GB at Psi={psi:.2g}, N_d={world_size}"])
