"""``zerofx.backend(stage=...)``: a torch.compile backend that runs zerofx's passes on AOTAutograd's graphs.

Dynamo hands the backend each region it captured from the model's forward (one per graph break); AOTAutograd splits
it into a forward and a backward graph. Both are tagged as a captured step's nodes are (`aot_graphs`) and put
through the stage's pipeline, the same ``zerofx.passes.pipeline(stage)`` the whole-step path runs: a pass finds the
nodes it works on by their tags, so on a forward graph the gradient passes find no gradient and change nothing, and
on a backward graph ``broadcast_buffers`` finds no buffer. The graphs stay FX GraphModules (no Inductor); every
collective they issue is recorded for the `Prepared` model's ``stats()``.
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
from zerofx.backend.aot_graphs import tag_backward, tag_forward
from zerofx.backend.prepared import Prepared, owner_of
from zerofx.passes import PassContext, pipeline
from zerofx.step_graph import Role


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

        def compile_forward(fw: fx.GraphModule, _inputs):
            # the parameters a run reads are the ones its backward averages: a region compiled once may run for
            # several modules of one class (each block), with other parameters than those it was compiled with
            return self._compile(owner, f"{region}.forward", tag_forward(fw, slots),
                                 reads=lambda args: {owner.fqn_of(args[i]) for i in params})

        def compile_backward(bw: fx.GraphModule, _inputs):
            return self._compile(owner, f"{region}.backward", tag_backward(bw, slots))

        return aot_autograd(fw_compiler=compile_forward, bw_compiler=compile_backward)(gm, example_inputs)

    def _compile(self, owner: Prepared, name: str, gm: fx.GraphModule, reads=lambda args: frozenset()):
        ctx = PassContext(self.stage, owner.ranks.size, owner.ranks.group_name,
                          self.bucket_bytes or UNSHARDED_BUCKET_BYTES)
        dump_dir = self._dump_dir(name)
        if dump_dir:
            dump.write(dump_dir, 0, "aot", gm)

        def after_each(index: int, pass_name: str, graph: fx.GraphModule) -> None:
            if dump_dir:
                dump.write(dump_dir, index, pass_name, graph)

        gm = pipeline(self.stage).run(gm, ctx, after_each)
        owner.graphs[name] = gm
        run = make_boxed_func(gm)

        def recorded(args):
            read = reads(args)  # before the run: a boxed call clears ``args``
            with collectives.recording() as records:
                out = run(args)
            owner.record(records, read)
            return out

        recorded._boxed_call = True
        return recorded

    def _dump_dir(self, name: str) -> str | None:
        if not self.dump_dir or (dist.is_initialized() and dist.get_rank() != 0):
            return None  # the graphs are the same on every rank: rank 0 writes them
        return os.path.join(self.dump_dir, *name.split("."))


def backend(stage: int = 0, *, bucket_bytes: int | None = None, dump_dir: str | None = None) -> Backend:
    """A torch.compile backend: ``torch.compile(model, backend=zerofx.backend(stage=0))`` for a model and
    optimizer given to ``zerofx.prepare`` with the same stage. Forward and backward run through zerofx's passes for
    ``stage`` (gradients averaged in buckets of ``bucket_bytes``, DDP's 25 MiB by default); ``dump_dir`` (or
    ``ZEROFX_DUMP``) writes each region's forward and backward graph after each pass."""
    return Backend(stage, bucket_bytes, dump_dir or os.environ.get("ZEROFX_DUMP"))
