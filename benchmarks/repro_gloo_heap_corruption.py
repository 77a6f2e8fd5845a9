"""Heap corruption in PyTorch's gloo backend, with torch alone: ``malloc(): unaligned tcache chunk detected``.

    python benchmarks/repro_gloo_heap_corruption.py                     # 4 ranks, 4000 iterations, rare aborts
    python benchmarks/repro_gloo_heap_corruption.py --gloo-threads 1    # gloo with one worker thread: none
    python benchmarks/repro_gloo_heap_corruption.py --world-size 2 --iterations 200 --gdb-pause   # aborts in seconds

Each iteration issues the collectives of one ZeRO stage-3 step and of a checkpoint save, as zerofx does, but with
the functional collectives (``torch.ops._c10d_functional``) called directly: an all-gather per parameter bucket with
the next one already in flight, a reduce-scatter per bucket all waited at the end, then the synchronous object
collectives ``torch.distributed.checkpoint`` uses. Every buffer stays referenced until its wait returns.

The cause, in torch 2.13.0: gloo runs asynchronous collectives on worker threads (two unless told otherwise). After
finishing one, a worker records it in the group's status with no lock held (``ProcessGroupGloo::runLoop``, between
``AsyncWork::execute(work)`` and ``lock.lock()``: ``pgStatus_->lastCompletedWorkName =
opTypeToString(work->opType_)``). The functional all-gather is ``all_gather_into_tensor_coalesced`` underneath, an
``ALLGATHER_COALESCED`` work, a name longer than ``std::string``'s 15-character inline buffer. When two collectives
finish together, both workers read the same heap buffer and both free it; freed from two threads' caches, glibc's
double-free check misses it, and the chunk is later handed out twice. ``--gloo-threads 1`` builds the group with one
worker (``zerofx.collectives.gloo_one_worker`` does the same for zerofx users). ``--gdb-pause`` attaches gdb to rank
0 with ``benchmarks/gloo_race_gdb.py``, which pauses each of its gloo workers for 2 ms right after it read that
buffer's address, as a preemption would, while the other worker runs on.

Measured with torch 2.13.0 (CPU wheel, glibc 2.36, a loaded 2-core machine):

- ``--world-size 2 --iterations 200 --gdb-pause``: with two workers, 5 of 5 runs aborted (``malloc(): unaligned
  fastbin chunk detected`` or SIGSEGV) after 6 to 24 pauses; with ``--gloo-threads 1``, 3 of 3 runs finished (7,815
  to 7,937 pauses each); with two workers paused just after the update (``GLOO_RACE_AT="*('c10d::ProcessGroupGloo::
  runLoop(int)'+606)"``), 1 of 1 finished (7,601 pauses).
- 4 ranks, no gdb, ``MALLOC_PERTURB_=165``: with two workers, 3 of 5 runs aborted (within 3,000 iterations; after
  753 s of a run of 6,000; in iteration 928 of 3,000, after 136 s, ``malloc(): unaligned tcache chunk detected``) and
  two ran to the end (4,000 iterations; 3,000 in 422 s); with ``--gloo-threads 1``, 4,000 iterations (1,141 s)
  without an abort.

The ``--no-...`` switches leave parts out; each such run of 4,000 iterations (two workers, no gdb) had no abort,
which at this rate says little. Exit status 0 when every rank finished.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

functional = torch.ops._c10d_functional
BUCKETS = [488, 136, 675, 272, 900, 30, 900, 24, 675, 272, 900, 30, 900, 24]  # shard elements, a small GPT's


def gather_buckets(rank: int, world: int, group: str, prefetch: bool) -> None:
    pending = None
    for n in BUCKETS:
        send = torch.full((n,), float(rank))
        issued = (functional.all_gather_into_tensor(send, world, group), send)
        if not prefetch:
            functional.wait_tensor(issued[0])
            continue
        if pending is not None:
            functional.wait_tensor(pending[0])
        pending = issued
    if pending is not None:
        functional.wait_tensor(pending[0])


def reduce_scatter_buckets(world: int, group: str) -> None:
    issued = []
    for n in BUCKETS:
        packed = torch.ones(n * world) / world
        issued.append((functional.reduce_scatter_tensor(packed, "sum", world, group), packed))
    for out, _ in reversed(issued):
        functional.wait_tensor(out)


def object_collectives(rank: int, world: int, i: int) -> None:
    every = torch.empty(world, dtype=torch.int64)
    dist.all_gather_single(every, torch.tensor([i], dtype=torch.int64))
    plans = [None] * world
    dist.all_gather_object(plans, {"rank": rank, "items": list(range(20))})
    dist.gather_object({"rank": rank}, [None] * world if rank == 0 else None, dst=0)
    mine = [None]
    dist.scatter_object_list(mine, [{"rank": r} for r in range(world)] if rank == 0 else None, src=0)
    dist.broadcast_object_list([{"step": i}], src=0)
    dist.all_reduce(torch.ones(1))
    dist.barrier()


def gloo_with_threads(threads: int):
    """A backend creator: gloo as ``init_process_group("gloo")`` builds it, but with ``threads`` worker threads
    (torch's default is 2; ``init_process_group`` takes no gloo options)."""

    def create(store, rank, size, timeout):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._threads = threads
        return dist.ProcessGroupGloo(store, rank, size, options)

    return create


def rank_main(rank: int, world: int, port: int, args, done) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    backend = "gloo"
    if args.gloo_threads is not None:
        backend = "gloo_threads"
        dist.Backend.register_backend(backend, gloo_with_threads(args.gloo_threads), devices=["cpu"])
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD.group_name
    for i in range(args.iterations):
        if args.all_gather:
            gather_buckets(rank, world, group, args.prefetch)
        if args.reduce_scatter:
            reduce_scatter_buckets(world, group)
        if args.object_collectives:
            object_collectives(rank, world, i)
        done[rank] = i + 1
    dist.destroy_process_group()


def _report_debugger(debugger) -> None:
    if debugger is not None:
        out, _ = debugger.communicate(timeout=60)
        print("\n".join(line for line in out.splitlines() if line.startswith(("gdb:", "#"))), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=4000)
    parser.add_argument("--no-all-gather", dest="all_gather", action="store_false")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false", help="one all-gather in flight")
    parser.add_argument("--no-reduce-scatter", dest="reduce_scatter", action="store_false")
    parser.add_argument("--no-object-collectives", dest="object_collectives", action="store_false")
    parser.add_argument("--gloo-threads", type=int, help="gloo worker threads (torch's default: 2)")
    parser.add_argument("--gdb-pause", action="store_true",
                        help="attach gdb to rank 0 with benchmarks/gloo_race_gdb.py (pauses its gloo workers)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    done = mp.get_context("spawn").Array("l", args.world_size, lock=False)  # iterations each rank finished
    context = mp.start_processes(rank_main, args=(args.world_size, port, args, done), nprocs=args.world_size,
                                 join=False, start_method="spawn")
    debugger = None
    if args.gdb_pause:
        while done[0] == 0 and all(p.is_alive() for p in context.processes):
            time.sleep(0.1)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gloo_race_gdb.py")
        debugger = subprocess.Popen(["gdb", "-q", "-batch", "-iex", "set non-stop on", "-iex", "set confirm off",
                                     "-p", str(context.processes[0].pid), "-x", script],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        _report_debugger(debugger)
        how = signal.Signals(-e.exit_code).name if e.exit_code < 0 else f"exit {e.exit_code}"
        print(f"rank {e.error_index} failed ({how}) in iteration {done[e.error_index] + 1} "
              f"after {time.monotonic() - started:.0f}s", flush=True)
        return 1
    except mp.ProcessRaisedException as e:
        print(f"a rank raised after {time.monotonic() - started:.0f}s:\n{e}", flush=True)
        return 1
    _report_debugger(debugger)
    print(f"{args.iterations} iterations on {args.world_size} ranks, no failure "
          f"({time.monotonic() - started:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
