"""The example GPT's step graphs planned from their lifetimes and run in a planned arena, on every rank of a gloo
pool (test_memory_lifetimes.py)."""

import torch

import zerofx
from models import gpt_and_adamw, token_batch, train_step
from nanogpt import GPTConfig
from zerofx.memory.lifetimes import peak_live

EXAMPLE_GPT = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)  # examples/train_gpt.py


RUNS = [(0, "fp32", None), (1, "fp32", None), (2, "fp32", None), (3, "fp32", None), (3, "fp32", "blocks"),
        (1, "bf16", "blocks"), (2, "fp16", None)]  # stages 0-3 once; checkpointing, bf16 and fp16 (loss scaling)


def _train(rank, stage, precision, checkpoint, memory_plan, steps=2):
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    mixed = zerofx.MixedPrecision(param_dtype=low) if low else None
    model, opt = gpt_and_adamw(cfg=EXAMPLE_GPT)
    step = zerofx.compile(train_step, stage=stage, mixed_precision=mixed, checkpoint=checkpoint,
                          memory_plan=memory_plan, track_memory=True)
    losses = [step(model, opt, *token_batch(i, rank, batch=16, cfg=EXAMPLE_GPT)).item() for i in range(steps)]
    return losses, zerofx.full_state_dict(step), step


def planned_is_bitwise_unplanned(rank, world_size, runs=RUNS):
    """Each (stage, precision, checkpoint) trained with and without ``memory_plan``: the same losses, parameters and
    optimizer state, bit for bit. Returns, per run, both peaks, what the plan placed and left, and the unplanned
    step's planned-arena figures and the peak its lifetimes predict."""
    out = {}
    for stage, precision, checkpoint in runs:
        (want_losses, want, plain), (losses, got, planned) = (
            _train(rank, stage, precision, checkpoint, memory_plan) for memory_plan in (False, True))
        name = f"stage {stage} {precision} {checkpoint}"
        assert losses == want_losses, (name, losses, want_losses)
        for key, value in want["model"].items():
            assert torch.equal(got["model"][key], value), (name, key)
        for fqn, entries in want["optimizer"]["state"].items():
            for key, value in entries.items():
                assert torch.equal(torch.as_tensor(got["optimizer"]["state"][fqn][key]), torch.as_tensor(value)), \
                    (name, fqn, key)
        placed, stats = planned._last.ctx.artifacts["memory_plan"], plain.stats()
        predicted, _ = peak_live(plain._last.memory_plan().spans)
        out[name] = {"unplanned_peak": stats.peak_bytes, "planned_peak": planned.stats().peak_bytes,
                     "buffers": placed.buffers, "arena": placed.arena_bytes, "lower_bound": placed.lower_bound_bytes,
                     "left": placed.left, "fragmentation": stats.fragmentation, "predicted_peak": predicted,
                     "largest": stats.largest_at_peak, "arena_bytes": stats.arena_bytes,
                     "by_layout": stats.arena_bytes_by_layout}
    return out
