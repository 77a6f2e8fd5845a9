"""zerofx stage 0 beside DDP, step by step: the benchmark GPT, gloo ranks on CPU, each system in its own processes.

    .venv/bin/python benchmarks/compare_peers.py ...      # the whole table, all systems in one process per rank
    .venv/bin/python benchmarks/stage0_pairs.py --world 2 --variant "" --variant "recompute_pointwise=False"

Each system (DDP, and one zerofx-0 step per ``--variant``: keyword arguments of ``zerofx.compile``, "" for the
defaults) runs in a world of ``--world`` processes of its own, as its users run it, so that no system allocates from
a heap another one left behind. The worlds take turns, one step at a time on the same batch, in an order that rotates
every round, while the others wait idle; a drift of the machine's speed thus reaches all of them alike. Printed per
system: the median step time (the slowest rank's), the median of the per-batch ratios to DDP's step, the median and
range over rounds of the ratio of round medians (what ``compare_peers.py`` reports), and the mean page faults per
step on rank 0 (first touches of memory the process got back from the system: on this machine's virtual CPU each
costs microseconds). Each system goes first equally often when ``--rounds`` is a multiple of the number of systems.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing import connection

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
DDP = "DDP"


def _options(variant: str) -> dict:
    return eval(f"dict({variant})", {"torch": torch})  # noqa: S307: the command line of whoever runs it


def _build(variant: str | None, cfg: GPTConfig):
    """DDP for ``None``, else zerofx-0 with the ``zerofx.compile`` keywords ``variant``."""
    if variant is None:
        return systems.ddp_system(cfg)
    return systems.zerofx_system(cfg, 0, False, **_options(variant))


def worker(variant: str | None, rank: int, world: int, rendezvous: str, text: str, commands, done) -> None:
    """One rank of one system's world: warm up, then run one timed step per batch index received, until None."""
    faulthandler.enable()  # a rank that crashes says where
    torch.set_num_threads(1)
    # a file per world, not a port: a port chosen free here could be taken before this world's rank 0 binds it
    dist.init_process_group(zerofx.collectives.gloo_one_worker(), init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    cfg = GPTConfig(vocab_size=len(set(text)), block_size=64, n_layer=4, n_head=4, n_embd=128)
    batch = _batches(cfg, 8, rank, text)
    system = _build(variant, cfg)
    for index in range(WARMUP):
        system.step(*batch(index)).item()
    done.put((rank, None))
    seconds, faults = [], 0
    while (index := commands.get()) is not None:
        x, y = batch(WARMUP + index)
        dist.barrier()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        system.step(x, y).item()
        seconds.append(time.perf_counter() - start)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        done.put((rank, None))
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    done.put((rank, (slowest.tolist(), faults / len(seconds)) if rank == 0 else None))
    done.close()
    done.join_thread()  # delivered before leaving the group: gloo's teardown can hang holding the interpreter's lock
    dist.destroy_process_group()


class World:
    """The processes of one system, and the queues through which they are told to step."""

    def __init__(self, ctx, name: str, variant: str | None, size: int, text: str, rendezvous: str):
        self.name = name
        self.done = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(size)]
        self.procs = [ctx.Process(target=worker, args=(variant, r, size, rendezvous, text, self.commands[r], self.done),
                                  daemon=True) for r in range(size)]
        for p in self.procs:
            p.start()

    def wait(self) -> list:
        """One message from every rank; a rank that ended without sending it stops the benchmark instead of leaving
        it waiting (a process's sentinel, unlike its exit code, says it has ended even once something else reaped
        it; what it sent before ending is read first)."""
        got: dict[int, object] = {}
        missing_after_end = set()
        while len(got) < len(self.procs):
            try:
                rank, message = self.done.get(timeout=5)
                got[rank] = message
            except queue.Empty:
                ended = {r for r, p in enumerate(self.procs) if r not in got and connection.wait([p.sentinel], 0)}
                if ended & missing_after_end:
                    rank = min(ended & missing_after_end)  # a negative exit code is the signal that ended it
                    raise RuntimeError(f"{self.name}: rank {rank} ended during the benchmark, exit code "
                                       f"{self.procs[rank].exitcode}") from None
                missing_after_end = ended
        return [got[r] for r in range(len(self.procs))]

    def step(self, index: int) -> None:
        for q in self.commands:
            q.put(index)
        self.wait()

    def finish(self) -> tuple[list[float], float]:
        for q in self.commands:
            q.put(None)
        measured = self.wait()[0]
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()  # a rank stuck leaving the process group has already delivered its figures
        return measured


def report(measured: dict, rounds: int, steps: int) -> None:
    ddp = measured[DDP][0]
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
    variants = {DDP: None} | {f"zerofx-0 {v or 'defaults'}": v for v in args.variant or [""]}
    if len(variants) < 1 + len(args.variant or [""]):
        parser.error("each --variant may be given once")
    names = list(variants)
    text = open(os.path.join(ROOT, "examples", "data", "zero.txt")).read()
    ctx = mp.get_context("spawn")
    rendezvous = tempfile.mkdtemp(prefix="stage0_pairs")
    worlds = {name: World(ctx, name, variant, args.world, text, os.path.join(rendezvous, str(i)))
              for i, (name, variant) in enumerate(variants.items())}
    for w in worlds.values():
        w.wait()
    index = 0
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for _ in range(args.steps):
            for name in order:
                worlds[name].step(index)
            index += 1
    measured = {name: w.finish() for name, w in worlds.items()}
    shutil.rmtree(rendezvous, ignore_errors=True)
    print(f"{args.world} ranks per system, {args.rounds} rounds of {args.steps} batches, one thread per rank")
    report(measured, args.rounds, args.steps)


if __name__ == "__main__":
    main()
