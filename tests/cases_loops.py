"""Training loops written the ways users write them, on every rank of a gloo pool; test_loops.py calls these.

Each case runs zerofx beside a referee that shares none of its code: DDP (fp32) or FSDP2 with the same
``MixedPrecisionPolicy`` (bf16, and float16 with ``torch.amp.GradScaler``), doing the same thing eagerly.
"""

import functools
import logging

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from cases_stages import _ddp_full_state
from models import accumulating_train_step, gpt_and_adamw, mlp_and_adamw, regression_step, token_batch, train_step
from nanogpt import param_groups

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _zero_grad_last(model, optimizer, x, y, set_to_none=True):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return loss


def _module_zero_grad_last(model, optimizer, x, y):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    model.zero_grad()
    return loss


def _zero_grad_first_keeping_zeros(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=False)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


LOOPS = {"zero_grad first": train_step, "zero_grad last": _zero_grad_last,
         "zero_grad(set_to_none=False) first": _zero_grad_first_keeping_zeros,
         # a functools.partial, as users bind extra arguments: it has no __name__ of its own
         "zero_grad last, set_to_none=False": functools.partial(_zero_grad_last, set_to_none=False),
         "model.zero_grad() last": _module_zero_grad_last}


def assert_matches_ddp(step, ref_model, ref_opt, atol=1e-7):
    full = zerofx.full_state_dict(step)
    ref = _ddp_full_state(ref_model, ref_opt)
    for name, value in ref["model"].items():
        torch.testing.assert_close(full["model"][name], value, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
    for name, state in ref["optimizer"].items():
        torch.testing.assert_close(full["optimizer"]["state"][name], state, rtol=1e-5, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def zero_grad_anywhere(rank, world_size, stage, memory_plan=None, steps=5):
    """Every loop style against DDP written the same way; at stage 0 the peak of each, measured."""
    peaks, traces = {}, {}
    for name, fn in LOOPS.items():
        ref_model, ref_opt = gpt_and_adamw()
        ddp = DDP(ref_model)
        model, opt = gpt_and_adamw()
        step = zerofx.compile(fn, stage=stage, bucket_bytes=8 * 1024, track_memory=stage == 0,  # peaks: stage 0
                              memory_plan=memory_plan)
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

def _adamw(model):
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)


def _fsdp2_gpt(param_dtype, optimizer=_adamw):
    torch.manual_seed(0)
    model = gpt_and_adamw()[0]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, optimizer(model)


def reference(precision, optimizer=_adamw):
    """The eager referee and how it takes a step: DDP in fp32, FSDP2 in bf16, FSDP2 + GradScaler in float16.
    ``optimizer`` makes the optimizer from the model."""
    if precision == "fp32":
        model = gpt_and_adamw()[0]
        opt = optimizer(model)
        ddp = DDP(model)
        return model, opt, lambda x, y: train_step(ddp, opt, x, y)
    model, opt = _fsdp2_gpt(PRECISIONS[precision], optimizer)
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
    ref_model, ref_opt, ref_step = reference(precision)
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


def _train_or_evaluate(model, optimizer, x, y):
    """One step function for both, as users write it: in eval mode, the loss under no_grad and no update."""
    if not model.training:
        with torch.no_grad():
            return model(x, y)
    return train_step(model, optimizer, x, y)


def evaluate_between_steps(rank, world_size, stage, precision):
    """An evaluation through the step before any training (it takes nothing yet), two steps, an evaluation (its
    graph reads the parameters the step owns by then), a step, an evaluation, against the referee in eval mode."""
    ref_model, ref_opt, ref_step = reference(precision)
    model, opt = gpt_and_adamw()
    mixed = zerofx.MixedPrecision(PRECISIONS[precision]) if PRECISIONS[precision] else None
    step = zerofx.compile(_train_or_evaluate, stage=stage, bucket_bytes=8 * 1024, mixed_precision=mixed)
    losses, ref_losses = [], []
    for i, mode in enumerate(["eval", "train", "train", "eval", "train", "eval"]):
        for m in (model, ref_model):
            m.train(mode == "train")
        x, y = token_batch(i, rank)
        losses.append(step(model, opt, x, y).item())
        if mode == "train":
            ref_losses.append(ref_step(x, y).item())
        else:
            with torch.no_grad():
                ref_losses.append(ref_model(x, y).item())
    tolerance = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}[precision]
    torch.testing.assert_close(losses, ref_losses, rtol=tolerance, atol=0)
    if precision == "fp32":
        assert_matches_ddp(step, ref_model, ref_opt)
    return {"traces": step.stats().traces}


