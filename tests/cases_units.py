"""Stage 3 at its default units on every rank of a gloo pool; test_units.py calls these."""

import torch

import zerofx
from models import GPT, GPTConfig, token_batch, train_step

SIX_BLOCKS = GPTConfig(vocab_size=65, block_size=16, n_layer=6, n_head=2, n_embd=32)


def gathered_high_water(rank, world_size, prefetch):
    """The high-water mark of gathered parameter bytes over one measured step, beside the units' sizes."""
    torch.manual_seed(0)
    model = GPT(SIX_BLOCKS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zerofx.compile(train_step, stage=3, prefetch=prefetch, track_memory=True)
    step(model, opt, *token_batch(0, rank, cfg=SIX_BLOCKS))
    step(model, opt, *token_batch(1, rank, cfg=SIX_BLOCKS))
    units = step._last.ctx.artifacts["gather_buckets"]
    layouts = step._owned.layouts
    return {"n_units": len(units), "largest_unit": max(u.nbytes for u in units),
            "largest_param": max(l.padded_numel * l.dtype.itemsize for l in layouts.values()),
            "gathered_high_water": step._last_probe.high_water["gathered_params"]}
