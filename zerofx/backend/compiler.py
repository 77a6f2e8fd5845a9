"""``zerofx.backend(stage=...)``: a torch.compile backend that runs zerofx's passes on AOTAutograd's graphs.

Dynamo hands the backend each region it captured from the model's forward (one per graph break); AOTAutograd splits
it into a forward and a backward graph. Both are tagged as a captured step's nodes are (`aot_graphs`) and put
through the stage's pipeline, the same ``zerofx.passes.pipeline(stage)`` the whole-step path runs, less the passes
that edit the optimizer's update (`UPDATE_PASSES`): ``optimizer.step()`` runs eagerly, outside these graphs, on the
shards `zerofx.backend.shards` gives it. A pass finds the nodes it works on by their tags, so on a forward graph the
gradient passes find no gradient and change nothing, and on a backward graph ``broadcast_buffers`` finds no buffer.
From stage 1 on the backward's gradients leave it as this rank's shards, which go to the optimizer's shards rather
than to autograd (which would refuse their shape); at stage 3 each graph runs on the parameters' shards. The graphs
stay FX GraphModules (no Inductor); every collective they issue is recorded for the `Prepared` model's ``stats()``.
"""

from __future__ import annotations

import itertools
import os

import torch.distributed as dist
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from zerofx import collectives, dump
from zerofx.api import UNSHARDED_BUCKET_BYTES
from zerofx.backend.aot_graphs import (hand_shards_to_backward, hold_shards, partition_recomputing_param_views,
                                       recompute_views_where_read, tag_backward, tag_forward)
from zerofx.backend.prepared import Prepared, owner_of
from zerofx.passes import PassContext, Pipeline, allgather_params, pipeline, shard_optimizer_state
from zerofx.step_graph import Role

# The passes that edit the optimizer's update, which AOTAutograd's graphs do not hold: ``shard_optimizer_state``'s
# work on the state is done once by ``zerofx.prepare`` (`zerofx.backend.shards`), ``allgather_params`` runs on a graph
# of the eager update after each ``optimizer.step()`` (`zerofx.backend.update_graph`).
UPDATE_PASSES = (shard_optimizer_state, allgather_params)


def graph_pipeline(stage: int) -> Pipeline:
    """The passes the backend runs on a forward or backward graph: the stage's pipeline without `UPDATE_PASSES`."""
    return Pipeline(stage, tuple(p for p in pipeline(stage).passes if p not in UPDATE_PASSES))