def float_batch_in_bf16_against_fsdp2(rank, world_size, stage, steps=4):
    """A batch of floats (features, as an image batch is): cast to bf16 as it enters the model, as FSDP2's policy
    casts a sharded module's forward inputs."""
    ref_model, ref_opt = mlp_and_adamw()
    fully_shard(ref_model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    model, opt = mlp_and_adamw()
    step = zerofx.compile(regression_step, stage=stage, mixed_precision=zerofx.MixedPrecision(torch.bfloat16))
    losses, ref_losses = [], []
    for i in range(steps):
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        losses.append(step(model, opt, x, y).item())
        ref_losses.append(regression_step(ref_model, ref_opt, x, y).item())
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    return losses


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


def fp16_clip_against_grad_scaler(rank, world_size, stage, steps=5, bucket_bytes=8 * 1024, cast_at_gather=True):
    """FSDP2 in float16 with GradScaler, ``unscale_`` then ``clip_grad_norm_``: the norm zerofx's step returns is the
    unscaled one, and the parameters after 5 steps agree within float16 rounding. Both start from a scale of 2^10,
    at which no step overflows, so every step's norm is compared."""
    ref_model, ref_opt = _fsdp2_gpt(torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model, opt = gpt_and_adamw()
    scaling = zerofx.LossScaling(init_scale=2.0**10)
    step = zerofx.compile(_clipped, stage=stage, bucket_bytes=bucket_bytes,
                          mixed_precision=zerofx.MixedPrecision(torch.float16, loss_scaling=scaling,
                                                                cast_at_gather=cast_at_gather))
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
        ref, mine = p.full_tensor(), ours[name]
        if name.endswith("attn.qkv.bias"):
            # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift along a query's row), so
            # in float16 it is rounding noise and Adam moves it by +-lr on it: only that bound holds there.
            width = ref.numel() // 3
            key = slice(width, 2 * width)
            assert (mine[key] - ref[key]).abs().max() <= 2 * steps * opt.param_groups[0]["lr"], name
            ref, mine = torch.cat([ref[:width], ref[2 * width:]]), torch.cat([mine[:width], mine[2 * width:]])
        torch.testing.assert_close(mine, ref, rtol=0, atol=2e-3, msg=name)
    return {"norms": norms, "scale": step.loss_scale, "ref_scale": scaler.get_scale()}


def _update_unless_evaluating(model, optimizer, x, y):
    """``_update_without_zero_grad`` updating every call, and an evaluation in eval mode (no backward)."""
    if not model.training:
        with torch.no_grad():
            return model(x, y)
    return _update_without_zero_grad(model, optimizer, x, y, update=True)


def fp16_updates_without_zero_grad_in_the_step_against_grad_scaler(rank, world_size, stage, calls=6):
    """An update every call, ``zero_grad()`` outside the step (set to None, zeroed) or nowhere, and an evaluation
    through the step after the third call and a short last batch, against FSDP2 in float16 with GradScaler doing the same: where nothing
    resets ``.grad`` between an update and the next backward, eager adds the scaled gradients to the unscaled ones
    ``unscale_`` left and unscales the sum; the evaluation leaves them as they are. Both start from a scale of 2^10,
    at which no step overflows. Returns per loop how far the parameters' updates are from FSDP2's."""
    update_error = {}
    for name, outside in {"no zero_grad() anywhere": None, "zero_grad() outside, set to None": True,
                          "zero_grad() outside, zeroed": False}.items():
        ref_model, ref_opt = _fsdp2_gpt(torch.float16)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        model, opt = gpt_and_adamw()
        step = zerofx.compile(_update_unless_evaluating, stage=stage, bucket_bytes=8 * 1024,
                              mixed_precision=zerofx.MixedPrecision(
                                  torch.float16, loss_scaling=zerofx.LossScaling(init_scale=2.0**10)))
        for i in range(calls):
            x, y = token_batch(i, rank, batch=2 if i == calls - 1 else 4)  # a short last batch
            scaler.scale(ref_model(x, y) / 2).backward()  # what _update_without_zero_grad does, scaled
            scaler.step(ref_opt)
            scaler.update()
            step(model, opt, x, y)
            if outside is not None:
                ref_opt.zero_grad(set_to_none=outside)
                opt.zero_grad(set_to_none=outside)
            if i == 2:
                model.eval(), ref_model.eval()
                with torch.no_grad():
                    want = ref_model(x, y).item()
                torch.testing.assert_close(step(model, opt, x, y).item(), want, rtol=1e-2, atol=0)
                model.train(), ref_model.train()
        assert step.loss_scale == scaler.get_scale() == 2.0**10, name
        update_error[name] = _update_error(zerofx.full_state_dict(step), ref_model)
    return update_error


# --- frozen parameters -----------------------------------------------------------------------------------------------

FROZEN = ("wpe.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.1.mlp.0.weight")


def _freeze(model, names=FROZEN):
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)


def frozen_bf16_against_fsdp2(rank, world_size, stage, steps=6):
    """Frozen parameters computed in bf16 beside trainable ones, FSDP2 with the same frozen set and policy."""
    torch.manual_seed(0)
    ref_model = gpt_and_adamw()[0]
    _freeze(ref_model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in ref_model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(ref_model, mp_policy=policy)
    ref_opt = torch.optim.AdamW(param_groups(ref_model, weight_decay=0.1), lr=3e-3)
    model, opt = gpt_and_adamw()
    _freeze(model)
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024,
                          mixed_precision=zerofx.MixedPrecision(torch.bfloat16))
    losses = [step(model, opt, *token_batch(i, rank)).item() for i in range(steps)]
    ref_losses = [train_step(ref_model, ref_opt, *token_batch(i, rank)).item() for i in range(steps)]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    ours = zerofx.full_state_dict(step)["model"]
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(ours[name], p.full_tensor(), rtol=0, atol=1e-3, msg=name)
        if name in FROZEN:
            assert torch.equal(ours[name], gpt_and_adamw()[0].state_dict()[name]), name  # never moved
    return {"losses": losses, "num_params": step.stats().num_params}


def unfreeze_against_ddp(rank, world_size, stage, steps=6, unfreeze_at=2):
    """A parameter frozen for two steps, then trained: the step re-traces, takes it, and trains it as DDP does
    (DDP is built again after the change, since it reduces only what required grad when it was built)."""
    ref_model, ref_opt = gpt_and_adamw()
    _freeze(ref_model, ("wpe.weight",))
    ddp = DDP(ref_model)
    model, opt = gpt_and_adamw()
    _freeze(model, ("wpe.weight",))
    step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024)
    for i in range(steps):
        if i == unfreeze_at:
            model.wpe.weight.requires_grad_(True)
            ref_model.wpe.weight.requires_grad_(True)
            ddp = DDP(ref_model)
        x, y = token_batch(i, rank)
        torch.testing.assert_close(step(model, opt, x, y).item(), train_step(ddp, ref_opt, x, y).item(),
                                   rtol=1e-5, atol=0, msg=f"step {i}")
    assert_matches_ddp(step, ref_model, ref_opt)
    trained = zerofx.full_state_dict(step)["model"]["wpe.weight"]
    return {"traces": step.stats().traces, "moved": not torch.equal(trained, gpt_and_adamw()[0].wpe.weight),
            "released": model.wpe.weight.numel()}


