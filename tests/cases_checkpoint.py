"""Sharded checkpoints on every rank of a gloo pool; test_checkpoint.py calls these."""

import dataclasses
import datetime
import hashlib
import os
import shutil

import torch
import torch.distributed as dist

import zerofx
from zerofx.collectives import gloo_one_worker
from zerofx.mixed_precision import LossScaling
from models import TINY_GPT, bn_and_sgd, bn_batch, gpt_and_adamw, token_batch, train_step
from nanogpt import GPTConfig

ODD_GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=30)  # sizes that need padding


def warmup_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 8))


def _train(step, model, opt, sched, batches):
    losses = []
    for x, y in batches:
        losses.append(step(model, opt, x, y).item())
        sched.step()
    return losses


def _fresh_process_group(rank, world_size, port):
    """A new default group on a new port: nothing of the saving run's group survives."""
    dist.destroy_process_group()
    dist.init_process_group(gloo_one_worker(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


PRECISIONS = {"fp32": None, "bf16": zerofx.MixedPrecision(torch.bfloat16),
              # the scale grows every 4 steps from 2^10: 2^11 with 2 good steps at the save, 2^12 after 10 steps
              "fp16": zerofx.MixedPrecision(torch.float16, loss_scaling=LossScaling(2.0**10, growth_interval=4))}


def _gpt_and_nadam(seed: int = 0):
    model, _ = gpt_and_adamw(seed)
    return model, torch.optim.NAdam(model.parameters(), lr=3e-3, weight_decay=0.01)


MODELS = {"gpt": (gpt_and_adamw, token_batch),
          "batchnorm": (bn_and_sgd, bn_batch),  # running statistics differ by rank: rank 0's go on training
          "nadam": (_gpt_and_nadam, token_batch)}  # a second per-parameter counter, mu_product, beside step


def resume_is_bitwise(rank, world_size, stage, checkpoint_dir, port, precision="fp32", model="gpt"):
    """6 steps, save, 4 steps; then a fresh group, a differently initialised model, load, the same 4 steps."""
    make, batch = MODELS[model]
    batches = [batch(i, rank) for i in range(10)]
    model, opt = make()
    sched = warmup_schedule(opt)
    mixed = PRECISIONS[precision]
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024, mixed_precision=mixed)
    _train(step, model, opt, sched, batches[:6])
    zerofx.checkpoint.save(step, checkpoint_dir, extra={"scheduler": sched, "data": {"position": torch.tensor(6)}})
    uninterrupted = _train(step, model, opt, sched, batches[6:])
    final, scale = zerofx.full_state_dict(step), step.loss_scale

    _fresh_process_group(rank, world_size, port)
    model, opt = make(seed=7)
    sched, data = warmup_schedule(opt), {"position": torch.tensor(0)}
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024, mixed_precision=mixed)
    step.bind(model, opt, *batches[0])
    zerofx.checkpoint.load(step, checkpoint_dir, extra={"scheduler": sched, "data": data})
    position = int(data["position"])
    resumed = _train(step, model, opt, sched, batches[position:])
    again = zerofx.full_state_dict(step)
    assert resumed == uninterrupted, (resumed, uninterrupted)
    different = [k for k in final["model"] if not torch.equal(final["model"][k], again["model"][k])]
    different += [f"{f}.{k}" for f, s in final["optimizer"]["state"].items() for k in s
                  if not torch.equal(s[k], again["optimizer"]["state"][f][k])]
    assert not different, different
    assert step.loss_scale == scale
    return {"position": position, "lr": opt.param_groups[0]["lr"], "traces": step.stats().traces, "scale": scale}


def _global_batch(i, rank, world_size, saved_world=4):
    """Step ``i``'s batch for ``rank`` of ``world_size``: the saving run's ranks' batches, split evenly."""
    per = saved_world // world_size
    parts = [token_batch(i, r, cfg=ODD_GPT) for r in range(rank * per, (rank + 1) * per)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _mean_over_ranks(losses):
    t = torch.tensor(losses, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def save_at_four_ranks(rank, world_size, checkpoint_dir):
    """Stage 3 on 4 ranks: 6 steps, save, 4 more; the global mean loss of those 4 is the reference."""
    model, opt = gpt_and_adamw(cfg=ODD_GPT)
    step = zerofx.compile(train_step, stage=3, bucket_bytes=8 * 1024)
    for i in range(6):
        step(model, opt, *token_batch(i, rank, cfg=ODD_GPT))
    zerofx.checkpoint.save(step, checkpoint_dir)
    return _mean_over_ranks([step(model, opt, *token_batch(i, rank, cfg=ODD_GPT)).item() for i in range(6, 10)])


def resume_elsewhere(rank, world_size, checkpoint_dir, stage):
    """Load the 4-rank checkpoint on ``world_size`` ranks at ``stage`` and train the same global batches."""
    model, opt = gpt_and_adamw(seed=7, cfg=ODD_GPT)
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024)
    step.bind(model, opt, *_global_batch(6, rank, world_size))
    zerofx.checkpoint.load(step, checkpoint_dir)
    return _mean_over_ranks([step(model, opt, *_global_batch(i, rank, world_size)).item() for i in range(6, 10)])


def _fsdp2_gpt():
    from torch.distributed.fsdp import fully_shard

    model, opt = gpt_and_adamw()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    from nanogpt import param_groups
    return model, torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)


