"""zerofx: ZeRO (the Zero Redundancy Optimizer) as compiler passes over a traced PyTorch training step.

    step = zerofx.compile(train_step, stage=0)
    loss = step(model, optimizer, x, y)

or as a torch.compile backend, training eagerly as before:

    model, optimizer = zerofx.prepare(model, optimizer, stage=0)
    model = torch.compile(model, backend=zerofx.backend(stage=0))
"""

from zerofx import checkpoint, passes
from zerofx.api import CompiledStep, Config, compile
from zerofx.backend import backend, clip_grad_norm_, prepare, prepared
from zerofx.collectives import CollectiveRecord
from zerofx.errors import CaptureError, CheckpointError, RankMismatchError
from zerofx.memory import LiveStorageTracker
from zerofx.mixed_precision import LossScaling, MixedPrecision
from zerofx.planning import plan
from zerofx.report import report
from zerofx.state_dict import full_state_dict, load_state_dict, state_dict
from zerofx.stats import StepStats

__all__ = [
    "compile", "CompiledStep", "Config", "MixedPrecision", "LossScaling", "CaptureError", "CheckpointError",
    "RankMismatchError",
    "state_dict", "load_state_dict", "full_state_dict", "checkpoint", "StepStats", "CollectiveRecord",
    "LiveStorageTracker", "plan", "report", "passes", "backend", "prepare", "prepared", "clip_grad_norm_",
]