# --- two optimizers --------------------------------------------------------------------------------------------------

def _two_optimizer_step(model, adamw, sgd, x, y, poison):
    adamw.zero_grad()
    sgd.zero_grad()
    bias = getattr(model, "module", model).ln_f.bias  # under DDP, the wrapped module's
    loss = model(x, y) + (bias * poison).sum()  # poison: 0, or inf into a parameter of the second optimizer
    loss.backward()
    adamw.step()
    sgd.step()
    return loss


def _two_optimizers(model):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(matrices, lr=3e-3, weight_decay=0.1), torch.optim.SGD(rest, lr=0.05, momentum=0.9)


def two_optimizers_against_ddp(rank, world_size, stage, steps=5):
    ref_model = gpt_and_adamw()[0]
    ref_adamw, ref_sgd = _two_optimizers(ref_model)
    ddp = DDP(ref_model)
    model = gpt_and_adamw()[0]
    adamw, sgd = _two_optimizers(model)
    step = zerofx.compile(_two_optimizer_step, stage=stage, bucket_bytes=8 * 1024)
    clean = torch.zeros(())
    for i in range(steps):
        x, y = token_batch(i, rank)
        torch.testing.assert_close(step(model, adamw, sgd, x, y, clean).item(),
                                   _two_optimizer_step(ddp, ref_adamw, ref_sgd, x, y, clean).item(),
                                   rtol=1e-5, atol=0, msg=f"step {i}")
    full = zerofx.full_state_dict(step)
    names = {id(p): n for n, p in ref_model.named_parameters()}
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(full["model"][name], value, rtol=1e-5, atol=1e-7, msg=name)
    for oi, ref_opt in enumerate((ref_adamw, ref_sgd)):
        for p, state in ref_opt.state.items():
            torch.testing.assert_close(full["optimizer"][oi]["state"][names[id(p)]], state, rtol=1e-5, atol=1e-7)
    stats = step.stats()
    return {"k": stats.formula.bytes_per_element[zerofx.formulas.K], "num_params": stats.num_params}


