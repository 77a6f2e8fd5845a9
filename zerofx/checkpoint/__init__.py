"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP)::

    step = zerofx.compile(train_step, stage=3).bind(model, optimizer, *example_batch)
    zerofx.checkpoint.load(step, "ckpt/step-600", extra={"scheduler": scheduler})   # on resume, before training
    ...
    zerofx.checkpoint.save(step, "ckpt/step-1200", extra={"scheduler": scheduler})

Every tensor is saved under its fully qualified name and full shape, each rank writing only its shards, so a
checkpoint loads at any world size and stage, into FSDP2 (``get_state_dict`` layout) and from it. Offline,
``python -m zerofx.checkpoint consolidate CKPT_DIR OUT.pt`` writes the model's full state dict for
``model.load_state_dict(torch.load(OUT.pt))``.
"""

from zerofx.checkpoint.consolidate import consolidate
from zerofx.checkpoint.save_load import load, save
from zerofx.errors import CheckpointError

__all__ = ["save", "load", "consolidate", "CheckpointError"]
