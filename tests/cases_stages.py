"""Stages 1-3 on every rank of a gloo pool; test_stages_dist.py calls these."""

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from zerofx.memory.lifetimes import lifetimes, live_bytes
from models import (TINY_GPT, accumulating_train_step, bn_and_sgd, bn_batch, clipped_train_step, conv_bn_and_sgd,
                    gpt_and_adamw, image_batch, token_batch, train_beside, train_step)
from nanogpt import GPTConfig
from peers.measure import CollectiveSizes


def _ddp_full_state(model, opt) -> dict:
    """DDP's state in the layout of zerofx.full_state_dict (FQN keys)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: v.detach() for k, v in model.state_dict().items()},
            "optimizer": {names[id(p)]: s for p, s in opt.state.items()}}


STEPS = {"plain": train_step, "clipped": clipped_train_step, "accumulating": accumulating_train_step}


def parity_with_ddp(rank, world_size, stage, steps=10, bucket_bytes=8 * 1024, reshard_after_forward=True,
                    atol=1e-7, noise_atol=1e-7, step_fn="plain"):
    ref_model, ref_opt = gpt_and_adamw()
    ddp = DDP(ref_model)
    model, opt = gpt_and_adamw()
    fn = STEPS[step_fn]
    step = zerofx.compile(fn, stage=stage, bucket_bytes=bucket_bytes, reshard_after_forward=reshard_after_forward)
    ref_step = fn if step_fn != "accumulating" else _ddp_accumulating(ddp)
    ref_losses, losses = train_beside(ref_step, step, (ddp, ref_opt), (model, opt), token_batch, rank, steps)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full = zerofx.full_state_dict(step)
    ref = _ddp_full_state(ref_model, ref_opt)
    # The attention key's bias has an analytically zero gradient: its Adam update is rounding noise scaled to lr, so
    # it alone gets ``noise_atol`` (any ulp of difference upstream, such as a clip coefficient or the order of a
    # 4-rank sum, shows there); everything else must agree to rtol 1e-5 with ``atol`` for values near zero.
    for name in ref["model"]:
        tol = noise_atol if name.endswith("attn.qkv.bias") else atol
        torch.testing.assert_close(full["model"][name], ref["model"][name], rtol=1e-5, atol=tol, msg=name)
        if name in ref["optimizer"]:
            torch.testing.assert_close(full["optimizer"]["state"][name], ref["optimizer"][name], rtol=1e-5,
                                       atol=tol, msg=name)
    released = model.wte.weight
    spans_buckets = len(step.graph().code.split("reduce_scatter(")) - 1
    with CollectiveSizes() as comm:
        step(model, opt, *token_batch(steps, rank))
    return {"released_numel": released.numel(), "reduce_scatters": spans_buckets, "losses": losses,
            "records": [(r.kind, r.numel, r.purpose) for r in step.stats().collectives],
            "carried": [r.carried for r in step.stats().collectives],
            "dispatched": [(r.kind, r.numel, r.group_size) for r in comm.records],
            "comm_volume": step.stats().comm_volume, "num_params": step.stats().num_params,
            "formula_comm": step.stats().formula.evaluate(step.stats().formula.comm, step.stats().num_params,
                                                          world_size),
            "comm_vs_formula": step.stats().comm_vs_formula}


def _ddp_accumulating(ddp):
    """DDP's accumulation: no_sync on every micro-batch but the last."""
    def step(model, optimizer, x, y):
        optimizer.zero_grad()
        total = 0.0
        chunks = list(zip(x.chunk(2), y.chunk(2)))
        for i, (xs, ys) in enumerate(chunks):
            context = ddp.no_sync() if i < len(chunks) - 1 else contextlib.nullcontext()
            with context:
                loss = model(xs, ys) / 2
                loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total
    return step


def _graph_high_water(step, category):
    """The most bytes of ``category`` alive at once by the final graph's lifetimes (what the graph's order allows)."""
    spans = [s for s in lifetimes(step._last.gm.graph) if s.category == category]
    return int(live_bytes(spans, len(step._last.gm.graph.nodes)).max(initial=0))