def two_optimizers_fp16_overflow(rank, world_size, stage):
    """One scale update per step whatever the number of optimizers; an inf on rank 1 only, in a parameter the
    second optimizer updates, skips the step on every rank."""
    model = gpt_and_adamw()[0]
    adamw, sgd = _two_optimizers(model)
    scaling = zerofx.LossScaling(init_scale=2.0**10, growth_interval=1)
    step = zerofx.compile(_two_optimizer_step, stage=stage, bucket_bytes=8 * 1024,
                          mixed_precision=zerofx.MixedPrecision(torch.float16, loss_scaling=scaling))
    clean = torch.zeros(())
    scales = []
    for i in range(4):
        step(model, adamw, sgd, *token_batch(i, rank), clean)
        scales.append(step.loss_scale)
    before = zerofx.full_state_dict(step)
    poison = torch.tensor(float("inf") if rank == 1 else 0.0)
    step(model, adamw, sgd, *token_batch(4, rank), poison)
    after = zerofx.full_state_dict(step)
    for name in before["model"]:
        assert torch.equal(before["model"][name], after["model"][name]), name
    for oi in (0, 1):
        for name, state in before["optimizer"][oi]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, after["optimizer"][oi]["state"][name][key]), (oi, name, key)
    return {"scales": scales, "after_overflow": step.loss_scale}


# --- gradients accumulated across calls: an update every k-th call -------------------------------------------------

def _update_when_told(model, optimizer, x, y, update):
    """The loop of ``gradient_accumulation_steps``: backward every call, the update every k-th."""
    if not model.training:
        with torch.no_grad():
            return model(x, y)
    loss = model(x, y)
    (loss / 2).backward()
    if update:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _update_without_zero_grad(model, optimizer, x, y, update):
    """zero_grad() outside the step (after an update, and to drop a window's gradients: a bad batch), or nowhere
    (each update steps with the sum of every gradient so far)."""
    loss = model(x, y)
    (loss / 2).backward()
    if update:
        optimizer.step()
    return loss


