"""A one-block GPT trained on the ranks of a gloo pool at stages 0-3, measured on live storages: what
test_plan.py compares ``zerofx.plan``'s predictions with."""

import dataclasses

import torch

import zerofx
from models import TINY_GPT, gpt_and_adamw, token_batch, train_step

ONE_BLOCK_GPT = dataclasses.replace(TINY_GPT, n_layer=1)  # every kind of layer once: the fewest nodes to capture
BATCH = 4
# every stage once; bf16 (master weights) and checkpointing where they change the graph most
RUNS = {"stage 0": {"stage": 0}, "stage 1 bf16": {"stage": 1, "mixed_precision": "bf16"}, "stage 2": {"stage": 2},
        "stage 3 bf16 blocks": {"stage": 3, "mixed_precision": "bf16", "checkpoint": "blocks"}}


def compile_options(options: dict) -> dict:
    """``options`` with "bf16" standing for bf16 mixed precision (a MixedPrecision does not cross processes)."""
    if options.get("mixed_precision") == "bf16":
        return {**options, "mixed_precision": zerofx.MixedPrecision(param_dtype=torch.bfloat16)}
    return options


def measured_stats(rank, world_size, runs=RUNS):
    """Per run: the first step's measured model-state bytes by class, peak, activations and communication."""
    out = {}
    for name, options in runs.items():
        model, opt = gpt_and_adamw(cfg=ONE_BLOCK_GPT)
        step = zerofx.compile(train_step, track_memory=True, **compile_options(options))
        step(model, opt, *token_batch(0, rank, batch=BATCH, cfg=ONE_BLOCK_GPT))
        stats = step.stats()
        out[name] = {"model_states": stats.model_state_bytes, "peak": stats.peak_bytes,
                     "activations": stats.activation_bytes, "comm": stats.comm_volume}
    return out
