"""Cases that run on every rank of a gloo pool (see dist_pool.py); the tests in test_stage0_dist.py call them."""

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from models import gpt_and_adamw, token_batch, train_beside, train_step


def _assert_state_close(a: dict, b: dict, rtol: float) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=0)


def ddp_parity(rank, world_size, steps=10, bucket_bytes=8 * 1024):
    ref_model, ref_opt = gpt_and_adamw()
    ddp = DDP(ref_model)
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, bucket_bytes=bucket_bytes)
    ref_losses, losses = train_beside(train_step, step, (ddp, ref_opt), (model, opt), token_batch, rank, steps)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    _assert_state_close(model.state_dict(), ref_model.state_dict(), rtol=1e-5)
    _assert_state_close(opt.state_dict(), ref_opt.state_dict(), rtol=1e-5)
    return {"losses": losses}


def allreduce_buckets(rank, world_size, bucket_bytes):
    """Returns what the graph, the records and CommDebugMode each say about the step's all-reduces."""
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, bucket_bytes=bucket_bytes)
    x, y = token_batch(0, rank)
    step(model, opt, x, y)
    with CommDebugMode() as comm:
        step(model, opt, x, y)
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    records = step.stats().collectives
    gm = step.graph()
    graph_allreduces = [n.meta["val"].numel() for n in gm.graph.nodes if n.target is zerofx.collectives.all_reduce]
    carried = [n.args[4] if len(n.args) > 4 else 0 for n in gm.graph.nodes if n.target is zerofx.collectives.all_reduce]
    return {
        "num_params": step.stats().num_params,
        "graph_allreduce_numels": [n - c for n, c in zip(graph_allreduces, carried)],
        "carried": carried,
        "record_kinds": [(r.kind, r.numel - r.carried, r.purpose) for r in records],
        "record_carried": [r.carried for r in records if r.kind == "all_reduce"],
        "comm_debug_counts": counts,
    }


def uneven_batch(rank, world_size):
    """Rank 1's second batch is shorter: every rank must raise, quickly, and the group must stay usable."""
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step)
    x, y = token_batch(0, rank)
    step(model, opt, x, y)
    return _mismatched_step(step, model, opt, token_batch(1, rank, batch=3 if rank == 1 else 4), world_size)


def uneven_first_batch(rank, world_size):
    """Rank 1's first batch is shorter: the error shows the part of the step that differs, not the whole step."""
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step)
    return _mismatched_step(step, model, opt, token_batch(0, rank, batch=3 if rank == 1 else 4), world_size)


def _mismatched_step(step, model, opt, batch, world_size) -> dict:
    """The step's error, how long it took to come, and whether the group still works after it."""
    start = time.perf_counter()
    try:
        step(model, opt, *batch)
    except zerofx.RankMismatchError as e:
        error = str(e)
    else:
        error = None
    elapsed = time.perf_counter() - start
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return {"error": error, "seconds": elapsed, "group_ok": flag.item() == world_size}


def dump_files(rank, world_size, dump_dir):
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, bucket_bytes=16 * 1024, dump_dir=dump_dir)
    step(model, opt, *token_batch(0, rank))
    named = step.graph("bucket_allreduce")
    return {
        "final_is_last_pass": step.graph().code == step.graph("plan_memory").code,
        "capture_has_no_allreduce": "all_reduce" not in step.graph("capture").code,
        "allreduces": sum(n.target is zerofx.collectives.all_reduce for n in named.graph.nodes),
    }


def rank_dependent_branch(rank, world_size):
    """Same shapes on every rank, but rank 0's step has an extra op: the graph fingerprints differ."""
    def branching_step(model, opt, x, y):
        opt.zero_grad()
        loss = model(x, y)
        if dist.get_rank() == 0:
            loss = loss * 1.0
        loss.backward()
        opt.step()
        return loss

    model, opt = gpt_and_adamw()
    step = zerofx.compile(branching_step)
    try:
        step(model, opt, *token_batch(0, rank))
    except zerofx.RankMismatchError as e:
        return str(e)
    return None


PRECISIONS = {"fp32": None, "bf16": zerofx.MixedPrecision(torch.bfloat16),
              "fp16": zerofx.MixedPrecision(torch.float16)}


def carried_agreement(rank, world_size, last_batch, precision="fp32"):
    """Steps of one shape carry the rank agreement on their first bucket (no control collective of their own); a
    step every rank shortens alike goes on; then ``last_batch(rank)`` rows on each rank. In fp32 training matches
    DDP's; in bf16 and fp16 (buckets in that dtype) it is bitwise that of the same step without the rank check."""
    ref_model, ref_opt = gpt_and_adamw()
    mixed = PRECISIONS[precision]
    ref_step = train_step if mixed is None else zerofx.compile(train_step, mixed_precision=mixed, verify_ranks=False)
    ref_args = (DDP(ref_model) if mixed is None else ref_model, ref_opt)
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, mixed_precision=mixed)
    control, debug_all_gathers, ref_losses, losses = [], [], [], []
    for i, rows in enumerate([4, 4, 4, 4, 3, 4, 4, 4]):
        x, y = token_batch(i, rank, batch=rows)
        ref_losses.append(ref_step(*ref_args, x, y).item())
        with CommDebugMode() as comm:
            losses.append(step(model, opt, x, y).item())
        control.append(sum(r.purpose == "control" and r.kind == "all_gather" for r in step.stats().collectives))
        debug_all_gathers.append(sum(v for k, v in comm.get_comm_counts().items() if "allgather" in str(k)))
    rtol = 1e-5 if mixed is None else 0
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=0)
    _assert_state_close(model.state_dict(), ref_model.state_dict(), rtol=rtol)
    return {"control": control, "debug_all_gathers": debug_all_gathers,
            "carried": "check_carried_agreement" in step.graph().code,
            **_mismatched_step(step, model, opt, token_batch(9, rank, batch=last_batch(rank)), world_size)}

