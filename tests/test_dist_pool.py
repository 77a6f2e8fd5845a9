"""The worker pool: a rank killed mid-case restarts the pool and runs the case once more; a second death fails."""

import pytest

import cases_pool
from dist_pool import WorkerDied, WorkerPool


def test_a_rank_killed_once_restarts_the_pool_and_a_rank_killed_twice_fails(tmp_path, monkeypatch):
    pool = WorkerPool(2)
    try:
        with pytest.warns(RuntimeWarning, match=r"dies_once: rank 1 exited with code -11"):
            assert pool.run(cases_pool.dies_once, marker=str(tmp_path / "died")) == [0, 1]
        (tmp_path / "died").unlink()
        # every restart forgets the first death, so the case dies again on the run after it
        monkeypatch.setattr(pool, "_start", lambda: WorkerPool._start(pool) or (tmp_path / "died").unlink())
        with pytest.warns(RuntimeWarning), pytest.raises(WorkerDied, match="rank 1 exited with code -11"):
            pool.run(cases_pool.dies_once, marker=str(tmp_path / "died"))
    finally:
        pool.close()


def test_an_argument_the_ranks_cannot_receive_fails_at_once_naming_it(ranks2):
    with pytest.raises(TypeError, match="argument 'marker' cannot be sent"):
        ranks2.run(cases_pool.dies_once, timeout=5.0, marker=lambda: "a lambda does not pickle")
    assert ranks2.run(cases_pool.returns_rank) == [0, 1]  # the pool still serves the next case
