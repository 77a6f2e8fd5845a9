"""The example GPT's step graphs planned from their lifetimes, on every rank of a gloo pool (test_memory_plan.py)."""

import torch

import zerofx
from models import gpt_and_adamw, token_batch, train_step
from nanogpt import GPTConfig
from zerofx.memory.lifetimes import peak_live

EXAMPLE_GPT = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)  # examples/train_gpt.py


def plans_per_stage(rank, world_size, stages=(0, 1, 2, 3)):
    """Per stage: the plan's figures, the lifetimes' peak and the peak `StepProbe` measured on live storages."""
    out = {}
    for stage in stages:
        model, opt = gpt_and_adamw(cfg=EXAMPLE_GPT)
        step = zerofx.compile(train_step, stage=stage, track_memory=True)
        step(model, opt, *token_batch(0, rank, batch=16, cfg=EXAMPLE_GPT))
        stats = step.stats()
        predicted, _ = peak_live(step._last.memory_plan().spans)
        out[stage] = {"lower_bound": stats.lower_bound_bytes, "arena": stats.arena_bytes,
                      "fragmentation": stats.fragmentation, "predicted_peak": predicted,
                      "measured_peak": stats.peak_bytes, "largest": stats.largest_at_peak}
    return out
