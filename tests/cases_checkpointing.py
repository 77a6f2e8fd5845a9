"""Activation checkpointing on every rank of a gloo pool: zerofx's own (``checkpoint=``) against the same run
without it, and the user's own (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable``)
against DDP doing the same. test_checkpointing.py calls these."""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import zerofx
from cases_loops import assert_matches_ddp
from models import GPT, GPTConfig, token_batch, train_step
from nanogpt import Block, param_groups

DROPOUT_GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
RULES = {"none": None, "blocks": "blocks", "class": Block,
         "predicate": lambda path, module: path.startswith("blocks.") and path.count(".") == 1}


def _run(rank, stage, rule, steps):
    torch.manual_seed(0)
    model = GPT(DROPOUT_GPT)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    step = zerofx.compile(train_step, stage=stage, checkpoint=rule, track_memory=True)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 * i + rank)  # dropout masks: the same per step and rank in every run
        losses.append(step(model, opt, *token_batch(i, rank, cfg=DROPOUT_GPT)).item())
    stats = step.stats()
    full = zerofx.full_state_dict(step)
    return losses, full, stats, torch.rand(1).item()  # the last: the generator's position after the steps


def rules_against_no_checkpointing(rank, world_size, stage, steps=3):
    """Every kind of rule, bitwise against the same step without checkpointing; each run's measured figures."""
    losses, full, stats, after = _run(rank, stage, None, steps)
    figures = {"none": (stats.activation_bytes, stats.peak_bytes, stats.recomputed_regions, stats.recomputed_flops)}
    for name, rule in RULES.items():
        if rule is None:
            continue
        got_losses, got_full, got_stats, got_after = _run(rank, stage, rule, steps)
        assert got_losses == losses, (name, got_losses, losses)
        assert got_after == after, name
        for key, value in full["model"].items():
            assert torch.equal(got_full["model"][key], value), (name, key)
        for key, value in full["optimizer"]["state"].items():
            for sub, t in value.items():
                assert torch.equal(torch.as_tensor(got_full["optimizer"]["state"][key][sub]), torch.as_tensor(t)), \
                    (name, key, sub)
        figures[name] = (got_stats.activation_bytes, got_stats.peak_bytes, got_stats.recomputed_regions,
                         got_stats.recomputed_flops)
    return figures


class CheckpointedGPT(GPT):
    """The GPT with each block under ``torch.utils.checkpoint``, as users write it."""

    def __init__(self, cfg, use_reentrant):
        super().__init__(cfg)
        self.use_reentrant = use_reentrant

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = nn.functional.dropout(self.wte(idx) + self.wpe(pos), self.cfg.dropout, self.training)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def users_checkpoint_against_ddp(rank, world_size, stage, use_reentrant, steps=4):
    def build():
        torch.manual_seed(0)
        model = CheckpointedGPT(DROPOUT_GPT, use_reentrant)
        return model, torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)

    ref_model, ref_opt = build()
    ddp = DDP(ref_model)
    model, opt = build()
    step = zerofx.compile(train_step, stage=stage)
    for i in range(steps):
        x, y = token_batch(i, rank, cfg=DROPOUT_GPT)
        torch.manual_seed(100 * i + rank)
        ref = train_step(ddp, ref_opt, x, y).item()
        torch.manual_seed(100 * i + rank)
        got = step(model, opt, x, y).item()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=0, msg=f"step {i}")
    assert_matches_ddp(step, ref_model, ref_opt, atol=1e-6)
