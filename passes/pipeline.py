"""The passes each ZeRO stage runs, in order. ``print(pipeline(0))`` lists them."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from zerofx.passes.broadcast_buffers import broadcast_buffers
from zerofx.passes.bucket_allreduce import bucket_allreduce
from zerofx.passes.carry_rank_agreement import carry_rank_agreement
from zerofx.passes.cast_params_at_gather import cast_params_at_gather
from zerofx.passes.checkpoint_activations import checkpoint_activations
from zerofx.passes.offload_checkpoints import offload_checkpoints
from zerofx.passes.partition_checkpoints import partition_checkpoints
from zerofx.passes.plan_memory import plan_memory
from zerofx.passes.plan_scalars import plan_scalar_operands
from zerofx.passes.recompute_pointwise import recompute_pointwise
from zerofx.passes.context import PassContext
from zerofx.passes.fold_aliases import fold_aliases
from zerofx.passes.allgather_params import allgather_params
from zerofx.passes.gather_params import gather_params
from zerofx.passes.global_grad_norm import global_grad_norm
from zerofx.passes.propagate_shard_shapes import propagate_shard_shapes
from zerofx.passes.reduce_scatter_grads import reduce_scatter_grads
from zerofx.passes.remove_profiler_ops import remove_profiler_ops
from zerofx.passes.schedule_collectives import schedule_collectives
from zerofx.passes.shard_optimizer_state import shard_optimizer_state
from zerofx.passes.skip_nonfinite_update import skip_nonfinite_update
from zerofx.passes.split_incoming_grads import split_incoming_grads

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]

# every stage begins with these: the step as the user wrote it, its activations checkpointed, split, offloaded
_EVERY_STAGE: tuple[Pass, ...] = (remove_profiler_ops, checkpoint_activations, partition_checkpoints,
                                  offload_checkpoints, recompute_pointwise, skip_nonfinite_update, broadcast_buffers)

_STAGES: dict[int, tuple[Pass, ...]] = {
    0: (*_EVERY_STAGE, bucket_allreduce, fold_aliases, schedule_collectives, carry_rank_agreement,
        plan_scalar_operands, plan_memory),
    1: (*_EVERY_STAGE, split_incoming_grads, shard_optimizer_state, reduce_scatter_grads, global_grad_norm,
        allgather_params, propagate_shard_shapes, fold_aliases, schedule_collectives, plan_scalar_operands,
        plan_memory),
    2: (*_EVERY_STAGE, split_incoming_grads, shard_optimizer_state, reduce_scatter_grads, global_grad_norm,
        allgather_params, propagate_shard_shapes, fold_aliases, schedule_collectives, plan_scalar_operands,
        plan_memory),
    3: (*_EVERY_STAGE, split_incoming_grads, shard_optimizer_state, gather_params, cast_params_at_gather,
        reduce_scatter_grads, global_grad_norm, propagate_shard_shapes, fold_aliases, schedule_collectives,
        plan_scalar_operands, plan_memory),
}


@dataclass(frozen=True)
class Pipeline:
    stage: int
    passes: tuple[Pass, ...]

    def run(self, gm: fx.GraphModule, ctx: PassContext,
            after_each: Callable[[int, str, fx.GraphModule], None] | None = None) -> fx.GraphModule:
        """Apply the passes in order; ``after_each(index, name, gm)`` sees every intermediate graph (dumps)."""
        for i, p in enumerate(self.passes, start=1):
            gm = p(gm, ctx)
            if after_each is not None:
                after_each(i, p.__name__, gm)
        return gm

    def __str__(self) -> str:
        lines = [f"zerofx stage {self.stage} pipeline:"]
        for i, p in enumerate(self.passes, start=1):
            summary = (sys.modules[p.__module__].__doc__ or "").strip().splitlines()[0]
            lines.append(f"  {i}. {p.__name__:<22} {summary}")
        return "\n".join(lines)


def pipeline(stage: int, cast_at_gather: bool = True) -> Pipeline:
    """``cast_at_gather=False`` (``MixedPrecision``'s): stage 3 keeps its ``param_dtype`` shards and gathers them."""
    if stage not in _STAGES:
        raise ValueError(f"stage must be one of {sorted(_STAGES)}, got {stage!r}")
    return Pipeline(stage, tuple(p for p in _STAGES[stage] if cast_at_gather or p is not cast_params_at_gather))