def _zero_grad_opening_each_window(model, optimizer, x, y, update, zero_grad_of="optimizer"):
    """``update``: "first", "middle" or "last" call of the window; ``zero_grad_of`` the optimizer or the model."""
    if not model.training:
        with torch.no_grad():
            return model(x, y)
    if update == "first":
        (optimizer if zero_grad_of == "optimizer" else model).zero_grad()
    loss = model(x, y)
    (loss / 2).backward()
    if update == "last":
        optimizer.step()
    return loss


def _head_every_call_body_every_other(model, adamw, sgd, x, y, update):
    """Two optimizers: ``sgd`` steps every call, ``adamw`` when told."""
    if not model.training:
        with torch.no_grad():
            return model(x, y)
    sgd.zero_grad()
    loss = model(x, y)
    loss.backward()
    sgd.step()
    if update:
        adamw.step()
        adamw.zero_grad()
    return loss


# (train, update) per call: a window of two, an evaluation inside a window, a window of three
DROPPED_WINDOW_AT = 3  # where a loop that zeroes gradients outside the step drops the window's first call's
_CALLS = [(True, False), (False, False), (True, True), (True, False), (True, True), (True, False), (True, False),
          (True, True)]


def accumulate_across_calls_against_the_referee(rank, world_size, stage, precision="fp32", memory_plan=None):
    """Each loop against the referee written the same way: DDP in fp32 (it all-reduces every backward: the same
    sums), FSDP2 in bf16 (it reduce-scatters every backward and accumulates fp32 shards). Returns, per loop, the
    bytes of the gradients the step keeps between the calls of a window and its traces; the data collectives of
    each call of the first loop; in bf16, how far the parameters' updates are from FSDP2's."""
    kept, traces, sent, update_error = {}, {}, [], {}
    loops = {"update every k-th call": (_update_when_told, None),
             "zero_grad() outside, set to None": (_update_without_zero_grad, True),
             "zero_grad() outside, zeroed": (_update_without_zero_grad, False),
             "zero_grad() opening each window": (_zero_grad_opening_each_window, None),
             "model.zero_grad() opening each window": (
                 functools.partial(_zero_grad_opening_each_window, zero_grad_of="model"), None),
             "two optimizers": (_head_every_call_body_every_other, None),
             "no zero_grad() anywhere": (_update_without_zero_grad, None)}
    mixed = zerofx.MixedPrecision(PRECISIONS[precision]) if precision != "fp32" else None
    for name, (fn, outside) in loops.items():
        ref_model, referee = _referee(precision)
        model = gpt_and_adamw()[0]
        if fn is _head_every_call_body_every_other:
            ref_opts, opts = _two_optimizers(ref_model), _two_optimizers(model)
        else:
            ref_opts, opts = (torch.optim.AdamW(ref_model.parameters(), lr=3e-3),), \
                (torch.optim.AdamW(model.parameters(), lr=3e-3),)
        step = zerofx.compile(fn, stage=stage, bucket_bytes=8 * 1024, memory_plan=memory_plan, mixed_precision=mixed)
        kept[name] = []
        for i, (train, update) in enumerate(_CALLS):
            x, y = token_batch(i, rank)
            ref_model.train(train), model.train(train)
            if getattr(fn, "func", fn) is _zero_grad_opening_each_window:
                update = "last" if update else "first" if i == 0 or _CALLS[i - 1][1] else "middle"
            # DDP's own forward under no_grad inside a window changes its next reduction: evaluate its module
            torch.testing.assert_close(step(model, *opts, x, y, update).item(),
                                       fn(referee if train else ref_model, *ref_opts, x, y, update).item(),
                                       rtol=1e-5 if mixed is None else 1e-2, atol=0, msg=f"{name}, call {i}")
            if outside is not None and (update or i == DROPPED_WINDOW_AT):
                for o in (*opts, *ref_opts):
                    o.zero_grad(set_to_none=outside)
            kept[name].append(sum(g.numel() * g.element_size() for g in getattr(step._owned, "kept_grads", {}).values()))
            if name == "update every k-th call":  # elements each kind of data collective moved, this call
                records = [r for r in step.stats().collectives if r.purpose == "data"]
                sent.append({kind: sum(r.numel - r.carried for r in records if r.kind == kind)
                             for kind in sorted({r.kind for r in records})})
        full = zerofx.full_state_dict(step)
        traces[name] = step.stats().traces
        if mixed is not None:
            update_error[name] = _update_error(full, ref_model)
            continue
        names = {id(p): n for n, p in ref_model.named_parameters()}
        # DDP averages the accumulated gradient, zerofx the call's alone and adds: sums in another order, whose
        # rounding AdamW turns into up to 2e-6 where a gradient is near zero (the attention's key biases), and up to
        # 6e-6 where every update's sum carries all the calls before it (dropping those is 1e-2 off)
        atol = 1e-5 if name == "no zero_grad() anywhere" else 5e-6
        for param_name, value in ref_model.state_dict().items():
            torch.testing.assert_close(full["model"][param_name], value, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"{name}: {param_name}: {m}")
        by_optimizer = full["optimizer"] if len(ref_opts) > 1 else [full["optimizer"]]
        for ref_opt, opt_full in zip(ref_opts, by_optimizer):
            for p, state in ref_opt.state.items():
                torch.testing.assert_close(opt_full["state"][names[id(p)]], state, rtol=1e-5, atol=atol)
    return {"kept": kept, "traces": traces, "sent": sent, "update_error": update_error}


