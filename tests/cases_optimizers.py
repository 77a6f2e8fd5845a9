"""Every optimizer zerofx captures beyond SGD, Adam and AdamW, on every rank of a gloo pool, under a OneCycleLR
schedule, against the referee of cases_loops (DDP in fp32, FSDP2 in bf16, FSDP2 + GradScaler in float16);
test_optimizers.py calls these."""

import torch

import zerofx
from cases_loops import PRECISIONS, assert_matches_ddp, reference
from models import gpt_and_adamw, token_batch, train_step

# each with the options that change its state or its update
OPTIMIZERS = {
    "RMSprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9, centered=True, weight_decay=0.01),
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1),
    "Adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=2e-3, weight_decay=0.01),
    "NAdam": lambda m: torch.optim.NAdam(m.parameters(), lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True),
    "Adadelta": lambda m: torch.optim.Adadelta(m.parameters(), weight_decay=0.01),
}


def _one_cycle(opt, steps):
    """OneCycleLR moves the lr every step, and momentum (RMSprop) or beta1 (Adamax, NAdam) where there is one."""
    cycles = "momentum" in opt.defaults or "betas" in opt.defaults
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3 * opt.defaults["lr"], total_steps=steps,
                                               cycle_momentum=cycles)


def optimizers_against_referee(rank, world_size, stage, precision, steps=5):
    """Each optimizer trains ``steps`` steps of the tiny GPT beside the referee: losses, and in fp32 the full model
    and optimizer state (counters included)."""
    mixed = zerofx.MixedPrecision(PRECISIONS[precision]) if PRECISIONS[precision] else None
    results = {}
    for name, make in OPTIMIZERS.items():
        ref_model, ref_opt, ref_step = reference(precision, make)
        ref_schedule = _one_cycle(ref_opt, steps)
        model = gpt_and_adamw()[0]
        opt = make(model)
        schedule = _one_cycle(opt, steps)
        step = zerofx.compile(train_step, stage=stage, bucket_bytes=8 * 1024, mixed_precision=mixed)
        losses, ref_losses = [], []
        for i in range(steps):
            x, y = token_batch(i, rank)
            losses.append(step(model, opt, x, y).item())
            ref_losses.append(ref_step(x, y).item())
            schedule.step()
            ref_schedule.step()
        tolerance = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}[precision]
        torch.testing.assert_close(losses, ref_losses, rtol=tolerance, atol=0, msg=lambda m: f"{name}: {m}")
        if precision == "fp32":
            assert_matches_ddp(step, ref_model, ref_opt)
        stats = step.stats()
        results[name] = {"traces": stats.traces, "k": stats.formula.bytes_per_element[zerofx.formulas.K],
                         "state": sorted(zerofx.full_state_dict(step)["optimizer"]["state"]["wte.weight"])}
    return results
