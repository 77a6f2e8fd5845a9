"""What a checkpoint directory holds, read without a process group, and whether it fits a state dict.

Both checks run before a load reads anything, so a checkpoint that cannot be loaded whole changes nothing: not
the step's state and never the files, which are only read.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zerofx.errors import CheckpointError
from zerofx.state_dict import OPTIONAL_KEYS, flatten, global_shape


def read_metadata(checkpoint_dir: str) -> Metadata:
    """The checkpoint's metadata, after checking that every file it names is there and long enough."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"no checkpoint directory at {checkpoint_dir}")
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise CheckpointError(f"{checkpoint_dir} has no .metadata: its save did not finish, or it is not a "
                              "torch.distributed.checkpoint directory")
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(path for path in needed if not os.path.isfile(os.path.join(checkpoint_dir, path)))
    if missing:
        raise CheckpointError(f"{checkpoint_dir} is incomplete: {', '.join(missing)} missing (each rank writes "
                              "its own file; a rank's save did not finish or its file was lost)")
    short = sorted(f"{path} ({os.path.getsize(os.path.join(checkpoint_dir, path))} of {size} bytes)"
                   for path, size in needed.items() if os.path.getsize(os.path.join(checkpoint_dir, path)) < size)
    if short:
        raise CheckpointError(f"{checkpoint_dir} is incomplete: truncated {', '.join(short)}")
    return metadata


def check_fits(metadata: Metadata, state: dict, checkpoint_dir: str, strict: bool = True) -> list[str]:
    """Raise ``CheckpointError`` naming every key of ``state`` the checkpoint lacks, every key it has beyond
    ``state`` (if ``strict``), every tensor whose shape differs. Returns the optional keys it lacks."""
    saved = metadata.state_dict_metadata
    wanted = flatten(state)
    missing = sorted(k for k in wanted if k not in saved)
    absent_optional = [k for k in missing if k.startswith(OPTIONAL_KEYS)]
    missing = [k for k in missing if k not in absent_optional]
    unexpected = sorted(k for k in saved if k not in wanted and not k.startswith(OPTIONAL_KEYS)) if strict else []
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(_first(missing, 40))}")
    if unexpected:
        problems.append(f"in the checkpoint but not in this run: {', '.join(_first(unexpected, 40))}")
    for key, value in wanted.items():
        md = saved.get(key)
        if md is None or not isinstance(value, torch.Tensor):
            continue
        shape = global_shape(value)
        if not isinstance(md, TensorStorageMetadata):
            problems.append(f"{key}: a tensor of shape {shape} here, not a tensor in the checkpoint")
        elif tuple(md.size) != shape:
            problems.append(f"{key}: shape {tuple(md.size)} in the checkpoint, {shape} here")
    if problems:
        raise CheckpointError(f"{checkpoint_dir} does not fit this run:\n  " + "\n  ".join(_first(problems, 20)))
    return absent_optional


def _first(items: list[str], most: int) -> list[str]:
    """The first ``most`` items and how many more: a model's worth of keys would bury the error."""
    return items[:most] + ([f"... and {len(items) - most} more"] if len(items) > most else [])
