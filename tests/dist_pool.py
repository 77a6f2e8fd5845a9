"""A pool of gloo ranks that stays up across test cases: ``import torch`` and process-group set-up are paid once.

A case is a function ``case(rank, world_size, **kwargs)`` in a module importable by the workers; ``pool.run`` calls
it on every rank and returns the per-rank results, or raises with every failing rank's traceback. A case that does
not finish in time fails the test and the pool is rebuilt, so one hang cannot take the suite down.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(rank, world_size, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, case, timeout: float = 240.0, **kwargs) -> list:
        """Run ``case`` (a function defined in an importable module) on every rank; results by rank."""
        for q in self.tasks:
            q.put((case.__module__, case.__name__, kwargs))
        by_rank, failures = {}, []
        try:
            for _ in range(self.world_size):
                rank, ok, value = self.results.get(timeout=timeout)
                if ok:
                    by_rank[rank] = value
                else:
                    failures.append(f"--- rank {rank} ---\n{value}")
        except queue.Empty:
            self.close()
            raise TimeoutError(f"{case.__name__} did not finish on every rank within {timeout}s") from None
        if failures:
            raise AssertionError(f"{case.__name__} failed:\n" + "\n".join(sorted(failures)))
        return [by_rank[r] for r in range(self.world_size)]

    def close(self) -> None:
        self.broken = True
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