def _referee(precision: str):
    """The model the referee trains, and what the loop calls: DDP over it in fp32, the model itself sharded by FSDP2
    in bf16 (the caller makes the optimizer)."""
    if precision == "fp32":
        model = gpt_and_adamw()[0]
        return model, DDP(model)
    model = _fsdp2_gpt(PRECISIONS[precision], optimizer=lambda m: None)[0]
    return model, model


def _update_error(full: dict, fsdp2_model) -> float:
    """How far the parameters' updates since the start (``full``: zerofx's full state dict) are from FSDP2's."""
    initial = gpt_and_adamw()[0].state_dict()
    ours = torch.cat([(full["model"][n] - initial[n]).flatten() for n, _ in fsdp2_model.named_parameters()])
    theirs = torch.cat([(p.full_tensor() - initial[n]).flatten() for n, p in fsdp2_model.named_parameters()])
    return ((ours - theirs).norm() / theirs.norm()).item()


# --- the update first, with the gradients the last call left (stage 0) ---------------------------------------------

def _update_then_backward(model, optimizer, x, y):
    """The update with the gradients the last call left (the first call has none), then this call's backward."""
    optimizer.step()
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    return loss


def update_first_against_the_referee(rank, world_size, precision, steps=4):
    """At stage 0 a step that updates before its backward keeps the gradients it leaves for the next call's update
    (under mixed precision the fp32 masters'): against DDP in fp32 and FSDP2 in bf16. Returns the bytes of the
    gradients left after each call and, in bf16, how far the parameters' updates are from FSDP2's."""
    ref_model, referee = _referee(precision)
    model = gpt_and_adamw()[0]
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ref_model, model))
    mixed = zerofx.MixedPrecision(PRECISIONS[precision]) if precision != "fp32" else None
    step = zerofx.compile(_update_then_backward, mixed_precision=mixed)
    left = []
    for i in range(steps):
        x, y = token_batch(i, rank)
        torch.testing.assert_close(step(model, opt, x, y).item(), _update_then_backward(referee, ref_opt, x, y).item(),
                                   rtol=1e-5 if mixed is None else 1e-2, atol=0, msg=f"call {i}")
        left.append(sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None))
    if mixed is None:
        assert_matches_ddp(step, ref_model, ref_opt)
        return {"left": left}
    return {"left": left, "update_error": _update_error(zerofx.full_state_dict(step), ref_model)}


