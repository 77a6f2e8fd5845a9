"""Training loops written the ways users write them, on every rank of a gloo pool; test_loops.py calls these.

Each case runs zerofx beside a referee that shares none of its code: DDP (fp32) or FSDP2 with the same
``MixedPrecisionPolicy`` (bf16, and float16 with ``torch.amp.GradScaler``), doing the same thing eagerly.
"""

import logging

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from cases_stages import _ddp_full_state
from models import gpt_and_adamw, token_batch, train_step
from nanogpt import param_groups

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _zero_grad_last(model, optimizer, x, y):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _zero_grad_last_keep(model, optimizer, x, y):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss


def _module_zero_grad_last(model, optimizer, x, y):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    model.zero_grad()
    return loss


LOOPS = {"zero_grad first": train_step, "zero_grad last": _zero_grad_last,
         "zero_grad last, set_to_none=False": _zero_grad_last_keep, "model.zero_grad() last": _module_zero_grad_last}


def assert_matches_ddp(step, ref_model, ref_opt, atol=1e-7):
    full = zerofx.full_state_dict(step)
    ref = _ddp_full_state(ref_model, ref_opt)
    for name, value in ref["model"].items():
        torch.testing.assert_close(full["model"][name], value, rtol=1e-5, atol=atol, msg=name)
    for name, state in ref["optimizer"].items():
        torch.testing.assert_close(full["optimizer"]["state"][name], state, rtol=1e-5, atol=atol, msg=name)


def zero_grad_anywhere(rank, world_size, stage, steps=5):
    """Every loop style against DDP written the same way; at stage 0 the peak of each, measured."""
    peaks, traces = {}, {}
    for name, fn in LOOPS.items():
        ref_model, ref_opt = gpt_and_adamw()
        ddp = DDP(ref_model)
        model, opt = gpt_and_adamw()
        step = zerofx.compile(fn, stage=stage, bucket_bytes=8 * 1024, track_memory=True)
        for i in range(steps):
            x, y = token_batch(i, rank)
            torch.testing.assert_close(step(model, opt, x, y).item(), fn(ddp, ref_opt, x, y).item(), rtol=1e-5,
                                       atol=0, msg=f"{name}, step {i}")
        assert_matches_ddp(step, ref_model, ref_opt)
        peaks[name], traces[name] = step.stats().peak_bytes, step.stats().traces
        # stage 0 leaves .grad as eager does (averaged, or None after zero_grad); from stage 1 on the step owns them
        for p, ref in zip(model.parameters(), ref_model.parameters()):
            if stage >= 1 or ref.grad is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-7, msg=name)
    return {"peaks": peaks, "traces": traces}


# --- a short last batch, an eval step, a weight-decay change -------------------------------------------------------

def _fsdp2_gpt(param_dtype):
    torch.manual_seed(0)
    model = gpt_and_adamw()[0]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)


def _reference(precision):
    """The eager referee and how it takes a step: DDP in fp32, FSDP2 in bf16, FSDP2 + GradScaler in float16."""
    if precision == "fp32":
        model, opt = gpt_and_adamw()
        ddp = DDP(model)
        return model, opt, lambda x, y: train_step(ddp, opt, x, y)
    model, opt = _fsdp2_gpt(PRECISIONS[precision])
    if precision == "bf16":
        return model, opt, lambda x, y: train_step(model, opt, x, y)
    scaler = torch.amp.GradScaler("cpu")

    def scaled_step(x, y):
        opt.zero_grad()
        loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss
    return model, opt, scaled_step


def changes_between_steps(rank, world_size, stage, precision):
    """Steps 0-1 as usual, then a short last batch, one step in eval mode, back to train, a weight-decay change."""
    ref_model, ref_opt, ref_step = _reference(precision)
    model, opt = gpt_and_adamw()
    mixed = zerofx.MixedPrecision(PRECISIONS[precision]) if PRECISIONS[precision] else None
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024, mixed_precision=mixed)
    schedule = {2: "short batch", 3: "eval", 4: "train", 5: "weight decay"}
    losses, ref_losses, messages = [], [], []
    handler = _Collect(messages)
    logging.getLogger("zerofx").addHandler(handler)
    try:
        for i in range(7):
            change = schedule.get(i)
            for m, o in ((model, opt), (ref_model, ref_opt)):
                if change == "eval":
                    m.eval()
                elif change == "train":
                    m.train()
                elif change == "weight decay":
                    o.param_groups[0]["weight_decay"] = 0.0
            x, y = token_batch(i, rank, batch=2 if change == "short batch" else 4)
            losses.append(step(model, opt, x, y).item())
            ref_losses.append(ref_step(x, y).item())
    finally:
        logging.getLogger("zerofx").removeHandler(handler)
    tolerance = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}[precision]
    torch.testing.assert_close(losses, ref_losses, rtol=tolerance, atol=0)
    return {"traces": step.stats().traces, "retraces": [m for m in messages if "re-tracing" in m],
            "losses": losses}


class _Collect(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record):
        self.into.append(record.getMessage())


# --- float16 with clip_grad_norm_ ------------------------------------------------------------------------------------

def _clipped(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optimizer.step()
    return loss, norm


def fp16_clip_against_grad_scaler(rank, world_size, stage, steps=5):
    """FSDP2 in float16 with GradScaler, ``unscale_`` then ``clip_grad_norm_``: the norm zerofx's step returns is the
    unscaled one, and the parameters after 5 steps agree within float16 rounding."""
    ref_model, ref_opt = _fsdp2_gpt(torch.float16)
    scaler = torch.amp.GradScaler("cpu")
    model, opt = gpt_and_adamw()
    step = zerofx.compile(_clipped, stage=stage, bucket_bytes=8 * 1024,
                          mixed_precision=zerofx.MixedPrecision(torch.float16))
    norms, ref_norms = [], []
    for i in range(steps):
        x, y = token_batch(i, rank)
        ref_opt.zero_grad()
        scaler.scale(ref_model(x, y)).backward()
        scaler.unscale_(ref_opt)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=0.5).full_tensor().item())
        scaler.step(ref_opt)
        scaler.update()
        norms.append(step(model, opt, x, y)[1].item())
    torch.testing.assert_close(norms, ref_norms, rtol=2e-2, atol=0)
    ours = zerofx.full_state_dict(step)["model"]
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(ours[name], p.full_tensor(), rtol=0, atol=2e-3, msg=name)
    return {"norms": norms, "scale": step.loss_scale, "ref_scale": scaler.get_scale()}
