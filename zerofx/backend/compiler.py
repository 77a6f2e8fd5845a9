"""``zerofx.backend(stage=...)``: a torch.compile backend that runs zerofx's passes on AOTAutograd's graphs.

Dynamo hands the backend each region it captured from the model's forward (one per graph break); AOTAutograd splits
it into a forward and a backward graph. Both are tagged as a captured step's nodes are (`aot_graphs`) and put
through the stage's pipeline, the same ``zerofx.passes.pipeline(stage)`` the whole-step path runs, less the passes
that edit the optimizer's update (`UPDATE_PASSES`): ``optimizer.step()`` runs eagerly, outside these graphs, on the
shards `zerofx.backend.shards` gives it. A pass finds the nodes it works on by their tags, so on a forward graph the
gradient passes find no gradient and change nothing, and on a backward graph ``broadcast_buffers`` finds no buffer.
From stage 1 on the backward's gradients leave it as this rank's shards, which go to the optimizer's shards rather
than to autograd (which would refuse their shape); at stage 3 each graph runs on the parameters' shards. Under mixed
precision the graphs compute in ``param_dtype`` and the gradients go to the fp32 master weights (`Shards`). The graphs
stay FX GraphModules (no Inductor); every collective they issue is recorded for the `Prepared` model's ``stats()``.
"""

from __future__ import annotations

import contextlib
import itertools
import os

import torch
import torch.distributed as dist
import torch.fx as fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from zerofx import collectives, dump, guards, ranks, runtime
from zerofx.api import UNSHARDED_BUCKET_BYTES
from zerofx.backend.aot_graphs import (add_master_inputs, graph_inputs, hand_shards_to_backward, hold_shards,
                                       partition_recomputing_param_views, recompute_views_where_read, tag_backward,
                                       tag_forward)
from zerofx.backend.prepared import Prepared, owner_of
from zerofx.fast_calls import fast_calls
from zerofx.mixed_precision import NormsWithStatistics
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
        owner.bucket_bytes = self.bucket_bytes  # stages 1-2 gather after the update in the same buckets
        region = _Region(self, owner, f"region{next(self._regions)}", example_inputs)
        partition = {"partition_fn": partition_recomputing_param_views(region.sharded)} if region.sharded else {}
        # AOTAutograd traces the region here, running its code: under mixed precision, norms see their statistics
        with NormsWithStatistics() if owner.config.mixed_precision else contextlib.nullcontext():
            return aot_autograd(fw_compiler=region.compile_forward, bw_compiler=region.compile_backward,
                                **partition)(gm, example_inputs)

    def compile_graph(self, owner: Prepared, name: str, gm: fx.GraphModule, artifacts: dict) -> fx.GraphModule:
        """``gm`` through the stage's passes; ``artifacts``: what an earlier graph of the region planned (forward's
        gathers, for backward), updated with what this one plans."""
        units = owner.units if self.bucket_bytes is None else None
        mixed = owner.config.mixed_precision
        ctx = PassContext(self.stage, owner.ranks.size, owner.ranks.group_name,
                          self.bucket_bytes or UNSHARDED_BUCKET_BYTES, units=units,
                          reduce_dtype=mixed.reduce_dtype if mixed else None,
                          artifacts={**artifacts, "layouts": owner.layouts})
        dump_dir = self._dump_dir(name)
        if dump_dir:
            dump.write(dump_dir, 0, "aot", gm)

        def after_each(index: int, pass_name: str, graph: fx.GraphModule) -> None:
            if dump_dir:
                dump.write(dump_dir, index, pass_name, graph)

        gm = graph_pipeline(self.stage).run(gm, ctx, after_each)
        artifacts.update(ctx.artifacts)
        owner.graphs[name] = gm
        return gm

    def _dump_dir(self, name: str) -> str | None:
        if not self.dump_dir or (dist.is_initialized() and dist.get_rank() != 0):
            return None  # the graphs are the same on every rank: rank 0 writes them
        return os.path.join(self.dump_dir, *name.split("."))