# --- micro-batches inside one call ---------------------------------------------------------------------------------

def microbatches_in_bf16_against_fsdp2(rank, world_size, stage, steps=3):
    """Two micro-batches per call in bf16 against FSDP2, which reduces each backward's gradients and sums them into
    fp32 shards. Returns how far the parameters' updates are from FSDP2's."""
    ref_model = _fsdp2_gpt(torch.bfloat16, optimizer=lambda m: None)[0]
    model = gpt_and_adamw()[0]
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ref_model, model))
    step = zerofx.compile(accumulating_train_step, stage=stage,
                          mixed_precision=zerofx.MixedPrecision(torch.bfloat16))
    for i in range(steps):
        x, y = token_batch(i, rank, batch=8)
        torch.testing.assert_close(step(model, opt, x, y), accumulating_train_step(ref_model, ref_opt, x, y),
                                   rtol=1e-2, atol=0, msg=f"call {i}")
    return _update_error(zerofx.full_state_dict(step), ref_model)


# --- optimizer.step(closure) ---------------------------------------------------------------------------------------

def _update_with_a_closure(model, optimizer, x, y):
    """The update re-evaluating the loss through a closure, as trainers written for LBFGS-style optimizers do."""
    def closure():
        optimizer.zero_grad()
        loss = model(x, y)
        loss.backward()
        return loss
    return optimizer.step(closure)


def closure_against_the_referee(rank, world_size, stage, precision, steps=4):
    """``optimizer.step(closure)`` against the referee taking the same closure (DDP, FSDP2), in float16 against
    GradScaler's loop written out (GradScaler takes no closure). Returns how far the parameters' updates are from
    FSDP2's (None in fp32, where parameters and optimizer state are compared with DDP's)."""
    if precision == "fp16":
        ref_model, ref_opt, ref_step = reference(precision)
    else:
        ref_model, referee = _referee(precision)
        ref_opt = _adamw(ref_model)
        ref_step = functools.partial(_update_with_a_closure, referee, ref_opt)
    model, opt = gpt_and_adamw()
    mixed = zerofx.MixedPrecision(PRECISIONS[precision]) if PRECISIONS[precision] else None
    step = zerofx.compile(_update_with_a_closure, stage=stage, mixed_precision=mixed)
    for i in range(steps):
        x, y = token_batch(i, rank)
        torch.testing.assert_close(step(model, opt, x, y).item(), ref_step(x, y).item(),
                                   rtol=1e-5 if mixed is None else 1e-2, atol=0, msg=f"call {i}")
    if mixed is None:
        assert_matches_ddp(step, ref_model, ref_opt)
        return None
    return _update_error(zerofx.full_state_dict(step), ref_model)


# --- autocast inside the step ----------------------------------------------------------------------------------------

def _autocast_in_the_step(model, optimizer, x, y):
    """Mixed precision the eager way: fp32 parameters, the forward under bf16 autocast, no scaler."""
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


def autocast_against_ddp(rank, world_size, stage, steps=4):
    """bf16 autocast inside the compiled step against DDP running the same step: every loss, then the parameters and
    optimizer state."""
    ref_model, opt_ref = gpt_and_adamw()
    ddp = DDP(ref_model)
    model, opt = gpt_and_adamw()
    step = zerofx.compile(_autocast_in_the_step, stage=stage)
    for i in range(steps):
        x, y = token_batch(i, rank)
        torch.testing.assert_close(step(model, opt, x, y).item(), _autocast_in_the_step(ddp, opt_ref, x, y).item(),
                                   rtol=1e-5, atol=0, msg=f"call {i}")
    assert_matches_ddp(step, ref_model, opt_ref, atol=1e-6)
