"""Each pass alone on a small captured graph; no process group needed to inspect what it inserts."""

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
    names = ["remove_profiler_ops", "skip_nonfinite_update", "broadcast_buffers", "bucket_allreduce"]
    assert [p.__name__ for p in pipeline(0).passes] == names
    for name in names:
        assert name in text


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
