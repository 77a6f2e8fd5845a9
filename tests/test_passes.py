"""Each pass alone on a small captured graph; no process group needed to inspect what it inserts."""

import operator

import pytest
import torch

from models import bn_and_sgd, bn_batch, gpt_and_adamw, token_batch, train_step
from zerofx import collectives
from zerofx.binding import StepBinding
from zerofx.capture import capture
from zerofx.passes import PassContext, broadcast_buffers, bucket_allreduce, pipeline, remove_profiler_ops
from zerofx.step_graph import Phase, Role, StepGraph, tag


def _captured(make=gpt_and_adamw, batch=token_batch):
    model, opt = make()
    args = (model, opt, *batch(0, 0))
    return capture(train_step, StepBinding.from_args(args), args).gm


def _ctx(bucket_bytes=16 * 1024, world_size=2):
    return PassContext(stage=0, world_size=world_size, group_name="test", bucket_bytes=bucket_bytes)


def test_pipeline_lists_its_passes():
    text = str(pipeline(0))
    names = ["remove_profiler_ops", "checkpoint_activations", "partition_checkpoints", "offload_checkpoints",
             "recompute_pointwise",
             "skip_nonfinite_update", "broadcast_buffers", "bucket_allreduce", "fold_aliases", "schedule_collectives",
             "carry_rank_agreement", "plan_scalar_operands", "plan_memory"]
    assert [p.__name__ for p in pipeline(0).passes] == names
    for name in names:
        assert name in text