def accounting(rank, world_size, stage, bucket_bytes=16 * 1024, cfg=None, reshard_after_forward=True,
               prefetch=1, mixed=False, reduce_fp32=False, cast_at_gather=True, optimized=""):
    """One measured step: stats, the layouts, and what CommDebugMode saw dispatched around it. The optimizer holds
    the parameters under the module ``optimized`` (all of them by default)."""
    cfg = cfg or TINY_GPT
    model, opt = gpt_and_adamw(cfg=cfg)
    opt = torch.optim.Adam(model.get_submodule(optimized).parameters(), lr=1e-3)  # the paper's fp32 Adam: K = 8
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=bucket_bytes, track_memory=True,
                          reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                          mixed_precision=zerofx.MixedPrecision(torch.bfloat16, torch.float32 if reduce_fp32 else None,
                                                                cast_at_gather=cast_at_gather) if mixed else None)
    step(model, opt, *token_batch(0, rank, cfg=cfg))
    with CollectiveSizes() as comm:
        step(model, opt, *token_batch(1, rank, cfg=cfg))
    stats = step.stats()
    layouts = step._owned.layouts if step._owned and step._owned.stage else {}
    padded_params = sum(l.padded_numel for l in layouts.values())
    return {
        "num_params": stats.num_params,
        "padded_params": padded_params,
        "num_param_tensors": len(layouts),
        "model_state_bytes": stats.model_state_bytes,
        "peak_bytes": stats.peak_bytes,
        "at_peak": step._last_probe.at_peak,
        "activation_bytes": stats.activation_bytes,
        "high_water": step._last_probe.high_water,
        "graph_gathered_high_water": _graph_high_water(step, "gathered_params"),
        "comm_vs_formula": stats.comm_vs_formula,
        "formula_comm": stats.formula.evaluate(stats.formula.comm, stats.num_params, world_size),
        "gather_bucket_bytes": [b.nbytes for b in step._last.ctx.artifacts.get("gather_buckets", [])],
        "comm_volume": stats.comm_volume,
        "records": [(r.kind, r.numel, r.purpose) for r in stats.collectives],
        "carried": [r.carried for r in stats.collectives],
        "dispatched": [(r.kind, r.numel, r.group_size) for r in comm.records],
        "comm_debug_counts": {str(k): v for k, v in comm.get_comm_counts().items()},
        "formula_total": stats.formula.evaluate(stats.formula.model_states, stats.num_params, world_size),
        "formula_at_paper_scale": stats.formula.evaluate(stats.formula.model_states, 7.5e9, 64),
        # padding travels with the parameters: the formula at the padded Ψ is what the collectives move
        "formula_comm_padded": stats.formula.evaluate(stats.formula.comm, padded_params or stats.num_params,
                                                      world_size),
        "bucket_sizes": [b.nbytes for b in step._last.ctx.artifacts["grad_buckets"]],
    }



ODD_GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=30)  # sizes that need padding


def load_full_state_then_train(rank, world_size, stage):
    """A step loaded with DDP's full state after 3 steps continues exactly as DDP does."""
    ref_model, ref_opt = gpt_and_adamw()
    ddp = DDP(ref_model)
    for i in range(3):
        train_step(ddp, ref_opt, *token_batch(i, rank))
    model, opt = gpt_and_adamw(seed=7)  # different weights: all of them must come from the loaded state
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024)
    step(model, opt, *token_batch(99, rank))  # bind the step to its model and optimizer
    ref = _ddp_full_state(ref_model, ref_opt)
    names = {id(p): n for n, p in ref_model.named_parameters()}
    groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in ref_opt.param_groups]
    zerofx.load_state_dict(step, {"model": ref["model"], "optimizer": {"state": ref["optimizer"],
                                                                           "param_groups": groups}})
    losses, ref_losses = [], []
    for i in range(3, 6):
        x, y = token_batch(i, rank)
        ref_losses.append(train_step(ddp, ref_opt, x, y).item())
        losses.append(step(model, opt, x, y).item())
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    on_rank0 = zerofx.full_state_dict(step, rank0_only=True)
    return {"rank0_only_empty": on_rank0 == {},
            "optimizer_state_released": opt.state[model.wte.weight]["exp_avg"].numel()}


