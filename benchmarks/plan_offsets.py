"""How long `zerofx.memory.plan` takes on a large problem, and how close its arenas come to the lower bound.

    python benchmarks/plan_offsets.py [FILE.csv | FOLDER ...] [--time-budget S]

Plans a random 10,000-block problem (mostly short lifetimes, a tenth long ones, sizes log-uniform from 64 B to
16 MiB) and prints the seconds and the ratio of arena to lower bound. Then, for each CSV file given or found in a
folder given (benchmarks/data/minimalloc by default), prints the ratio of the default heuristics, of the
branch-and-bound search given ``--time-budget`` seconds, and of plain best-fit by size beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from zerofx.memory import plan, read_csv

DEFAULT_FILES = Path(__file__).parent / "data" / "minimalloc"


def random_blocks(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    start = rng.integers(0, n, n)
    long_lived = rng.random(n) < 0.1
    duration = np.where(long_lived, rng.integers(1, n // 4, n), rng.geometric(0.1, n))
    size = np.exp(rng.uniform(np.log(64), np.log(16 << 20), n)).astype(np.int64)
    return np.stack([size, start, start + duration], axis=1)


def csv_files(paths: list[str]) -> list[Path]:
    found = []
    for p in map(Path, paths or [DEFAULT_FILES]):
        found += sorted(p.glob("*.csv")) if p.is_dir() else [p]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="CSV files or folders of them")
    parser.add_argument("--time-budget", type=float, default=5.0, help="seconds of search per file")
    args = parser.parse_args()

    for seed in range(3):
        result = plan(random_blocks(10_000, seed))
        print(f"random 10,000 blocks (seed {seed}): {result.elapsed_s:.3f} s, ratio {result.ratio:.4f} "
              f"({result.heuristic})")

    print(f"\n| file | blocks | lower bound | best-fit by size | heuristics | search {args.time_budget:g} s |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in csv_files(args.paths):
        blocks, _ = read_csv(path)
        baseline = plan(blocks, alignment=1, heuristics=["size/best-fit"])
        heuristics = plan(blocks, alignment=1)
        searched = plan(blocks, alignment=1, time_budget_s=args.time_budget)
        proven = " (optimal)" if searched.optimal else ""
        print(f"| {path.name} | {len(blocks)} | {heuristics.lower_bound_bytes:,} | {baseline.ratio:.4f} | "
              f"{heuristics.ratio:.4f} ({heuristics.heuristic}) | {searched.ratio:.4f}{proven} |")


if __name__ == "__main__":
    main()
