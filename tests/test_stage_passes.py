"""The stage 1-3 passes on captured graphs, without a process group: placement, liveness, bucket sizes."""

import copy
import functools

import pytest
import torch

import zerofx
from models import TINY_GPT, accumulating_train_step, gpt_and_adamw, token_batch, train_step
from nanogpt import GPTConfig
from zerofx import collectives
from zerofx.binding import StepBinding
from zerofx.capture import capture
from zerofx.memory.lifetimes import lifetimes, peak_live
from zerofx.passes import PassContext, pipeline
from zerofx.passes.graph_edit import SHARD
from zerofx.passes.pipeline import Pipeline
from zerofx.passes.schedule_collectives import schedule_collectives
from zerofx.passes.split_incoming_grads import split_incoming_grads
from zerofx.report import paper_table
from zerofx.step_graph import Phase, Role, StepGraph, tag
from zerofx.units import unit_of_params


def _compiled(stage, world_size=4, bucket_bytes=16 * 1024, cfg=None, scheduled=True, **ctx_kwargs):
    """The stage's pipeline on a captured step; ``scheduled=False`` leaves out `schedule_collectives`, to see where
    the other passes put collectives."""
    model, opt = gpt_and_adamw(cfg=cfg or TINY_GPT)
    args = (model, opt, *token_batch(0, 0, cfg=cfg or TINY_GPT))
    gm = capture(train_step, StepBinding.from_args(args), args).gm
    ctx = PassContext(stage, world_size, "test", bucket_bytes, **ctx_kwargs)
    passes = tuple(p for p in pipeline(stage).passes if scheduled or p is not schedule_collectives)
    return Pipeline(stage, passes).run(gm, ctx), ctx


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.target is fn]


def test_stage1_keeps_full_gradients_until_backward_ends_and_stage2_does_not():
    for stage in (1, 2):
        gm, ctx = _compiled(stage)
        sg = StepGraph(gm)
        end_of_backward = sg.order[sg.phase_span(Phase.BACKWARD)[1]]
        scatters = [sg.order[n] for n in _calls(gm, collectives.reduce_scatter)]
        grads = sg.tagged(Role.GRAD)
        last_read = {f: max(sg.order[u] for u in g.users) for f, g in grads.items()}
        if stage == 1:  # every reduce-scatter after backward; every full gradient alive until then
            assert min(scatters) > end_of_backward
            assert min(last_read.values()) > end_of_backward
        else:  # reduce-scatters inside backward; each full gradient dies when its bucket is packed
            assert max(scatters) <= end_of_backward
            assert sum(r < end_of_backward for r in last_read.values()) >= len(grads) - len(
                ctx.artifacts["grad_buckets"][-1].names)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stage3_gathered_buckets_live_only_from_prefetch_to_last_use(prefetch):
    gm, ctx = _compiled(3, prefetch=prefetch, scheduled=False)
    sg = StepGraph(gm)
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        gathers = [n for n in _calls(gm, collectives.all_gather_coalesced) if tag(n).phase == phase]
        # each parameter's gathered buffer: its wait, then views of it, until real compute reads them
        waits = [[next(iter(item.users)) for item in g.users] for g in gathers]
        first_reads = []
        for i, (g, ws) in enumerate(zip(gathers, waits)):
            assert all(w.target is collectives.wait for w in ws)
            copies = set().union(*(_copies_of(w) for w in ws)) | set(ws)
            readers = [u for c in copies for u in c.users if u not in copies]
            if not readers:  # backward gathers every bucket, as the paper counts, even one it never reads (biases)
                assert phase == Phase.BACKWARD
                readers = [max(copies, key=sg.order.__getitem__)]
            first_reads.append(min(sg.order[u] for u in readers))
            assert all(tag(u).phase == phase for u in readers)  # dead after its last use in this phase
            for w in ws:  # each parameter waited on after the gather is issued, before anything reads it
                own = _copies_of(w) | {w}
                own_readers = [u for c in own for u in c.users if u not in own]
                assert sg.order[g] < sg.order[w] < min((sg.order[u] for u in own_readers), default=len(sg.order))
            assert not [c for c in copies if c.target is torch.ops.aten.clone.default]  # read in place, not copied
        for i, g in enumerate(gathers):  # issued no earlier than `prefetch` buckets ahead of its first use
            earliest = first_reads[max(0, i - prefetch)]
            previous = first_reads[i - prefetch - 1] if i - prefetch - 1 >= 0 else -1
            assert previous < sg.order[g] <= earliest
    forward = [b for phase, b in ctx.artifacts["gathers"] if phase == Phase.FORWARD]
    gathers = [n for n in _calls(gm, collectives.all_gather_coalesced) if tag(n).phase == Phase.FORWARD]
    assert len(forward) == len(gathers)
    # every bucket once; the tied embedding (7,808 bytes, under the largest bucket) stays gathered for the head
    assert [b.names for b in forward] == [b.names for b in ctx.artifacts["gather_buckets"]]
    assert ctx.artifacts["kept_gathered"] == ["wte.weight"]


