import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # peers.measure: CommDebugMode with each collective's size
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_pool import WorkerPool  # noqa: E402

_pools: dict[int, WorkerPool] = {}


def _pool(world_size: int) -> WorkerPool:
    pool = _pools.get(world_size)
    if pool is None or pool.broken:
        pool = _pools[world_size] = WorkerPool(world_size)
    return pool


@pytest.fixture
def ranks2() -> WorkerPool:
    return _pool(2)


@pytest.fixture
def ranks4() -> WorkerPool:
    return _pool(4)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
