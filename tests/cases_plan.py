"""A one-block GPT trained on the ranks of a gloo pool at stages 0-3, measured on live storages: what
test_plan.py compares ``zerofx.plan``'s predictions with."""

import dataclasses

import torch

import zerofx
from models import TINY_GPT, token_batch, train_step
from nanogpt import GPT, param_groups

ONE_BLOCK_GPT = dataclasses.replace(TINY_GPT, n_layer=1)  # every kind of layer once: the fewest nodes to capture
BATCH = 4
# every stage once, half of them in bf16 (master weights; stage 3 gathers casts of them)
RUNS = {"stage 0": {"stage": 0}, "stage 1 bf16": {"stage": 1, "mixed_precision": "bf16"}, "stage 2": {"stage": 2},
        "stage 3 bf16": {"stage": 3, "mixed_precision": "bf16"},
        "stage 3 bf16, bf16 shard kept": {"stage": 3, "mixed_precision": "bf16 shard kept"}}
OPTIMIZERS = {  # AdamW as the paper's figures assume; SGD with momentum (one state tensor, traced faster) besides
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def one_block_gpt(optimizer: str, device=None):
    """The model (on ``device``, meta for a plan) and the named optimizer over nanoGPT's two parameter groups."""
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = GPT(ONE_BLOCK_GPT)
    return model, OPTIMIZERS[optimizer](param_groups(model, weight_decay=0.1))


def compile_options(options: dict) -> dict:
    """``options`` with "bf16" standing for bf16 mixed precision, "bf16 shard kept" for it with
    ``cast_at_gather=False`` (a MixedPrecision does not cross processes)."""
    kind = options.get("mixed_precision")
    if kind in ("bf16", "bf16 shard kept"):
        mixed = zerofx.MixedPrecision(param_dtype=torch.bfloat16, cast_at_gather=kind == "bf16")
        return {**options, "mixed_precision": mixed}
    return options


def figures(stats) -> dict:
    return {"model_states": stats.model_state_bytes, "peak": stats.peak_bytes, "comm": stats.comm_volume}


def measured_stats(rank, world_size, optimizer, runs=RUNS):
    """Per run: the first step's measured model-state bytes by class and communication, and the lower of two
    steps' peaks (the same graph twice: a buffer gloo's thread happens to release after the graph's last read of it
    raises one step's mark, seen under load at 4 ranks, and says nothing about the plan)."""
    out = {}
    for name, options in runs.items():
        model, opt = one_block_gpt(optimizer)
        step = zerofx.compile(train_step, track_memory=True, **compile_options(options))
        step(model, opt, *token_batch(0, rank, batch=BATCH, cfg=ONE_BLOCK_GPT))
        out[name] = figures(step.stats())
        step(model, opt, *token_batch(1, rank, batch=BATCH, cfg=ONE_BLOCK_GPT))
        out[name]["peak"] = min(out[name]["peak"], step.stats().peak_bytes)
    return out