_COPY_OUT = (torch.ops.aten.view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.clone.default)


def _copies_of(wait):
    """The pass's copy-out chain from a wait: views, slices and clones; whatever reads those reads the bucket."""
    copies, frontier = set(), [wait]
    while frontier:
        node = frontier.pop()
        for u in node.users:
            if u.target in _COPY_OUT and u not in copies:
                copies.add(u)
                frontier.append(u)
    return copies


def test_backward_reads_no_parameter_copy_from_forward():
    gm, _ = _compiled(3)
    for node in gm.graph.nodes:
        if tag(node).phase == Phase.BACKWARD:
            assert all(tag(a).phase != Phase.FORWARD or not _is_gathered(a) for a in node.all_input_nodes), node


def _is_gathered(node):
    seen = [node]
    while seen:
        n = seen.pop()
        if n.target is collectives.wait:
            return True
        if n.target in (torch.ops.aten.view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.clone.default,
                        torch.ops.aten.t.default):
            seen.extend(n.all_input_nodes)
    return False


def test_bucket_buffers_keep_their_size_when_the_model_grows_four_times():
    bucket_bytes = 16 * 1024
    small = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
    big = GPTConfig(vocab_size=65, block_size=16, n_layer=8, n_head=2, n_embd=32)
    sizes = {}
    for name, cfg in (("small", small), ("big", big)):
        gm, ctx = _compiled(3, cfg=cfg, bucket_bytes=bucket_bytes)
        gathered = [sum(v.numel() for v in n.meta["val"]) * 4 for n in _calls(gm, collectives.all_gather_coalesced)]
        scattered = [n.args[0].meta["val"].numel() * 4 for n in _calls(gm, collectives.reduce_scatter)]
        sizes[name] = (gathered, scattered, sum(p.numel() for p in gpt_and_adamw(cfg=cfg)[0].parameters()))
    largest_param = 65 * 32 * 4
    for gathered, scattered, _ in sizes.values():
        assert max(gathered + scattered) <= max(bucket_bytes, largest_param)
    assert sizes["big"][2] > 3 * sizes["small"][2]
    assert len(sizes["big"][0]) > 3 * len(sizes["small"][0]) - 4  # more buckets, not bigger ones
    assert max(sizes["big"][0]) == max(sizes["small"][0])


class _NormScaledSGD(torch.optim.Optimizer):
    """A LAMB-like update: the step is scaled by the parameter's own norm, which a shard cannot know."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad * p.norm(), alpha=-group["lr"])


def test_a_per_parameter_norm_in_the_optimizer_is_refused_at_stage_1(monkeypatch):
    from zerofx import optim_support

    monkeypatch.setitem(optim_support.SPECS, _NormScaledSGD,
                        optim_support.OptimizerSpec(tensor_hyperparams=(("lr", None),),
                                                    per_element_state=lambda group: ()))
    model, _ = gpt_and_adamw()
    opt = _NormScaledSGD(model.parameters())
    with pytest.raises(zerofx.CaptureError,
                       match="at stage 1 and is not elementwise(.|\n)*a norm of each parameter.s .*needs stage 0"):
        zerofx.compile(train_step, stage=1)(model, opt, *token_batch(0, 0))
    model, _ = gpt_and_adamw()  # stage 0 runs it as written
    zerofx.compile(train_step, stage=0)(model, _NormScaledSGD(model.parameters()), *token_batch(0, 0))


def _logs_a_weight_sum(model, optimizer, x, y):
    loss = train_step(model, optimizer, x, y)
    with torch.no_grad():
        return loss, sum(p.sum() for p in model.parameters())


def _logs_a_gradient_sum(model, optimizer, x, y):
    loss = train_step(model, optimizer, x, y)
    return loss, sum(p.grad.sum() for p in model.parameters())


@pytest.mark.parametrize("stage, step_fn", [(1, _logs_a_weight_sum), (2, _logs_a_gradient_sum)])
def test_reading_a_parameter_or_gradient_after_the_update_is_named_so(stage, step_fn):
    model, opt = gpt_and_adamw()
    after_update = rf"at stage {stage} after optimizer.step\(\) and is not elementwise"
    with pytest.raises(zerofx.CaptureError, match=after_update) as info:
        zerofx.compile(step_fn, stage=stage)(model, opt, *token_batch(0, 0))
    assert "zerofx.full_state_dict" in info.value.hint and "clip_grad_norm_" in info.value.hint


def test_the_papers_table():
    """The paper's model states for a 7.5B-parameter model on 64 ranks with mixed-precision Adam, in GB."""
    rows = [line.split() for line in paper_table(7.5e9, 64).splitlines()[2:]]
    assert [(row[0], row[-1]) for row in rows] == [("0", "120"), ("1", "31.4"), ("2", "16.6"), ("3", "1.88")]


