"""zerofx stage 0 beside DDP, step by step: the benchmark GPT, gloo ranks on CPU, steps interleaved one at a time.

    .venv/bin/python benchmarks/compare_peers.py ...      # the whole table, systems interleaved by rounds
    .venv/bin/python benchmarks/stage0_pairs.py --world 2 --variant "" --variant "recompute_pointwise=False"

Every rank builds DDP and one zerofx-0 step per ``--variant`` (keyword arguments of ``zerofx.compile``; "" is the
defaults) over the same model and data, then runs them in turn on each batch, one step each, so that a drift of the
machine's speed reaches all of them alike. Printed per system: the median step time (the slowest rank's), the median
of the per-batch ratios to DDP's step, the median and range over rounds of the ratio of round medians (what
``compare_peers.py`` reports), and the page faults per step on rank 0 (first touches of memory the process got back
from the system: on this machine's virtual CPU each costs microseconds).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "examples"), ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerofx  # noqa: E402
from nanogpt import GPTConfig  # noqa: E402
from peers import systems  # noqa: E402
from peers.run import _batches  # noqa: E402

WARMUP = 3


def _options(variant: str) -> dict:
    return eval(f"dict({variant})", {"torch": torch})  # noqa: S307: the command line of whoever runs it


def worker(rank: int, args, port: int, text: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(zerofx.collectives.gloo_one_worker(), rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=300))
    cfg = GPTConfig(vocab_size=len(set(text)), block_size=64, n_layer=4, n_head=4, n_embd=128)
    batch = _batches(cfg, 8, rank, text)
    steps = {"DDP": systems.ddp_system(cfg).step}
    for variant in args.variant:
        steps[f"zerofx-0 {variant or 'defaults'}"] = systems.zerofx_system(cfg, 0, False, **_options(variant)).step
    names = list(steps)
    index = 0
    for name in names:
        for _ in range(WARMUP):
            steps[name](*batch(index)).item()
            index += 1
    seconds = {name: [] for name in names}
    faults = dict.fromkeys(names, 0)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for _ in range(args.steps):
            x, y = batch(index)
            index += 1
            for name in order:
                dist.barrier()
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                steps[name](x, y).item()
                seconds[name].append(time.perf_counter() - start)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    slowest = torch.tensor([seconds[name] for name in names], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put({name: (slowest[i].tolist(), faults[name] / len(seconds[name])) for i, name in enumerate(names)})
    dist.barrier()
    dist.destroy_process_group()


def report(measured: dict, rounds: int, steps: int) -> None:
    ddp = measured["DDP"][0]
    print(f"{'system':52s} {'step ms':>8s} {'paired':>7s} {'rounds':>18s} {'faults':>8s}")
    for name, (times, faults) in measured.items():
        paired = statistics.median(a / b for a, b in zip(times, ddp))
        rounds_of = [slice(k * steps, (k + 1) * steps) for k in range(rounds)]
        by_round = [statistics.median(times[r]) / statistics.median(ddp[r]) for r in rounds_of]
        spread = f"{statistics.median(by_round):.3f} ({min(by_round):.2f}-{max(by_round):.2f})"
        print(f"{name:52s} {statistics.median(times) * 1e3:8.2f} {paired:7.3f} {spread:>18s} {faults:8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="batches per round")
    parser.add_argument("--variant", action="append", help='zerofx.compile keywords, e.g. "memory_plan=True"')
    args = parser.parse_args()
    args.variant = args.variant or [""]
    text = open(os.path.join(ROOT, "examples", "data", "zero.txt")).read()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, text, results)) for r in range(args.world)]
    for p in procs:
        p.start()
    measured = results.get(timeout=3600)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()  # a rank stuck leaving the process group has already delivered its figures
    print(f"{args.world} ranks, {args.rounds} rounds of {args.steps} batches, one thread per rank")
    report(measured, args.rounds, args.steps)


if __name__ == "__main__":
    main()