def bf16_shard_kept_or_cast_at_gather(rank, world_size, steps=4):
    """Stage 3 in bf16 with a bf16 shard kept (``cast_at_gather=False``) against casting the masters at each gather:
    the same rounding, so the same losses and masters bitwise; a state saved from one (sharded, and full) loads into
    the other, whose bf16 shards are then refreshed from the loaded masters, and the runs go on alike."""
    runs = {}
    for cast_at_gather in (True, False):
        model, opt = gpt_and_adamw()
        step = zerofx.compile(train_step, stage=3, mixed_precision=zerofx.MixedPrecision(
            torch.bfloat16, cast_at_gather=cast_at_gather))
        losses = [step(model, opt, *token_batch(i, rank)).item() for i in range(steps)]
        runs[cast_at_gather] = (model, opt, step, losses)
    (_, _, cast, cast_losses), (model, opt, kept, kept_losses) = runs[True], runs[False]
    assert kept_losses == cast_losses
    full = zerofx.full_state_dict(cast)
    for name, value in zerofx.full_state_dict(kept)["model"].items():
        assert torch.equal(value, full["model"][name]), name
    resumed = []
    for saved in (zerofx.state_dict(cast), full):
        fresh_model, fresh_opt = gpt_and_adamw()
        step = zerofx.compile(train_step, stage=3, mixed_precision=zerofx.MixedPrecision(torch.bfloat16,
                                                                                         cast_at_gather=False))
        step.bind(fresh_model, fresh_opt, *token_batch(0, rank))
        zerofx.load_state_dict(step, saved)
        resumed.append((step, fresh_model, fresh_opt))
    for i in range(steps, steps + 2):
        x, y = token_batch(i, rank)
        losses = {s(m, o, x, y).item() for s, m, o in [*resumed, (cast, runs[True][0], runs[True][1])]}
        assert len(losses) == 1, (i, losses)
    return {"kept_param_bytes": kept.stats().model_state_bytes["params"],
            "cast_param_bytes": cast.stats().model_state_bytes["params"],
            "padded_params": sum(layout.padded_numel for layout in kept._owned.layouts.values())}


def bf16_against_fsdp2(rank, world_size, stage, steps=10, reduce_fp32=False, bucket_bytes=8 * 1024):
    """zerofx with MixedPrecision(bf16) and FSDP2 with the same MixedPrecisionPolicy, on the same data."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from nanogpt import param_groups

    torch.manual_seed(0)
    fsdp_model = gpt_and_adamw()[0]
    reduce_dtype = torch.float32 if reduce_fp32 else None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for block in fsdp_model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(fsdp_model, mp_policy=policy)
    fsdp_opt = torch.optim.AdamW(param_groups(fsdp_model, weight_decay=0.1), lr=3e-3)
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=bucket_bytes,
                          mixed_precision=zerofx.MixedPrecision(torch.bfloat16, reduce_dtype))
    ref_losses, losses = train_beside(train_step, step, (fsdp_model, fsdp_opt), (model, opt), token_batch, rank,
                                      steps)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    ours = zerofx.full_state_dict(step)["model"]
    for name, p in fsdp_model.named_parameters():
        full = p.full_tensor()
        assert ours[name].dtype == torch.float32 == full.dtype
        torch.testing.assert_close(ours[name], full, rtol=0, atol=1e-3, msg=name)
    return {"losses": losses, "fsdp_losses": ref_losses}


def _scaled_loss_step(model, optimizer, x, y, factor):
    optimizer.zero_grad()
    loss = model(x, y) * factor
    loss.backward()
    optimizer.step()
    return loss


def fp16_overflow_is_skipped(rank, world_size, stage, cast_at_gather=True):
    """Rank 1's loss is multiplied by 1e8 in step 3: fp16 gradients overflow; both ranks skip that step (the fp16
    shards kept with ``cast_at_gather=False`` too)."""
    model, opt = gpt_and_adamw()
    step = zerofx.compile(_scaled_loss_step, stage=stage, bucket_bytes=8 * 1024,
                          mixed_precision=zerofx.MixedPrecision(param_dtype=torch.float16,
                                                                cast_at_gather=cast_at_gather))
    one = torch.ones(())
    for i in range(3):
        step(model, opt, *token_batch(i, rank), one)
    before, scale_before = zerofx.full_state_dict(step), step.loss_scale
    compute_before = {fqn: t.clone() for fqn, t in step._owned.params.items()}
    overflow = torch.tensor(1e8 if rank == 1 else 1.0)
    step(model, opt, *token_batch(3, rank), overflow)
    after, scale_after = zerofx.full_state_dict(step), step.loss_scale
    unchanged = all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"]) and \
        all(torch.equal(t, step._owned.params[fqn]) for fqn, t in compute_before.items())
    state_unchanged = all(torch.equal(before["optimizer"]["state"][f][k], after["optimizer"]["state"][f][k])
                          for f in before["optimizer"]["state"] for k in before["optimizer"]["state"][f])
    step(model, opt, *token_batch(4, rank), one)
    trained = zerofx.full_state_dict(step)
    moved = any(not torch.equal(after["model"][k], trained["model"][k]) for k in after["model"])
    later = step.loss_scale
    assert after["loss_scale"] == {"scale": scale_after, "growth_tracker": 0}
    zerofx.load_state_dict(step, before)  # the scale is part of the state: loading restores it
    assert step.loss_scale == scale_before
    return {"unchanged": unchanged, "state_unchanged": state_unchanged, "scales": (scale_before, scale_after, later),
            "moved_after": moved, "traces": step.stats().traces}


class _Gated(torch.nn.Module):
    """A 0-dim parameter (a learned gate): its Adam moments are 0-dim like the step counter, and only they shard."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.tensor(0.5))
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        return ((self.fc(x).squeeze(-1) * self.gate - y) ** 2).mean()


