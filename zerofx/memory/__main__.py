"""Command line: ``python -m zerofx.memory plan FILE.csv [--alignment 1] [--out SOLUTION.csv] [--time-budget S]``.

Plans the blocks of a CSV file (``id,lower,upper,size``) and prints the arena, the lower bound, their ratio and the
time taken; ``--out`` writes the blocks again with their offsets. Sizes in such files are usually exact, so the
alignment defaults to 1.
"""

from __future__ import annotations

import argparse

from zerofx.memory.csvfile import read_csv, write_csv
from zerofx.memory.planner import plan


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerofx.memory")
    commands = parser.add_subparsers(dest="command", required=True)
    planning = commands.add_parser("plan", help="offsets for the blocks of a CSV file")
    planning.add_argument("file")
    planning.add_argument("--alignment", type=int, default=1)
    planning.add_argument("--out", help="write the blocks with an offset column here")
    planning.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                          help="seconds a search may spend improving on the heuristics")
    args = parser.parse_args(argv)
    blocks, _ = read_csv(args.file)
    result = plan(blocks, alignment=args.alignment, time_budget_s=args.time_budget)
    print(f"blocks: {len(blocks)}")
    print(f"arena_bytes: {result.arena_bytes}")
    print(f"lower_bound_bytes: {result.lower_bound_bytes}")
    print(f"ratio: {result.ratio:.4f}")
    print(f"heuristic: {result.heuristic}{' (optimal)' if result.optimal else ''}")
    print(f"seconds: {result.elapsed_s:.3f}")
    if args.out:
        write_csv(args.out, blocks, result.offsets)


if __name__ == "__main__":
    main()
