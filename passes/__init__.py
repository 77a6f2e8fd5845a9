"""zerofx.passes: graph passes over a captured training step, one concern per module.

Every pass is ``(GraphModule, PassContext) -> GraphModule`` and states in its docstring what it expects and what it
guarantees. Contents, in pipeline order:

- ``remove_profiler_ops``: drop torch.optim's record_function markers.
- ``broadcast_buffers``: rank 0's buffers broadcast before forward (DDP's default).
- ``bucket_allreduce``: stage 0, bucketed gradient all-reduce as gradients become ready.

``pipeline(stage)`` lists the passes a stage runs and prints itself.
"""

from zerofx.passes.broadcast_buffers import broadcast_buffers
from zerofx.passes.bucket_allreduce import bucket_allreduce
from zerofx.passes.context import PassContext
from zerofx.passes.pipeline import Pipeline, pipeline
from zerofx.passes.remove_profiler_ops import remove_profiler_ops

__all__ = ["PassContext", "Pipeline", "pipeline", "broadcast_buffers", "bucket_allreduce", "remove_profiler_ops"]
