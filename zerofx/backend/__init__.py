"""zerofx as a torch.compile backend: the model and optimizer stay the user's, ``loss.backward()`` and
``optimizer.step()`` stay where they are, and the forward and backward graphs AOTAutograd produces run through the
same passes as a whole captured step.

    model, optimizer = zerofx.prepare(model, optimizer, stage=3)     # any of stages 0-3
    model = torch.compile(model, backend=zerofx.backend(stage=3))
"""

from zerofx.backend.clipping import clip_grad_norm_
from zerofx.backend.compiler import Backend, backend
from zerofx.backend.prepared import Prepared, prepare, prepared

__all__ = ["Backend", "backend", "clip_grad_norm_", "Prepared", "prepare", "prepared"]
