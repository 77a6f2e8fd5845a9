"""A pool of gloo ranks that stays up across test cases: ``import torch`` and process-group set-up are paid once.

A case is a function ``case(rank, world_size, **kwargs)`` in a module importable by the workers; ``pool.run`` calls
it on every rank and returns the per-rank results, or raises with every failing rank's traceback. A case that does
not finish in time fails the test and the pool is rebuilt, so one hang cannot take the suite down; a rank that dies
mid-case restarts the pool and runs the case once more.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
import warnings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from zerofx.collectives import gloo_one_worker

    torch.set_num_threads(1)
    dist.init_process_group(gloo_one_worker(), rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
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


def _check_picklable(case, kwargs: dict) -> None:
    """A queue pickles what it sends in a thread of its own, where a failure is only printed and the ranks go on
    waiting for the task until the timeout: fail at once, naming the argument."""
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickle raises several types
            raise TypeError(f"{case.__name__}: argument {name!r} cannot be sent to the ranks: {e}") from None


class WorkerDied(RuntimeError):
    """A rank's process ended while running a case (killed by a signal: a crash, not a failed assertion)."""


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, case, timeout: float = 240.0, **kwargs) -> list:
        """Run ``case`` (a function defined in an importable module) on every rank; results by rank.

        The ranks' group is gloo with one worker thread (``zerofx.collectives.gloo_one_worker``), which avoids the
        heap corruption of torch 2.13's gloo with two. Should a rank's process still die mid-case, the pool is started
        again and the case runs once more, with a warning naming the rank and its exit code. A second death fails
        the test."""
        try:
            return self._run_once(case, timeout, kwargs)
        except WorkerDied as died:
            warnings.warn(f"{case.__name__}: {died}; pool restarted and the case run again", RuntimeWarning)
            self.close()
            self._start()
            return self._run_once(case, timeout, kwargs)

    def _run_once(self, case, timeout: float, kwargs: dict) -> list:
        _check_picklable(case, kwargs)
        for q in self.tasks:
            q.put((case.__module__, case.__name__, kwargs))
        by_rank, failures = {}, []
        deadline = time.monotonic() + timeout
        while len(by_rank) + len(failures) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    raise WorkerDied(", ".join(f"rank {r} exited with code {code}" for r, code in dead)) from None
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"{case.__name__} did not finish on every rank within {timeout}s") from None
                continue
            if ok:
                by_rank[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
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
