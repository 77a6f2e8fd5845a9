"""Cases for the worker pool itself; test_dist_pool.py calls these."""

import os
import signal


def dies_once(rank, world_size, marker):
    """Rank 1 is killed by SIGSEGV the first time, as gloo's heap corruption kills a rank; the second run passes."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def returns_rank(rank, world_size):
    return rank