class _Region:
    """One region Dynamo captured: its forward and backward graphs, compiled, and how they are called."""

    def __init__(self, backend: Backend, owner: Prepared, name: str, example_inputs: list):
        self.backend, self.owner, self.name = backend, owner, name
        self.stage = backend.stage
        self.slots = [owner.slot_of(x) for x in example_inputs]
        self.params = [i for i, slot in enumerate(self.slots) if slot is not None and slot.role == Role.PARAM]
        self.compiled_for = {i: self.slots[i].fqn for i in self.params}  # a run may read other modules' (`_reads`)
        # stage 3: the inputs the graphs take this rank's shard for
        self.sharded = [i for i in self.params if self.slots[i].fqn in owner.layouts] if self.stage >= 3 else []
        self.artifacts: dict = {}  # what forward's passes planned, for backward's
        self.saved_params: dict = {}  # stage 3: forward's parameter placeholders by name
        self.handed: dict[int, int] = {}  # stage 3: forward output -> the input whose shard it hands to backward
        self.fingerprint = 0  # the compiled forward's (`runtime.fingerprint`)
        # "forward", "backward": how each graph is called (`graph_inputs`); None: with the arguments as they come
        self.inputs: dict[str, list | None] = {}
        self.runs = _Runs()  # from stage 1 on (and mixed precision): whose parameters each pending forward read

    def compile_forward(self, fw: fx.GraphModule, _inputs):
        self.runs.outputs = _output_names(fw)
        fw = tag_forward(fw, self.slots)
        if self.stage >= 3:
            self.saved_params = hold_shards(fw, self.owner.layouts)
            self.handed = hand_shards_to_backward(fw, self.saved_params)
        fw = self._compile("forward", fw, self.artifacts, self.saved_params)
        self.fingerprint = runtime.fingerprint(fw)
        run = make_boxed_func(fast_calls(fw))
        return _boxed(lambda args: self._forward(run, args))

    def compile_backward(self, bw: fx.GraphModule, _inputs):
        self.runs.saved_by(bw)
        bw = tag_backward(bw, self.slots, self.saved_params)
        held = {}
        if self.stage >= 3:
            held = hold_shards(bw, self.owner.layouts)
            recompute_views_where_read(bw, held)
        run = make_boxed_func(fast_calls(self._compile("backward", bw, dict(self.artifacts), held)))
        return _boxed(lambda args: self._backward(run, args))

    def _compile(self, which: str, gm: fx.GraphModule, artifacts: dict, held: dict) -> fx.GraphModule:
        """``gm`` through the passes, with the fp32 master shards of the parameters it holds as inputs under mixed
        precision; how to call it is kept in ``self.inputs[which]``."""
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        if held and self.owner.config.mixed_precision:
            add_master_inputs(gm, held, self.owner.shards.state.masters)
        gm = self.backend.compile_graph(self.owner, f"{self.name}.{which}", gm, artifacts)
        plan = graph_inputs(gm, names)
        self.inputs[which] = None if plan == list(range(len(names))) else plan
        return gm

    def _forward(self, run, args: list) -> list:
        read = self._reads(args)
        self._agree_on_graph()
        for i in self.sharded:
            args[i] = self.owner.shards.graph_input(read[i])
        shards = {i: args[i] for i in self.handed.values()}  # before the run: a boxed call clears ``args``
        out = self._recorded(run, self._arguments("forward", args, read), set(read.values()))
        for out_index, in_index in self.handed.items():
            out[out_index] = shards[in_index]
        if self.owner.shards is not None:
            self.runs.started(read, out)
        return out

    def _arguments(self, which: str, args: list, read: dict[int, str]) -> list:
        """``args`` as the graph ``which`` takes them after its passes (`graph_inputs`): the same list where they
        changed nothing, else a new one, and ``args`` cleared as a boxed call would. ``read``: the parameter at each
        input position in this run (whose master shards it takes)."""
        plan = self.inputs[which]
        if plan is None:
            return args
        actual = {self.compiled_for[i]: fqn for i, fqn in read.items()}
        masters = self.owner.shards.state.masters if self.owner.shards is not None else {}
        graph_args = [args[x] if isinstance(x, int) else masters[actual[x.fqn]] for x in plan]
        args.clear()
        return graph_args

    def _backward(self, run, args: list) -> list:
        self.owner.during_backward()
        self._agree_on_graph("backward")
        # stage 0 (fp32): autograd routes each gradient to whichever parameter its forward read
        read = self.runs.finished(args) if self.owner.shards is not None else self.compiled_for
        out = self._recorded(run, self._arguments("backward", args, read))
        # from stage 1 on (and under mixed precision) gradients go to what the optimizer holds, not to autograd
        for i in self.params:
            fqn = read[i]
            if out[i] is None:
                continue
            if fqn in self.owner.layouts:
                self.owner.shards.receive_grad(fqn, out[i])
                out[i] = None
            else:
                self.owner.note_compiled_grad(out[i])
        return out

    def _agree_on_graph(self, which: str = "forward") -> None:
        """Ranks run the same graph here, and so the same collectives after it: an 8-byte all-gather of the compiled
        forward's fingerprint (and of which graph of the region this is), awaited just before the graph's first
        collective (at the run's end if it issues none), raises on every rank where one differs (a batch shaped
        otherwise on one rank, a graph break on one rank only). On a group of its own (`Prepared.control_group`):
        a rank running a region the others do not meets their next agreement (the backward's, at the latest)
        rather than a collective of data."""
        dp = self.owner.ranks
        if dp.size > 1:
            name = f"{self.name}.{which}"
            value = self.fingerprint if which == "forward" else guards.key_hash({which: (self.fingerprint,)})
            collectives.before_next_collective(
                ranks.agree(value, f"the compiled {which} graph",
                            lambda: f"{name}, fingerprint {self.fingerprint:x}", self.owner.control_group))

    def _reads(self, args: list) -> dict[int, str]:
        """The parameter at each parameter input position of this run: a region compiled once may run for several
        modules of one class (each block, where a break inside the loop over them leaves the loop to eager), with
        other parameters than it was compiled with, whose gradients its backward then communicates."""
        return {i: self.owner.fqn_of(args[i]) for i in self.params}

    def _recorded(self, run, args: list, read: set[str] = frozenset()) -> list:
        with collectives.recording() as records:
            try:
                out = list(run(args))
            finally:
                collectives.settle_pending()  # a graph that issued no collective still checks the ranks agree
        self.owner.record(records, read)
        return out