def scalar_parameter_matches_ddp(rank, world_size, checkpoint_dir):
    """Stages 1-3 against DDP on a model with a 0-dim parameter, 5 Adam steps each; each saved and loaded back
    into a fresh step (a 0-dim ShardedTensor)."""
    results = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        ref = _Gated()
        ddp, ref_opt = DDP(ref), torch.optim.Adam(ref.parameters(), lr=0.1)
        torch.manual_seed(0)
        model = _Gated()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        step = zerofx.compile(train_step, stage=stage)
        batches = [(torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * i + rank)),
                    torch.randn(4, generator=torch.Generator().manual_seed(10 * i + rank + 5))) for i in range(5)]
        ref_losses = [train_step(ddp, ref_opt, x, y).item() for x, y in batches]
        losses = [step(model, opt, x, y).item() for x, y in batches]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        full = zerofx.full_state_dict(step)
        torch.testing.assert_close(full["model"]["gate"], ref.gate.detach(), rtol=1e-5, atol=1e-7)
        results[stage] = full["optimizer"]["state"]["gate"]["step"].item()
        zerofx.checkpoint.save(step, f"{checkpoint_dir}/{stage}")
        fresh = _Gated()
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        loaded = zerofx.compile(train_step, stage=stage).bind(fresh, fresh_opt, *batches[0])
        zerofx.checkpoint.load(loaded, f"{checkpoint_dir}/{stage}")
        again = zerofx.full_state_dict(loaded)
        assert torch.equal(again["model"]["gate"], full["model"]["gate"])
        moments = again["optimizer"]["state"]["gate"], full["optimizer"]["state"]["gate"]
        assert all(torch.equal(moments[0][k], moments[1][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    return results


def _autocast_step(dtype: torch.dtype, scaler):
    """The eager mixed-precision loop: forward under CPU autocast in ``dtype``, GradScaler with fp16."""
    def step(model, optimizer, x, y):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss
    return step


BATCHNORM_MODELS = {"linear": (bn_and_sgd, bn_batch), "conv": (conv_bn_and_sgd, image_batch)}


def batchnorm_against_ddp(rank, world_size, stage, precision, model="linear", steps=10):
    """A BatchNorm ``model`` with SGD momentum at ``stage`` beside DDP: in fp32 the same loop; with ``precision`` bf16 or
    fp16, zerofx's MixedPrecision beside DDP under autocast (and GradScaler for fp16, both from scale 2^10). The
    losses of both, and the largest differences of parameters and of running statistics after the steps (both
    data-parallel rank 0's, which each forward broadcasts), with the statistics' dtype."""
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaling = zerofx.LossScaling(2.0**10) if dtype == torch.float16 else None
    mixed = dtype and zerofx.MixedPrecision(dtype, loss_scaling=scaling)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaling else None
    make, batch = BATCHNORM_MODELS[model]
    (ref_model, ref_opt), (model, opt) = make(), make()
    step = zerofx.compile(train_step, stage=stage, mixed_precision=mixed)
    ref_step = train_step if dtype is None else _autocast_step(dtype, scaler)
    ref_losses, losses = train_beside(ref_step, step, (DDP(ref_model), ref_opt), (model, opt), batch, rank, steps)
    full, ref = zerofx.full_state_dict(step)["model"], ref_model.state_dict()
    buffers = [name for name, _ in ref_model.named_buffers() if ref[name].is_floating_point()]
    return {"losses": (losses, ref_losses),
            "param_difference": max((full[n] - p).abs().max().item() for n, p in ref_model.named_parameters()),
            "statistics_difference": max((full[n] - ref[n]).abs().max().item() for n in buffers),
            "statistics_dtypes": sorted({str(full[n].dtype) for n in buffers})}