def test_report_shows_measured_next_to_formula():
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, stage=2, track_memory=True)
    step(model, opt, *token_batch(0, 0))
    text = zerofx.report(step, print_output=False)
    stats = step.stats()
    measured = stats.model_state_bytes["total"]
    formula = stats.formula.evaluate(stats.formula.model_states, stats.num_params, 1)
    # the formula leaves out Adam's step counters: a 4-byte scalar per parameter tensor, 2 embeddings, 12 per
    # block and 2 in ln_f
    assert measured == formula + 28 * 4
    total_row = next(line for line in text.splitlines() if line.startswith("model states total"))
    assert total_row.split() == ["model", "states", "total", f"{measured:,}", "K*Psi/N_d", "+", "Psi*b_p", "+",
                                 "Psi*b_g/N_d", f"{formula:,.0f}"]
    assert "communication" in text


def test_collectives_in_flight_move_off_the_peak():
    """Stage 3 by blocks on 4 ranks, blocks checkpointed: before `schedule_collectives` the packed gradients of a
    reduce-scatter in flight are alive at the step's peak (a block's recomputed MLP backward); after it they are not,
    the peak (by lifetimes) falls by at least their bytes, every node still follows its inputs, and the same graph
    is moved the same way twice."""
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=3, n_head=4, n_embd=128)
    model, opt = gpt_and_adamw(cfg=cfg)
    args = (model, opt, *token_batch(0, 0, batch=8, cfg=cfg))
    binding = StepBinding.from_args(args)
    units = unit_of_params(binding.modules(args), binding.module_prefixes, binding.param_aliases, "blocks")
    captured = capture(train_step, binding, args, checkpoint="blocks").gm
    spans, peaks, orders = {}, {}, []
    for scheduled in (False, True, True):
        passes = tuple(p for p in pipeline(3).passes if scheduled or p is not schedule_collectives)
        ctx = PassContext(3, 4, "test", 2**20, units=units)
        gm = Pipeline(3, passes).run(copy.deepcopy(captured), ctx)
        gm.graph.lint()
        spans[scheduled] = lifetimes(gm.graph)
        peaks[scheduled] = peak_live(spans[scheduled])
        orders.append([n.name for n in gm.graph.nodes])
    assert ctx.artifacts["collectives_moved"] > 0
    assert orders[1] == orders[2] and orders[0] != orders[1]  # the same graph moves the same way (every rank)
    in_flight = {s: [span for span in spans[s] if span.category == "comm_buffers"
                     and span.start <= peaks[s][1] < span.end] for s in (False, True)}
    assert in_flight[False] and not in_flight[True]
    assert peaks[True][0] <= peaks[False][0] - min(span.nbytes for span in in_flight[False])


