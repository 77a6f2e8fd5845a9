"""The worker pool: a rank killed mid-case restarts the pool and runs the case once more; a second death fails."""

import pytest

import cases_pool
from dist_pool import WorkerDied, WorkerPool


def test_a_rank_killed_once_restarts_the_pool_and_runs_the_case_again(tmp_path):
    pool = WorkerPool(2)
    try:
        with pytest.warns(RuntimeWarning, match=r"dies_once: rank 1 exited with code -11"):
            assert pool.run(cases_pool.dies_once, marker=str(tmp_path / "died")) == [0, 1]
    finally:
        pool.close()


def test_a_rank_killed_twice_fails(tmp_path, monkeypatch):
    pool = WorkerPool(2)
    monkeypatch.setattr(pool, "_start", lambda: WorkerPool._start(pool) or (tmp_path / "died").unlink())
    try:
        with pytest.warns(RuntimeWarning), pytest.raises(WorkerDied, match="rank 1 exited with code -11"):
            pool.run(cases_pool.dies_once, marker=str(tmp_path / "died"))
    finally:
        pool.close()