class _Runs:
    """Which parameters each forward run of a region read, until its backward runs: a region serving several modules
    hands each backward's gradient shards to the parameters its own forward read. A backward is matched to its
    forward by the tensors forward saved for it (AOTAutograd names a saved value's backward input as the forward
    node it is), which are alive, so theirs alone, until that backward has run."""

    def __init__(self):
        self.outputs: list[str | None] = []  # the forward graph's output node names, as AOTAutograd made it
        self.saved: list[tuple[int, int]] = []  # (backward input, forward output) of each saved tensor
        self.pending: list[tuple[dict[int, str], list[int | None]]] = []  # (read, output data_ptrs) per forward run

    def saved_by(self, bw: fx.GraphModule) -> None:
        names = [n.name for n in bw.graph.nodes if n.op == "placeholder"]
        self.saved = [(b, self.outputs.index(name)) for b, name in enumerate(names) if name in self.outputs]

    def started(self, read: dict[int, str], out: list) -> None:
        self.pending.append((read, [t.data_ptr() if isinstance(t, torch.Tensor) and t.data_ptr() else None
                                    for t in out]))
        del self.pending[:-_MAX_PENDING_RUNS]  # forwards whose backward never ran (the loss dropped)

    def finished(self, args: list) -> dict[int, str]:
        """The parameters the forward run whose backward this is read (``args``: the backward's inputs)."""
        ptrs = [(f, args[b].data_ptr()) for b, f in self.saved if isinstance(args[b], torch.Tensor)]
        matches = [k for k, (_, outs) in enumerate(self.pending)
                   if all(outs[f] == ptr for f, ptr in ptrs if ptr and outs[f] is not None)]
        reads = {tuple(sorted(self.pending[k][0].items())) for k in matches}
        if len(reads) != 1:
            raise RuntimeError(
                f"zerofx.backend: cannot tell which of {len(self.pending)} pending forward runs of a compiled region "
                f"this backward belongs to ({len(matches)} match the tensors it saved), so not whose gradient shards "
                "it computes; compile the whole model, or use stage 0 without mixed_precision")
        return self.pending.pop(matches[-1])[0]


_MAX_PENDING_RUNS = 1024


def _output_names(gm: fx.GraphModule) -> list[str | None]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return [v.name if isinstance(v, fx.Node) else None for v in output.args[0]]


def _boxed(fn):
    """``fn`` called as AOTAutograd calls a compiled graph: with its arguments in one list, which it may clear."""
    fn._boxed_call = True
    return fn


def backend(stage: int = 0, *, bucket_bytes: int | None = None, dump_dir: str | None = None) -> Backend:
    """A torch.compile backend: ``torch.compile(model, backend=zerofx.backend(stage=3))`` for a model and
    optimizer given to ``zerofx.prepare`` with the same stage. Forward and backward run through zerofx's passes for
    ``stage``: gradients are averaged (stage 0) or reduce-scattered (stage 1) in buckets of ``bucket_bytes`` (DDP's
    25 MiB by default), as are the parameters gathered after stages 1-2's update; stages 2-3 reduce-scatter
    gradients, and stage 3 gathers parameters, by the model's blocks unless ``bucket_bytes`` is given. ``dump_dir``
    (or ``ZEROFX_DUMP``) writes each region's forward and backward graph after each pass."""
    return Backend(stage, bucket_bytes, dump_dir or os.environ.get("ZEROFX_DUMP"))