class Backend:
    """What ``zerofx.backend`` returns; torch.compile calls it once per captured region."""

    def __init__(self, stage: int, bucket_bytes: int | None, dump_dir: str | None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zerofx.backend: stage must be 0, 1, 2 or 3, got {stage!r}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"zerofx.backend: bucket_bytes must be positive, got {bucket_bytes}")
        self.stage, self.bucket_bytes, self.dump_dir = stage, bucket_bytes, dump_dir
        self._regions = itertools.count()

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        owner = owner_of(example_inputs)
        if owner is None:  # no parameter in this region: nothing to communicate
            return gm.forward
        if owner.config.stage != self.stage:
            raise ValueError(f"zerofx.backend(stage={self.stage}) compiles a model prepared for stage "
                             f"{owner.config.stage}; give both the same stage")
        slots = [owner.slot_of(x) for x in example_inputs]
        region = f"region{next(self._regions)}"
        params = [i for i, slot in enumerate(slots) if slot is not None and slot.role == Role.PARAM]
        sharded = [i for i in params if slots[i].fqn in owner.layouts and self.stage >= 3]  # run on shards
        compiled_for = {slots[i].fqn for i in params}
        artifacts, saved_params = {}, {}  # what forward's passes planned, for backward's; forward's shards by name

        def reads(args) -> set[str]:
            read = {owner.fqn_of(args[i]) for i in params}
            if self.stage >= 1 and read != compiled_for:
                raise NotImplementedError(
                    f"zerofx.backend: a region compiled for parameters {sorted(compiled_for)} runs for "
                    f"{sorted(read)} (one graph serving several modules of a class); from stage 1 on its backward "
                    "could not tell whose gradient shards it computes. Compile the whole model, or use stage 0")
            return read

        def compile_forward(fw: fx.GraphModule, _inputs):
            fw = tag_forward(fw, slots)
            handed = {}
            if self.stage >= 3:
                saved_params.update(hold_shards(fw, owner.layouts))
                handed = hand_shards_to_backward(fw, saved_params)
            run = self._compile(owner, f"{region}.forward", fw, artifacts)

            def forward(args):
                # the parameters a run reads are the ones its backward averages: a region compiled once may run for
                # several modules of one class (each block), with other parameters than those it was compiled with
                read = reads(args)
                for i in sharded:
                    args[i] = owner.shards.graph_input(owner.fqn_of(args[i]))
                shards = {i: args[i] for i in handed.values()}  # before the run: a boxed call clears ``args``
                out = self._recorded(owner, run, args, read)
                for out_index, in_index in handed.items():
                    out[out_index] = shards[in_index]
                return out

            return _boxed(forward)

        def compile_backward(bw: fx.GraphModule, _inputs):
            bw = tag_backward(bw, slots, saved_params)
            if self.stage >= 3:
                recompute_views_where_read(bw, hold_shards(bw, owner.layouts))
            run = self._compile(owner, f"{region}.backward", bw, dict(artifacts))

            def backward(args):
                out = self._recorded(owner, run, args)
                for i in params:  # from stage 1 on, gradient shards go to the optimizer's shards, not to autograd
                    if slots[i].fqn in owner.layouts and out[i] is not None:
                        owner.shards.receive_grad(slots[i].fqn, out[i])
                        out[i] = None
                return out

            return _boxed(backward)

        partition = {"partition_fn": partition_recomputing_param_views(sharded)} if sharded else {}
        return aot_autograd(fw_compiler=compile_forward, bw_compiler=compile_backward, **partition)(gm, example_inputs)

    def _compile(self, owner: Prepared, name: str, gm: fx.GraphModule, artifacts: dict):
        """``gm`` through the stage's passes, as a boxed function; ``artifacts``: what an earlier graph of the
        region planned (forward's gathers for backward), updated with what this one plans."""
        units = owner.units if self.bucket_bytes is None else None
        ctx = PassContext(self.stage, owner.ranks.size, owner.ranks.group_name,
                          self.bucket_bytes or UNSHARDED_BUCKET_BYTES, units=units,
                          artifacts={**artifacts, "layouts": owner.layouts})
        owner.bucket_bytes = self.bucket_bytes
        dump_dir = self._dump_dir(name)
        if dump_dir:
            dump.write(dump_dir, 0, "aot", gm)

        def after_each(index: int, pass_name: str, graph: fx.GraphModule) -> None:
            if dump_dir:
                dump.write(dump_dir, index, pass_name, graph)

        gm = graph_pipeline(self.stage).run(gm, ctx, after_each)
        artifacts.update(ctx.artifacts)
        owner.graphs[name] = gm
        return make_boxed_func(gm)

    @staticmethod
    def _recorded(owner: Prepared, run, args: list, read: set[str] = frozenset()) -> list:
        with collectives.recording() as records:
            out = list(run(args))
        owner.record(records, read)
        return out

    def _dump_dir(self, name: str) -> str | None:
        if not self.dump_dir or (dist.is_initialized() and dist.get_rank() != 0):
            return None  # the graphs are the same on every rank: rank 0 writes them
        return os.path.join(self.dump_dir, *name.split("."))


def _boxed(fn):
    """``fn`` called as AOTAutograd calls a compiled graph: with its arguments in one list, which it may clear."""
    fn._boxed_call = True
    return fn


def backend(stage: int = 0, *, bucket_bytes: int | None = None, dump_dir: str | None = None) -> Backend:
    """A torch.compile backend: ``torch.compile(model, backend=zerofx.backend(stage=0))`` for a model and
    optimizer given to ``zerofx.prepare`` with the same stage. Forward and backward run through zerofx's passes for
    ``stage`` (gradients averaged in buckets of ``bucket_bytes``, DDP's 25 MiB by default); ``dump_dir`` (or
    ``ZEROFX_DUMP``) writes each region's forward and backward graph after each pass."""
    return Backend(stage, bucket_bytes, dump_dir or os.environ.get("ZEROFX_DUMP"))