def round_trip_with_fsdp2(rank, world_size, from_fsdp2_dir, from_zerofx_dir):
    """FSDP2 saves with get_state_dict, zerofx (stage 3) loads and trains on; zerofx saves, a new FSDP2 loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fsdp_model, fsdp_opt = _fsdp2_gpt()
    for i in range(3):
        train_step(fsdp_model, fsdp_opt, *token_batch(i, rank))
    model_sd, optim_sd = get_state_dict(fsdp_model, fsdp_opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=from_fsdp2_dir)

    model, opt = gpt_and_adamw(seed=7)
    step = zerofx.compile(train_step, stage=3, bucket_bytes=8 * 1024).bind(model, opt, *token_batch(3, rank))
    zerofx.checkpoint.load(step, from_fsdp2_dir)
    fsdp_losses, losses = [], []
    for i in range(3, 6):
        fsdp_losses.append(train_step(fsdp_model, fsdp_opt, *token_batch(i, rank)).item())
        losses.append(step(model, opt, *token_batch(i, rank)).item())
    torch.testing.assert_close(losses, fsdp_losses, rtol=1e-5, atol=0)

    zerofx.checkpoint.save(step, from_zerofx_dir)
    fresh_model, fresh_opt = _fsdp2_gpt()
    train_step(fresh_model, fresh_opt, *token_batch(99, rank))  # Adam's state exists only after a first step
    model_sd, optim_sd = get_state_dict(fresh_model, fresh_opt)
    target = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(target, checkpoint_id=from_zerofx_dir)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    fsdp_losses, losses = [], []
    for i in range(6, 9):
        fsdp_losses.append(train_step(fresh_model, fresh_opt, *token_batch(i, rank)).item())
        losses.append(step(model, opt, *token_batch(i, rank)).item())
    torch.testing.assert_close(fsdp_losses, losses, rtol=1e-5, atol=0)
    return {"keys": sorted(model_sd)}


def _digest(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def bad_checkpoints(rank, world_size, checkpoint_dir):
    """Each bad checkpoint raises CheckpointError on every rank; neither the step's state nor a file changes."""
    model, opt = gpt_and_adamw()
    step = zerofx.compile(train_step, stage=3, bucket_bytes=8 * 1024)
    step(model, opt, *token_batch(0, rank))
    zerofx.checkpoint.save(step, checkpoint_dir)
    if rank == 0:
        _spoil(checkpoint_dir)
    dist.barrier()
    spoiled = ("rank_file_missing", "truncated", "unfinished")
    directories = [checkpoint_dir] + [f"{checkpoint_dir}-{name}" for name in spoiled]
    digests_before = [_digest(d) for d in directories]
    errors = {}
    cases = {
        "deeper": dataclasses.replace(TINY_GPT, n_layer=3),
        "shallower": dataclasses.replace(TINY_GPT, n_layer=1),
        "narrower": dataclasses.replace(TINY_GPT, n_embd=16),
    }
    for name, cfg in cases.items():
        other_model, other_opt = gpt_and_adamw(cfg=cfg)
        other = zerofx.compile(train_step, stage=3).bind(other_model, other_opt, *token_batch(0, rank, cfg=cfg))
        errors[name] = _failed_load(other, checkpoint_dir)
    for name in spoiled:
        before = zerofx.full_state_dict(step)
        errors[name] = _failed_load(step, f"{checkpoint_dir}-{name}")
        after = zerofx.full_state_dict(step)
        assert all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"]), name
    dist.all_reduce(torch.ones(1))  # the group is still usable
    return {"errors": errors, "files_unchanged": digests_before == [_digest(d) for d in directories]}


def _spoil(checkpoint_dir):
    for name in ("rank_file_missing", "truncated", "unfinished"):
        shutil.copytree(checkpoint_dir, f"{checkpoint_dir}-{name}")
    os.remove(f"{checkpoint_dir}-rank_file_missing/__1_0.distcp")
    path = f"{checkpoint_dir}-truncated/__0_0.distcp"
    os.truncate(path, os.path.getsize(path) // 2)
    os.remove(f"{checkpoint_dir}-unfinished/.metadata")


def _failed_load(step, checkpoint_dir):
    try:
        zerofx.checkpoint.load(step, checkpoint_dir)
    except zerofx.CheckpointError as e:
        return str(e)
    raise AssertionError(f"loading {checkpoint_dir} did not fail")
