"""The results as a Markdown table per world size and a bar chart of peak memory and step-time ratio."""

from __future__ import annotations

import math
import statistics

MiB = 2**20
# fp32 losses agree to summation order; bf16 ones to bf16's rounding of the forward and the gradients
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}


def loss_outliers(results: list[dict]) -> dict[str, list[str]]:
    """Per precision: the systems whose final loss is not within LOSS_RTOL of the median of that precision's."""
    out = {}
    for precision, rtol in LOSS_RTOL.items():
        same = [r for r in results if r["precision"] == precision]
        if same:
            mid = statistics.median(r["final_loss"] for r in same)
            out[precision] = [f"{r['name']} ({(r['final_loss'] - mid) / mid:+.1%})" for r in same
                              if not (math.isfinite(r["final_loss"]) and abs(r["final_loss"] - mid) <= rtol * abs(mid))]
    return out


def losses_agree(results: list[dict]) -> dict[str, bool]:
    return {precision: not outliers for precision, outliers in loss_outliers(results).items()}


def targets(run: dict) -> list[str]:
    """zerofx-3 against FSDP2 (reshard) in peak bytes and time, zerofx-0 against DDP in time, per round."""
    by = {(r["name"], r["precision"]): r for r in run["results"]}
    lines = []
    for precision in LOSS_RTOL:
        ours, fsdp = by.get(("zerofx-3", precision)), by.get(("FSDP2 reshard", precision))
        if ours and fsdp:
            lines.append(f"zerofx-3 {precision}: peak {ours['peak_bytes'] / fsdp['peak_bytes']:.3f}× FSDP2 reshard's "
                         f"({(ours['peak_bytes'] - fsdp['peak_bytes']) / MiB:+.2f} MiB), step time {_ratio(ours)}×.")
    ours, ddp = by.get(("zerofx-0", "fp32")), by.get(("DDP", "fp32"))
    if ours and ddp:
        per_round = [a / b for a, b in zip(ours["step_ms"], ddp["step_ms"])]
        lines.append(f"zerofx-0 fp32: step time {statistics.median(per_round):.2f}× DDP's "
                     f"({min(per_round):.2f}–{max(per_round):.2f} over rounds).")
    return lines


def _ratio(r: dict) -> str:
    if not r["ratio"]:
        return "–"
    lo, mid, hi = min(r["ratio"]), statistics.median(r["ratio"]), max(r["ratio"])
    return f"{mid:.2f} ({lo:.2f}–{hi:.2f})"


def _kept(r: dict) -> str:
    """Every storage alive between steps; of those, what zerofx's memory_plan keeps for the next step."""
    plan = r.get("plan_bytes", 0)  # absent from runs recorded before it was
    return f"{r['model_state_bytes'] / MiB:.2f}" + (f" (plan {plan / MiB:.2f})" if plan else "")


def table(run: dict) -> str:
    psi, n = run["psi"], run["world_size"]
    lines = [f"**{n} ranks**, Ψ = {psi:,} parameters. Bytes per rank (the largest over ranks), MiB.", "",
             "| system | precision | peak | model states | formula (stage) | collectives | comm (Ψ) | comm MiB | "
             "step ms | × FSDP2 reshard | final loss |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in run["results"]:
        lines.append(
            f"| {r['name']} | {r['precision']} | {r['peak_bytes'] / MiB:.2f} | {_kept(r)} | "
            f"{r['formula_bytes'] / MiB:.2f} ({r['stage']}) | {r['collectives']} | "
            f"{r['comm_elements'] / psi * n / (n - 1):.2f} | {r['comm_bytes'] / MiB:.2f} | "
            f"{statistics.median(r['step_ms']):.1f} | {_ratio(r)} | {r['final_loss']:.5f} |")
    outliers = loss_outliers(run["results"])
    lines += ["", "Final losses agree: " + ", ".join(
        f"{p} {'yes' if not out else 'no, ' + ', '.join(out)} (rtol {LOSS_RTOL[p]:g})" for p, out in outliers.items())
        + "."]
    lines += ["Targets: " + " ".join(targets(run))]
    for name, reason in run["skipped"].items():
        lines.append(f"Skipped {name}: {reason}.")
    return "\n".join(lines)


def chart(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 0.32 * max(len(r["results"]) for r in runs) * len(runs) + 1.5),
                             squeeze=False)
    for row, run in zip(axes, runs):
        labels = [f"{r['name']} {r['precision']}" for r in run["results"]]
        colors = ["tab:blue" if r["name"].startswith("zerofx") else "tab:gray" for r in run["results"]]
        peaks = [r["peak_bytes"] / MiB for r in run["results"]]
        ratios = [statistics.median(r["ratio"]) if r["ratio"] else 0 for r in run["results"]]
        row[0].barh(labels, peaks, color=colors)
        row[0].set_xscale("log")  # DeepSpeed's default buckets are two orders of magnitude above the rest
        row[0].set_xlabel(f"peak MiB per rank (log scale), {run['world_size']} ranks")
        row[1].barh(labels, ratios, color=colors)
        row[1].axvline(1.0, color="black", linewidth=0.8)
        row[1].set_xlabel(f"step time ÷ FSDP2 reshard's (same round), {run['world_size']} ranks")
        for ax, values, fmt in ((row[0], peaks, "{:.1f}"), (row[1], ratios, "{:.2f}")):
            for y, value in enumerate(values):
                ax.text(value, y, " " + fmt.format(value), va="center", fontsize=7)
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
