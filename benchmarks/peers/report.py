"""The results as a Markdown table per world size and a bar chart of peak memory and step-time ratio."""

from __future__ import annotations

import math
import statistics

MiB = 2**20
# fp32 losses agree to summation order; bf16 ones to bf16's rounding of the forward and the gradients
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}


def losses_agree(results: list[dict]) -> dict[str, bool]:
    """Per precision: every system's final loss within LOSS_RTOL of the median of that precision's losses."""
    out = {}
    for precision, rtol in LOSS_RTOL.items():
        losses = [r["final_loss"] for r in results if r["precision"] == precision]
        if losses:
            mid = statistics.median(losses)
            out[precision] = all(math.isfinite(x) and abs(x - mid) <= rtol * abs(mid) for x in losses)
    return out


def _ratio(r: dict) -> str:
    if not r["ratio"]:
        return "–"
    lo, mid, hi = min(r["ratio"]), statistics.median(r["ratio"]), max(r["ratio"])
    return f"{mid:.2f} ({lo:.2f}–{hi:.2f})"


def table(run: dict) -> str:
    psi, n = run["psi"], run["world_size"]
    lines = [f"**{n} ranks**, Ψ = {psi:,} parameters. Bytes per rank (the largest over ranks), MiB.", "",
             "| system | precision | peak | model states | formula (stage) | collectives | comm (Ψ) | comm MiB | "
             "step ms | × FSDP2 reshard | final loss |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in run["results"]:
        lines.append(
            f"| {r['name']} | {r['precision']} | {r['peak_bytes'] / MiB:.2f} | {r['model_state_bytes'] / MiB:.2f} | "
            f"{r['formula_bytes'] / MiB:.2f} ({r['stage']}) | {r['collectives']} | "
            f"{r['comm_elements'] / psi * n / (n - 1):.2f} | {r['comm_bytes'] / MiB:.2f} | "
            f"{statistics.median(r['step_ms']):.1f} | {_ratio(r)} | {r['final_loss']:.5f} |")
    agree = losses_agree(run["results"])
    lines += ["", "Final losses agree: " + ", ".join(
        f"{p} {'yes' if ok else 'NO'} (rtol {LOSS_RTOL[p]:g})" for p, ok in agree.items()) + "."]
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
        row[1].set_xlabel(f"step time ÷ FSDP2 reshard's, same round and precision, {run['world_size']} ranks")
        for ax, values, fmt in ((row[0], peaks, "{:.1f}"), (row[1], ratios, "{:.2f}")):
            for y, value in enumerate(values):
                ax.text(value, y, " " + fmt.format(value), va="center", fontsize=7)
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
