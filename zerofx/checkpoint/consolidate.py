"""One full state dict from a sharded checkpoint, on one process, without a process group."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerofx.checkpoint.files import read_metadata
from zerofx.checkpoint.save_load import quiet_dcp_warnings
from zerofx.errors import CheckpointError


def consolidate(checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> dict:
    """The model's full state dict (parameters in their master precision, fp32 under mixed precision, and
    buffers), for ``model.load_state_dict``; written with ``torch.save`` to ``out_path`` if given."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    metadata = read_metadata(checkpoint_dir)
    model = {key[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not model:
        raise CheckpointError(f"{checkpoint_dir} holds no model state (no key starts with 'model.')")
    with quiet_dcp_warnings():
        dcp.load({"model": model}, checkpoint_id=checkpoint_dir, no_dist=True)
    if out_path is not None:
        torch.save(model, os.fspath(out_path))
    return model