def test_fold_aliases_drops_detach_and_double_transposes_and_computes_the_same_step():
    """The captured GPT step has both kinds, and views of views; folded, it has none of the first two, fewer of the
    third; the same nodes carry the gradients and the step's outputs, and its outputs and the state it updates in
    place are bitwise those of the graph as captured, on the same inputs."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from zerofx.passes.fold_aliases import fold_aliases

    gm = _captured()

    def double_transposes(g):
        return [n for n in g.graph.nodes if n.target is torch.ops.aten.t.default
                and getattr(n.args[0], "target", None) is torch.ops.aten.t.default]

    def views_of_views(g):
        return [n for n in g.graph.nodes if n.target is torch.ops.aten.view.default
                and getattr(n.args[0], "target", None) is torch.ops.aten.view.default]

    assert _calls(gm, torch.ops.aten.detach.default) and double_transposes(gm)
    views_before = len(views_of_views(gm))
    inputs = [_stand_in(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
    roles = (StepGraph(gm).tagged(Role.GRAD).keys(), StepGraph(gm).output_slots())
    with unset_fake_temporarily():
        want_state, got_state = _copies(inputs), _copies(inputs)  # the step updates its state in place
        want = gm(*want_state)
        ctx = _ctx()
        folded = fold_aliases(gm, ctx)
        got = folded(*got_state)
    assert (StepGraph(folded).tagged(Role.GRAD).keys(), StepGraph(folded).output_slots()) == roles
    assert len(want) == len(got)
    for a, b in zip(want_state + list(want), got_state + list(got)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert not _calls(folded, torch.ops.aten.detach.default) and not double_transposes(folded)
    assert len(views_of_views(folded)) < views_before
    assert ctx.artifacts["aliases_folded"] > 0


def test_plan_scalar_operands_turns_numbers_into_kept_tensors_and_computes_the_same_step():
    """AdamW's fp32 arithmetic on numbers (constants such as eps, numbers computed from the step count and the
    hyperparameters) reads 0-dim float32 CPU tensors the graph module keeps: the constants with their values (and
    named by them in the code), each read once, each computed number filled once before its first reader; the
    step's outputs and the state it updates are bitwise those of the graph as captured."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from zerofx.dump import render
    from zerofx.passes.plan_scalars import float32_of, plan_scalar_operands

    aten = torch.ops.aten
    arithmetic = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.mul.Tensor,
                  aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor}

    def number_operands(g):
        return [n for n in g.graph.nodes if n.target in arithmetic and len(n.args) > 1
                and not isinstance(getattr(n.args[1], "meta", {}).get("val"), torch.Tensor)]

    gm = _captured()
    before = number_operands(gm)
    computed = {n.args[1] for n in before if isinstance(n.args[1], torch.fx.Node)}
    assert len(before) > len(computed) > 0 and any(not isinstance(n.args[1], torch.fx.Node) for n in before)
    inputs = [_stand_in(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
    with unset_fake_temporarily():
        want_state, got_state = _copies(inputs), _copies(inputs)
        want = gm(*want_state)
        assert plan_scalar_operands(gm, PassContext(0, 1, None, 0)) is gm and number_operands(gm)  # off: unchanged
        ctx = PassContext(0, 1, None, 0, memory_plan=True)
        planned = plan_scalar_operands(gm, ctx)
        got = planned(*got_state)
    assert not number_operands(planned)
    for a, b in zip(want_state + list(want), got_state + list(got)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    reads = [n for n in planned.graph.nodes if n.op == "get_attr"]
    kept = {n.target: getattr(planned, n.target) for n in reads}
    assert len(reads) == len(kept)  # each kept tensor read once, whatever the number of its uses
    assert all(t.dim() == 0 and t.dtype == torch.float32 and t.device.type == "cpu" for t in kept.values())
    assert kept["scalar0_1"].item() == 1.0  # AdamW's step count += 1
    assert [name for name in kept if name.endswith("_1eneg08")]  # eps, spelled in the code
    fills = _calls(planned, torch.ops.aten.fill_.Scalar)
    assert all(f.args[0].op == "get_attr" and f.args[1].target is float32_of for f in fills)
    assert {f.args[1].args[0] for f in fills} == computed and len(fills) == len(computed)  # each filled once
    assert not [n for n in reads if not n.users]
    rewritten = ctx.artifacts["scalar_operands"]
    assert (rewritten.calls, rewritten.constants + rewritten.computed) == (len(before), len(kept))
    namespace = {}
    exec(compile(render(planned, "plan_scalar_operands"), "dump.py", "exec"), namespace)  # the dump makes them
    assert {k: v.item() for k, v in namespace["Step"]().named_buffers()} == {k: v.item() for k, v in kept.items()}


def test_a_computed_number_is_rounded_to_float32_as_a_cast_rounds_it():
    """Beyond float32's range a wrapped number becomes ±inf (which fp16 loss scaling then skips), where ``fill_``
    would raise; an int is left for ``fill_`` to convert directly."""
    from zerofx.passes.plan_scalars import float32_of

    for number in (1e39, -3.5e38, 0.1, 1 / 3, float("inf"), 2.0**-150):
        slot = torch.zeros(()).fill_(float32_of(number))
        assert torch.equal(slot, torch.ones(()) * number), number
    assert float32_of(2**60 + 2**36 + 1) == 2**60 + 2**36 + 1


def test_plan_memory_leaves_nothing_in_torchs_fake_op_cache():
    """The arena's slots are fake views made once per plan: torch's fake-op cache, which lives as long as the
    process, gains no entry for them (it kept three a slot, a megabyte or more a plan)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerofx.passes.plan_memory import plan_memory

    gm = _captured()
    before = len(FakeTensorMode.cache)
    ctx = PassContext(0, 1, None, 0, memory_plan=True)
    plan_memory(gm, ctx)
    assert ctx.artifacts["memory_plan"].buffers > 50
    assert len(FakeTensorMode.cache) == before


def _stand_in(val):
    """A real value for a placeholder: uniform floats, zero integers, 0.01 for a scalar hyperparameter."""
    if isinstance(val, torch.SymFloat):
        return 0.01
    if not isinstance(val, torch.Tensor):
        return 1
    if val.is_floating_point():
        return torch.rand(val.shape).to(val.dtype)
    return torch.zeros(val.shape, dtype=val.dtype)


def _copies(values):
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_remove_profiler_ops_leaves_no_markers():
    gm = remove_profiler_ops(_captured(), _ctx())
    assert not [n for n in gm.graph.nodes if "record_function" in str(n.target)]


def test_bucket_allreduce_one_collective_per_bucket_placed_when_the_bucket_is_ready():
    bucket_bytes = 16 * 1024
    ctx = _ctx(bucket_bytes)
    gm = bucket_allreduce(remove_profiler_ops(_captured(), ctx), ctx)
    sg = StepGraph(gm)
    reduces = [n for n in gm.graph.nodes if n.target is collectives.all_reduce]
    buckets = ctx.artifacts["grad_buckets"]
    assert len(reduces) == len(buckets) == 12  # 16 KiB buckets of the tiny GPT, counted in test_stage0_dist
    psi = sum(p.numel() for p in gpt_and_adamw()[0].parameters())
    assert sum(b.numel for b in buckets) == psi
    assert all(b.nbytes <= bucket_bytes or len(b.names) == 1 for b in buckets)
    grads = sg.tagged(Role.GRAD)
    for reduce, bucket in zip(reduces, buckets):
        assert tag(reduce).phase == Phase.BACKWARD  # issued while backward still runs
        ready = max(sg.order[grads[f]] for f in bucket.names)
        assert ready < sg.order[reduce] <= ready + len(bucket.names) + 2  # views, cat, then the all-reduce
        wait = next(u for u in sg.graph.nodes if u.target is collectives.wait and u.args[0] is reduce)
        for f in bucket.names:  # every later reader of the gradient reads the reduced copy
            readers = [u for u in grads[f].users if sg.order[u] > sg.order[reduce]]
            assert not readers
        assert sg.order[wait] > sg.order[reduce]
    # buckets follow the order gradients become ready
    ready_order = [max(sg.order[grads[f]] for f in b.names) for b in buckets]
    assert ready_order == sorted(ready_order)


def test_carry_rank_agreement_adds_one_checked_element_to_the_first_bucket_only():
    """The first bucket grows by the flag's zero, which gets a piece of its own that the check reads before any
    gradient piece is read; the replay lists every all-reduce issued before the check, the first with the flag."""
    from zerofx import ranks
    from zerofx.passes.carry_rank_agreement import FLAG, carry_rank_agreement

    ctx = _ctx(bucket_bytes=16 * 1024)
    ctx.carry_agreement = True
    gm = _captured()
    for p in pipeline(0).passes:
        if p is carry_rank_agreement:
            break
        gm = p(gm, ctx)
    before = [n.meta["val"].numel() for n in gm.graph.nodes if n.target is collectives.all_reduce]
    gm = carry_rank_agreement(gm, ctx)
    nodes = list(gm.graph.nodes)
    reduces = [n for n in nodes if n.target is collectives.all_reduce]
    assert [n.meta["val"].numel() for n in reduces] == [before[0] + 1, *before[1:]]
    assert reduces[0].args[4] == 1 and all(len(n.args) == 4 for n in reduces[1:])
    flat = reduces[0].args[0]
    assert flat.args[0][-1].op == "get_attr" and flat.args[0][-1].target == FLAG
    assert getattr(gm, FLAG).tolist() == [0.0]
    check = next(n for n in nodes if n.target is ranks.check_carried_agreement)
    piece = check.args[0]
    split = piece.args[0]
    assert split.target is torch.ops.aten.split_with_sizes.default and piece.args[1] == len(split.args[1]) - 1
    assert split.args[1][-1] == 1 and sum(split.args[1]) == before[0] + 1
    pieces = [u for u in split.users if u is not piece]
    assert all(nodes.index(check) < nodes.index(r) for p in pieces for r in p.users)
    replay = ctx.artifacts["carried_agreement"].all_reduces
    issued_before = [n for n in reduces if nodes.index(n) < nodes.index(check)]
    assert [(c.numel, c.dtype, c.op, c.group_size) for c in replay] == \
        [(n.meta["val"].numel(), n.meta["val"].dtype, "avg", 2) for n in issued_before]
    assert len(replay) == len(before)  # the step's one wait comes after backward: every bucket is issued by then


def test_carry_rank_agreement_is_off_unless_asked_and_on_one_rank():
    from zerofx.passes.carry_rank_agreement import carry_rank_agreement

    for ctx in (_ctx(), PassContext(0, 1, None, 0, carry_agreement=True)):
        gm = bucket_allreduce(_captured(), ctx)
        code = gm.code
        assert carry_rank_agreement(gm, ctx).code == code and "carried_agreement" not in ctx.artifacts


def test_bucket_allreduce_is_a_no_op_on_one_rank():
    gm = _captured()
    before = len(gm.graph.nodes)
    assert len(bucket_allreduce(gm, _ctx(world_size=1)).graph.nodes) == before


def test_broadcast_buffers_overwrites_every_buffer_before_forward():
    ctx = _ctx()
    gm = broadcast_buffers(_captured(bn_and_sgd, bn_batch), ctx)
    nodes = list(gm.graph.nodes)
    sends = [n for n in nodes if n.target is collectives.broadcast]
    assert len(sends) == 2  # float running stats and the int64 batch counter travel separately
    assert {n.meta["val"].dtype for n in sends} == {torch.float32, torch.int64}
    buffers = StepGraph(gm).placeholders(Role.BUFFER)
    copies = [n for n in nodes if n.target is torch.ops.aten.copy_.default and n.args[0] in buffers.values()]
    assert {c.args[0] for c in copies} == set(buffers.values())
    first_forward_op = next(n for n in nodes if "batch_norm" in str(n.target))
    assert all(nodes.index(c) < nodes.index(first_forward_op) for c in copies)


def _gelu_and_layernorm_outputs(gm):
    """Forward GELU and LayerNorm-output nodes, and whether backward reads each directly or through a view."""
    def read_in_backward(node):
        frontier, seen = [node], set()
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if tag(u).phase == Phase.BACKWARD:
                    return True
                if u not in seen and u.target in (torch.ops.aten.view.default, torch.ops.aten.t.default):
                    seen.add(u)
                    frontier.append(u)
        return False

    nodes = [n for n in gm.graph.nodes if tag(n) and tag(n).phase == Phase.FORWARD
             and (n.target is torch.ops.aten.gelu.default
                  or (n.target is operator.getitem and n.args[0].target is torch.ops.aten.native_layer_norm.default
                      and n.args[1] == 0))]
    return {n.name: read_in_backward(n) for n in nodes}


def test_recompute_pointwise_remakes_gelu_and_layernorm_outputs_in_backward():
    from zerofx.passes import recompute_pointwise

    kept = _gelu_and_layernorm_outputs(_captured())
    assert len(kept) == 2 * 3 + 1 and all(kept.values())  # per block two LayerNorms and a GELU, and ln_f
    gm = recompute_pointwise(_captured(), PassContext(0, 1, None, 0, recompute_pointwise=True))
    assert not any(_gelu_and_layernorm_outputs(gm).values())  # backward reads its own copies now
    copies = [n for n in gm.graph.nodes if n.meta.get("zerofx_recomputed")]
    assert {tag(n).phase for n in copies} == {Phase.BACKWARD}
    assert sum(n.target is torch.ops.aten.gelu.default for n in copies) == 2
    assert sum(n.target is torch.ops.aten.native_layer_norm.default for n in copies) == 5


def test_checkpoint_activations_copies_each_block_into_backward_before_its_first_reader():
    from zerofx.passes import checkpoint_activations
    from zerofx.trace_events import REGION

    model, opt = gpt_and_adamw()
    args = (model, opt, *token_batch(0, 0))
    gm = capture(train_step, StepBinding.from_args(args), args, checkpoint="blocks").gm
    regions = {n.meta[REGION] for n in gm.graph.nodes if REGION in n.meta}
    assert regions == {"blocks.0#0", "blocks.1#0"}
    ctx = PassContext(0, 1, None, 0)
    gm = checkpoint_activations(gm, ctx)
    assert set(ctx.artifacts["recomputed"]) == regions
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for region in regions:
        members = [n for n in gm.graph.nodes if n.meta.get(REGION) == region and n.op == "call_function"]
        # backward reads nothing the region computed but its output (read by forward after the region)
        for m in members:
            if any(tag(u).phase == Phase.BACKWARD for u in m.users):
                assert any(tag(u).phase == Phase.FORWARD and u.meta.get(REGION) != region for u in m.users), m
    # the copies sit right before the first backward node that reads one of them (generator-state ops aside)
    copies = [n for n in gm.graph.nodes if n.meta.get("zerofx_recomputed") == "checkpoint"]
    readers = {u for c in copies for u in c.users if not u.meta.get("zerofx_recomputed")}
    first_reader = min(order[u] for u in readers)
    assert copies and all(tag(c).phase == Phase.BACKWARD for c in copies)
    between = [n for n in gm.graph.nodes if order[n] < first_reader and not n.meta.get("zerofx_recomputed")
               and tag(n).phase == Phase.BACKWARD and order[n] > min(order[c] for c in copies)]
    assert all(n.target.__module__ == "torch._ops.zerofx" or "rng_state" in str(n.target) for n in between), between


@pytest.mark.parametrize("split", [(), ("wte.weight",)])
def test_partition_checkpoints_keeps_a_tp_slice_of_each_replicated_block_input(split):
    """A block input every tp rank holds alike is kept as a 1/tp slice and gathered over tp before its recompute;
    one computed from a parameter split over tp (here, pretending the embedding is) differs across the tp ranks and
    is kept whole."""
    from zerofx.passes import checkpoint_activations, partition_checkpoints
    from zerofx.passes.flat_collectives import CATEGORY
    from zerofx.passes.graph_edit import RESTORES_CHECKPOINT

    model, opt = gpt_and_adamw()
    args = (model, opt, *token_batch(0, 0))
    gm = capture(train_step, StepBinding.from_args(args), args, checkpoint="blocks").gm
    ctx = PassContext(0, 1, None, 0, tp_size=2, tp_group_name="tp", tp_sharded=frozenset(split),
                      partition_activations=True)
    gm = partition_checkpoints(checkpoint_activations(gm, ctx), ctx)
    gathers = [n for n in gm.graph.nodes if n.target is collectives.all_gather]
    kept = [n for n in gm.graph.nodes if n.meta.get(CATEGORY) == "checkpoint"]
    if split:
        assert ctx.artifacts["partitioned_checkpoints"] == 0 and not gathers
        return
    block_input = 4 * 16 * 32  # batch × T × C elements
    assert ctx.artifacts["partitioned_checkpoints"] == 2 == len(gathers)
    assert sorted(n.meta["val"].numel() for n in kept) == [block_input // 2] * 2
    for gather in gathers:
        assert gather.meta[RESTORES_CHECKPOINT] and gather.args[1:] == ("tp", 2, "activations")
        assert tag(gather).phase == Phase.BACKWARD and gather.args[0] in kept
        assert tag(gather.args[0]).phase == Phase.FORWARD
    assert [s for s in StepGraph(gm).input_slots() if s.role == Role.TP_RANK]


class _WritesItsInput(torch.nn.Module):
    def __init__(self, batch_norm=False):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8) if batch_norm else None

    def forward(self, x):
        if self.bn is not None:
            return torch.tanh(self.bn(self.fc(x)))
        g = torch.tanh(x * 2)
        x.add_(1)  # the block's input changes after forward read it: recomputing would read the new value
        return self.fc(g + x)


class _Stack(torch.nn.Module):
    def __init__(self, batch_norm):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_WritesItsInput(batch_norm) for _ in range(2))

    def forward(self, x, y):
        x = x * 1.0
        for b in self.blocks:
            x = b(x)
        return ((x - y) ** 2).mean()


@pytest.mark.parametrize("batch_norm", [False, True])
def test_a_region_that_recomputing_would_change_is_left_as_it_is_with_a_warning(batch_norm, caplog):
    """An input written in place after forward read it; a training BatchNorm (its running statistics would be
    updated twice): neither is recomputed, and the warning says why."""
    from zerofx.passes import checkpoint_activations

    torch.manual_seed(0)
    model = _Stack(batch_norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = (model, opt, torch.randn(4, 8), torch.randn(4, 8))
    gm = capture(train_step, StepBinding.from_args(args), args, checkpoint="blocks").gm
    ctx = PassContext(0, 1, None, 0)
    with caplog.at_level("WARNING", logger="zerofx"):
        checkpoint_activations(gm, ctx)
    assert ctx.artifacts["recomputed"] == {}
    reason = "running statistics a second time" if batch_norm else "writes into"
    warned = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(warned) == 2, warned
    assert all("%" not in w and "aten." in w and "(at " in w and "test_passes.py" in w for w in warned), warned


def test_plan_memory_starts_every_slot_where_the_devices_allocator_starts_a_block():
    """On CPU slots start on c10's 64 bytes (tighter than an accelerator's, so some do not start on 512); on an
    accelerator, on the caching allocator's 512, as the unplanned step's fresh blocks do."""
    from zerofx.memory.pools import slot_alignment
    from zerofx.passes.plan_memory import plan_memory

    gm = _captured()
    plan_memory(gm, PassContext(0, 1, None, 0, memory_plan=True))
    arena = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "arena")
    starts = [slot.storage_offset() * slot.element_size() for slot in arena.meta["val"]]
    assert all(start % 64 == 0 for start in starts) and any(start % 512 for start in starts)
    assert slot_alignment(torch.device("cpu")) == 64 and slot_alignment(torch.device("cuda", 0)) == 512


class _Copying(torch.nn.Module):
    """A model whose forward (and so backward) casts and clones activations."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x, y):
        h = self.a(x).double().float().clone()
        return torch.nn.functional.mse_loss(self.b(h).squeeze(-1), y)


def test_plan_memory_writes_copies_into_their_slots_in_place(monkeypatch):
    """Casts and clones allocate their result and copy into it (their generated ``out=`` variants would copy once
    more): planned, ``copy_`` writes each into its slot, and the step computes bitwise the same. Every candidate is
    planned here (``_fit_under_peak``, which leaves some to the allocator for the peak's sake, is bypassed)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from zerofx.memory.pools import place, slot_place, slot_views
    from zerofx.passes import plan_memory as module

    def plan_every_candidate(chosen, others, length, left, alignment):
        every = [s for spans in chosen for s in spans]
        return every, place(every, alignment)

    monkeypatch.setattr(module, "_fit_under_peak", plan_every_candidate)
    plan_memory = module.plan_memory

    def make():
        torch.manual_seed(0)
        model = _Copying()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    gm = _captured(make, lambda *_: (torch.randn(4, 8), torch.randn(4)))
    aten = torch.ops.aten
    copies = len(_calls(gm, aten._to_copy.default)) + len(_calls(gm, aten.clone.default))
    assert copies >= 5  # two casts and a clone forward, the casts' gradients back
    inputs = [_stand_in(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder"]
    with unset_fake_temporarily():
        want_state, got_state = _copies(inputs), _copies(inputs)
        want = gm(*want_state)
        ctx = PassContext(0, 1, None, 0, memory_plan=True)
        planned = plan_memory(gm, ctx)
        arena = next(n for n in planned.graph.nodes if n.op == "placeholder" and n.name == "arena")
        raw = torch.empty(ctx.artifacts["arena_bytes"], dtype=torch.uint8)
        slots = slot_views(raw, [slot_place(v) for v in arena.meta["val"]])
        got = planned(*got_state, slots)
    written = [n for n in _calls(planned, aten.copy_.default) if n.args[0].args[0] is arena]
    assert len(written) == copies and not _calls(planned, aten._to_copy.default) + _calls(planned, aten.clone.default)
    for a, b in zip(want_state + list(want), got_state + list(got)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_plan_memory_leaves_out_variants_torch_made_up_to_the_allocator():
    """``native_layer_norm.out`` is generated from the functional op: it allocates the result, then copies it into
    ``out``. Planned, it would cost a copy and save no allocation: it is left, with that reason, and ``mm`` (a real
    ``out=`` kernel) writes into the arena."""
    from zerofx.passes.plan_memory import plan_memory

    gm = _captured()
    ctx = PassContext(0, 1, None, 0, memory_plan=True)
    plan_memory(gm, ctx)
    aten = torch.ops.aten
    targets = {n.target for n in gm.graph.nodes}
    assert aten.native_layer_norm.default in targets and aten.native_layer_norm.out not in targets
    assert aten.mm.out in targets
    assert ctx.artifacts["memory_plan"].left["an out= variant that allocates and copies (native_layer_norm)"] > 0


@pytest.mark.parametrize("first_fitting", [0, 1, 2, 299, 498, 499])
def test_the_first_point_where_an_arena_fits_is_found_in_a_logarithmic_number_of_plans(first_fitting):
    """Where the planned buffers must leave for the allocator one by one until their arena fits, the arena is
    planned at doubling steps and halved back, not after each buffer: the first point that fits is found in at most
    2·log2(n) + 2 plans of n, and the search answers None, planning as often, where none fits."""
    from zerofx.passes.plan_memory import _earliest_fitting

    for n, expected in ((500, first_fitting), (first_fitting, None)):
        asked = []

        def fits(i):
            asked.append(i)
            return i >= first_fitting

        assert _earliest_fitting(n, fits) == expected
        assert len(asked) <= 2 * max(n, 2).bit_length() + 2, asked


def test_where_fitting_comes_and_goes_the_point_found_fits():
    """Along the order buffers leave in, the arena may fit, then not, then fit again: the search answers a point
    that fits (not always the earliest: the steps may jump over a short stretch that does), or None."""
    from zerofx.passes.plan_memory import _earliest_fitting

    for fits in (lambda i: i == 5 or i >= 40, lambda i: 18 <= i < 20 or i >= 69, lambda i: i % 7 == 3,
                 lambda i: i in (0, 99), lambda i: i == 5):
        found = _earliest_fitting(100, fits)
        assert found is None or fits(found), found
    assert _earliest_fitting(100, lambda i: i == 5 or i >= 40) == 40  # 5 was jumped over
