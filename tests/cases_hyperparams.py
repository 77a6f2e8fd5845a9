"""Scheduled hyperparameters on every rank of a gloo pool; test_hyperparams.py calls these."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from models import gpt_and_adamw, token_batch, train_step


def _gpt_one_cycle_sgd():
    model, _ = gpt_and_adamw()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10, cycle_momentum=True)


def one_cycle_sgd_matches_ddp(rank, world_size, stage, steps=10):
    ref_model, ref_opt, ref_scheduler = _gpt_one_cycle_sgd()
    ddp = DDP(ref_model)
    model, opt, scheduler = _gpt_one_cycle_sgd()
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024)
    ref_losses, losses = [], []
    for i in range(steps):
        x, y = token_batch(i, rank)
        ref_losses.append(train_step(ddp, ref_opt, x, y).item())
        losses.append(step(model, opt, x, y).item())
        ref_scheduler.step()
        scheduler.step()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    full = zerofx.full_state_dict(step)
    names = {id(p): n for n, p in ref_model.named_parameters()}
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(full["model"][name], value, rtol=1e-5, atol=1e-7, msg=name)
    for p, state in ref_opt.state.items():
        torch.testing.assert_close(full["optimizer"]["state"][names[id(p)]], state, rtol=1e-5, atol=1e-7,
                                   msg=names[id(p)])
    return {"traces": step.stats().traces, "momentum": opt.param_groups[0]["momentum"]}


def _gpt_adam_with_tensors():
    """Adam with lr and betas given as tensors (as torch.compile users give them), lr under a warm-up schedule, which
    fills the tensor in place; weight decay as a tensor too, compared with zero by torch.optim."""
    model, _ = gpt_and_adamw()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(3e-3), betas=(torch.tensor(0.9), torch.tensor(0.99)),
                           weight_decay=torch.tensor(1e-2))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))


def tensor_hyperparameters_match_ddp(rank, world_size, stage, steps=6):
    """Bitwise: torch.optim computes the step size in the tensor's float32, and so must the graph."""
    ref_model, ref_opt, ref_scheduler = _gpt_adam_with_tensors()
    ddp = DDP(ref_model)
    model, opt, scheduler = _gpt_adam_with_tensors()
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024)
    for i in range(steps):
        x, y = token_batch(i, rank)
        assert step(model, opt, x, y).item() == train_step(ddp, ref_opt, x, y).item(), i
        ref_scheduler.step()
        scheduler.step()
    full = zerofx.full_state_dict(step)
    names = {id(p): n for n, p in ref_model.named_parameters()}
    for name, value in ref_model.state_dict().items():
        assert torch.equal(full["model"][name], value), name
    for p, state in ref_opt.state.items():
        for key, value in state.items():
            assert torch.equal(full["optimizer"]["state"][names[id(p)]][key], value), (names[id(p)], key)
    return {"traces": step.stats().traces, "lr": opt.param_groups[0]["lr"]}
