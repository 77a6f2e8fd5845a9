"""zerofx.passes: graph passes over a captured training step, one concern per module.

Every pass is ``(GraphModule, PassContext) -> GraphModule`` and states in its docstring what it expects and what it
guarantees. Contents, in pipeline order:

- ``remove_profiler_ops``: drop torch.optim's record_function markers.
- ``checkpoint_activations``: checkpointed regions keep their inputs; backward recomputes the rest (ZeRO-R).
- ``partition_checkpoints``: a saved input the tensor-parallel ranks hold alike is kept as a 1/tp slice (P_a).
- ``offload_checkpoints``: the checkpointed regions' saved inputs wait in host memory (P_a+cpu).
- ``recompute_pointwise``: backward recomputes cheap pointwise outputs from inputs it keeps anyway.
- ``skip_nonfinite_update``: float16 loss scaling, ranks agree on overflow and such a step changes nothing.
- ``broadcast_buffers``: rank 0's buffers broadcast before forward (DDP's default).
- ``bucket_allreduce``: stage 0, bucketed gradient all-reduce as gradients become ready.
- ``split_incoming_grads``: stages 1-3, backward computes this call's own gradient; a shard an earlier call kept is
  added to its reduced shard (an update every k-th call).
- ``shard_optimizer_state``: stages 1-3, the optimizer updates this rank's shards (P_os).
- ``gather_params``: stage 3, gather parameter units before forward and backward read them (P_p), with prefetch.
- ``cast_params_at_gather``: stage 3 under mixed precision, gather casts of the fp32 master shards; no low-precision
  shard is kept (left out of the pipeline with ``MixedPrecision(cast_at_gather=False)``).
- ``reduce_scatter_grads``: stages 1-3, gradient shards by bucketed reduce-scatter (after backward at stage 1,
  as buckets become ready at stages 2-3: P_g).
- ``global_grad_norm``: stages 1-3, a gradient norm over shards (clip_grad_norm_) made global by one scalar
  all-reduce.
- ``allgather_params``: stages 1-2, gather the updated parameters after the optimizer.
- ``propagate_shard_shapes``: stages 1-3, shapes on shards; refuses an update that is not elementwise.
- ``fold_aliases``: drop aliases that compute nothing (``detach``, a transpose of a transpose).
- ``schedule_collectives``: collectives in flight moved off the step's busiest moments.
- ``carry_rank_agreement``: stage 0, the per-step rank agreement rides on the first bucket's all-reduce.
- ``plan_scalar_operands``: ``memory_plan``, numbers fp32 arithmetic takes as tensors become 0-dim tensors the graph
  keeps (M_D).
- ``plan_memory``: ``memory_plan``, intermediate buffers become views into one arena planned from lifetimes (M_D).

Shared builders: ``bucketing`` (bucket plans of constant size), ``flat_collectives`` (pack, collective, unpack),
``graph_edit`` (adding nodes with metadata, the checkpoints a recompute reads).

``pipeline(stage)`` lists the passes a stage runs and prints itself.
"""

from zerofx.passes.allgather_params import allgather_params
from zerofx.passes.broadcast_buffers import broadcast_buffers
from zerofx.passes.bucket_allreduce import bucket_allreduce
from zerofx.passes.carry_rank_agreement import carry_rank_agreement
from zerofx.passes.cast_params_at_gather import cast_params_at_gather
from zerofx.passes.checkpoint_activations import checkpoint_activations
from zerofx.passes.context import PassContext
from zerofx.passes.pipeline import Pipeline, pipeline
from zerofx.passes.gather_params import gather_params
from zerofx.passes.global_grad_norm import global_grad_norm
from zerofx.passes.propagate_shard_shapes import propagate_shard_shapes
from zerofx.passes.offload_checkpoints import offload_checkpoints
from zerofx.passes.partition_checkpoints import partition_checkpoints
from zerofx.passes.recompute_pointwise import recompute_pointwise
from zerofx.passes.reduce_scatter_grads import reduce_scatter_grads
from zerofx.passes.remove_profiler_ops import remove_profiler_ops
from zerofx.passes.shard_optimizer_state import shard_optimizer_state
from zerofx.passes.skip_nonfinite_update import skip_nonfinite_update
from zerofx.passes.split_incoming_grads import split_incoming_grads

__all__ = ["PassContext", "Pipeline", "pipeline", "allgather_params", "broadcast_buffers", "bucket_allreduce",
           "carry_rank_agreement", "cast_params_at_gather", "checkpoint_activations", "gather_params", "global_grad_norm",
           "offload_checkpoints", "partition_checkpoints", "propagate_shard_shapes", "recompute_pointwise",
           "reduce_scatter_grads", "remove_profiler_ops", "shard_optimizer_state", "skip_nonfinite_update",
           "split_incoming_grads"]