def test_a_collective_is_not_issued_after_a_write_to_what_it_sends():
    """A buffer all-reduced, then written in place while in flight, then big temporaries (the peak), then the wait:
    issuing later would lower the peak but send the written value, so the issue stays before the write."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    sent = g.call_function(aten.clone.default, (x,))
    issued = g.call_function(collectives.all_reduce, (sent, "sum", "test", 2))
    written = g.call_function(aten.add_.Tensor, (sent, 1.0))
    big = g.call_function(aten.mul.Tensor, (x, 2.0))
    total = g.call_function(aten.sum.default, (g.call_function(aten.add.Tensor, (big, 1.0)),))
    waited = g.call_function(collectives.wait, (issued, sent))
    g.output((g.call_function(aten.add.Tensor, (sent, waited)), total))
    with FakeTensorMode():
        vals = {x: torch.empty(1 << 16)}
        for node in g.nodes:
            if node.op == "call_function":
                vals[node] = vals[x].sum() if node.target is aten.sum.default else vals[x].clone()
    for node, val in vals.items():
        node.meta["val"] = val
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    ctx = PassContext(0, 2, "test", 2**20)
    order = [n.name for n in schedule_collectives(gm, ctx).graph.nodes]
    assert order.index(issued.name) < order.index(written.name)


def _returns_a_weight(model, optimizer, x, y):
    return train_step(model, optimizer, x, y), model.wte.weight * 1.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_returning_a_value_computed_from_a_shard_is_refused(stage):
    """Elementwise on a shard is the update's business; returned to the user it would be this rank's flat piece."""
    model, opt = gpt_and_adamw()
    with pytest.raises(zerofx.CaptureError, match="returns aten.mul.Tensor, computed from a 1/1 shard"):
        zerofx.compile(_returns_a_weight, stage=stage)(model, opt, *token_batch(0, 0))
    model, opt = gpt_and_adamw()  # stage 0 returns what eager returns
    ref_model, ref_opt = gpt_and_adamw()
    torch.testing.assert_close(zerofx.compile(_returns_a_weight)(model, opt, *token_batch(0, 0))[1],
                               _returns_a_weight(ref_model, ref_opt, *token_batch(0, 0))[1].detach())


def _backward_onto_incoming_grads(model, optimizer, x, y, micro_batches=1):
    """The last call of an accumulation window: backward adds to the .grad it finds, then the update."""
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        model(xs, ys).backward()
    optimizer.step()
    optimizer.zero_grad()


def _reads_the_incoming_grad(model, optimizer, x, y):
    norm = model.ln_f.weight.grad.norm()
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    return norm


def _captured_onto_incoming_grads(step):
    model, opt = gpt_and_adamw()
    for p in model.parameters():  # what an earlier call of the window left
        p.grad = torch.ones_like(p)
    args = (model, opt, *token_batch(0, 0))
    binding = StepBinding.from_args(args)
    return capture(step, binding, args, grads=list(binding.trainable())).gm


@pytest.mark.parametrize("micro_batches, first_grad", [(1, torch.ops.aten.detach.default),
                                                       (2, torch.ops.aten.clone.default)])
def test_backward_computes_the_calls_own_gradient_and_the_kept_shard_is_added_to_its_reduced_shard(
        micro_batches, first_grad):
    step = functools.partial(_backward_onto_incoming_grads, micro_batches=micro_batches)
    gm = _captured_onto_incoming_grads(step)
    incoming = StepGraph(gm).placeholders(Role.GRAD_IN)
    assert set(incoming) == set(dict(gpt_and_adamw()[0].named_parameters()))
    sg = StepGraph(split_incoming_grads(gm, PassContext(2, 4, "test", 16 * 1024)))
    for fqn, placeholder in incoming.items():
        assert not placeholder.users
        # as if .grad had been empty: the contribution itself, copied where the second micro-batch adds into it
        assert sg.tagged(Role.GRAD, 0)[fqn].target == first_grad
    ctx = PassContext(2, 4, "test", 16 * 1024)
    gm = Pipeline(2, tuple(p for p in pipeline(2).passes if p is not schedule_collectives)).run(
        _captured_onto_incoming_grads(step), ctx)
    layouts = ctx.artifacts["layouts"]
    for fqn, placeholder in StepGraph(gm).placeholders(Role.GRAD_IN).items():
        assert tuple(placeholder.meta["val"].shape) == (layouts[fqn].shard_numel,)
        (add,) = placeholder.users  # this call's first reduced shard added to the kept one, once
        assert add.target == torch.ops.aten.add.Tensor and add.args[0] is placeholder


def test_reading_an_incoming_gradient_other_than_by_backward_is_refused():
    gm = _captured_onto_incoming_grads(_reads_the_incoming_grad)
    with pytest.raises(zerofx.CaptureError, match="gradient of 'ln_f.weight' an earlier call left in .grad"):
        split_incoming_grads(gm, PassContext(2, 4, "test", 16 * 1024))


def _zeroing_after_the_update(model, optimizer, x, y):
    accumulating_train_step(model, optimizer, x, y)
    optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_micro_batch_shards_travel_in_bf16_and_are_summed_in_the_masters_fp32(stage):
    """Under mixed precision each micro-batch's gradients are reduce-scattered in bf16 and the shards summed in fp32
    (what every reader converts the gradient to), as FSDP2 sums them; in fp32 alone nothing is converted."""
    for mixed, sent, summed, step_fn in (
            (zerofx.MixedPrecision(torch.bfloat16), torch.bfloat16, torch.float32, accumulating_train_step),
            # zeroing after the update reads the gradients no more (the compute ones were summed in bf16 then)
            (zerofx.MixedPrecision(torch.bfloat16), torch.bfloat16, torch.float32, _zeroing_after_the_update),
            (None, torch.float32, torch.float32, accumulating_train_step)):
        model, opt = gpt_and_adamw()
        args = (model, opt, *token_batch(0, 0))
        gm = capture(step_fn, StepBinding.from_args(args), args, mixed=mixed).gm
        ctx = PassContext(stage, 4, "test", 16 * 1024)
        gm = Pipeline(stage, tuple(p for p in pipeline(stage).passes if p is not schedule_collectives)).run(gm, ctx)
        scatters = _calls(gm, collectives.reduce_scatter)
        assert {n.args[0].meta["val"].dtype for n in scatters} == {sent}
        sums = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and n.meta.get(SHARD)]
        assert len(sums) == len(list(model.parameters()))  # one per parameter (the tied head weight listed once)
        assert {n.meta["val"].dtype for n in sums} == {summed}
