"""Save a compiled step's sharded state with ``torch.distributed.checkpoint`` and load it back, checked first."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from zerofx.checkpoint.files import check_fits, read_metadata
from zerofx.errors import CheckpointError
from zerofx.state_dict import load_state_dict, state_dict

STEP_KEYS = ("model", "optimizer", "loss_scale")


def save(step, checkpoint_dir: str | os.PathLike, extra: dict | None = None) -> None:
    """Write this rank's shards of ``step``'s state, and ``extra`` (an LR scheduler, the data position: anything
    with ``state_dict()`` / ``load_state_dict()``, or a dict of tensors and picklable values), to
    ``checkpoint_dir``. Every rank calls it; nothing is gathered."""
    with quiet_dcp_warnings():
        dcp.save(_payload(step, extra), checkpoint_id=os.fspath(checkpoint_dir), no_dist=_single_process())


def load(step, checkpoint_dir: str | os.PathLike, extra: dict | None = None, *, strict: bool = True) -> None:
    """Load ``checkpoint_dir`` into ``step`` (bound or run once) and ``extra``, at any world size and stage.

    Before reading anything, every rank checks that the checkpoint is complete and fits (keys, shapes; with
    ``strict``, no keys beyond this run's) and all ranks agree: each raises the same ``CheckpointError``, and the
    step's state is untouched. Every rank calls it."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    payload = _payload(step, extra)
    problem, absent = None, []
    try:
        target = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in payload.items()}
        absent = check_fits(read_metadata(checkpoint_dir), target, checkpoint_dir, strict)
    except CheckpointError as e:
        problem = str(e)
    problem = _agreed(problem)
    if problem is not None:
        raise CheckpointError(problem)
    if absent:  # the checkpoint has no loss scale: keep this run's
        del payload["loss_scale"]
    with quiet_dcp_warnings():
        dcp.load(payload, checkpoint_id=checkpoint_dir, no_dist=_single_process())
        load_state_dict(step, {k: payload[k] for k in STEP_KEYS if k in payload})


def _payload(step, extra: dict | None) -> dict:
    clash = sorted(set(extra or {}) & set(STEP_KEYS))
    if clash:
        raise ValueError(f"extra state may not use the names {clash}: the step's own state is saved under them")
    return {**state_dict(step), **(extra or {})}


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _agreed(problem: str | None) -> str | None:
    """The first rank's problem, on every rank, so that no rank enters the load while another has raised."""
    if _single_process() or dist.get_world_size() == 1:
        return problem
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None), None)


@contextlib.contextmanager
def quiet_dcp_warnings():
    """DCP warns that ShardedTensor is being deprecated each time it reads one's size, and that a load without a
    process group is a single-process one: zerofx builds ShardedTensors on purpose (a DTensor cannot hold a flat
    range of a multi-dimensional tensor) and chooses single-process loads itself, as its docs say."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield
