"""Activation checkpointing on every rank of a gloo pool: zerofx's own (``checkpoint=``) against the same run
without it, and the user's own (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable``)
against DDP doing the same. test_checkpointing.py calls these."""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import zerofx
from cases_hf import _batch, _hf_step, _model
from cases_loops import assert_matches_ddp
from models import GPT, GPTConfig, token_batch, train_step
from nanogpt import Block, param_groups

DROPOUT_GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
SIX_BLOCKS = GPTConfig(vocab_size=65, block_size=16, n_layer=6, n_head=2, n_embd=32, dropout=0.1)
RULES = {"none": None, "blocks": "blocks", "class": Block,
         "predicate": lambda path, module: path.startswith("blocks.") and path.count(".") == 1}


def _run(rank, stage, rule, steps, cfg=DROPOUT_GPT, budget=None, **compile_kwargs):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    step = zerofx.compile(train_step, stage=stage, checkpoint=rule, activation_budget=budget, track_memory=True,
                          **compile_kwargs)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 * i + rank)  # dropout masks: the same per step and rank in every run
        losses.append(step(model, opt, *token_batch(i, rank, cfg=cfg)).item())
    stats = step.stats()
    full = zerofx.full_state_dict(step)
    return losses, full, stats, torch.rand(1).item()  # the last: the generator's position after the steps


def _assert_bitwise(name, got, want):
    """Two `_run` results: the same losses, generator position, parameters and optimizer state, bit for bit."""
    assert got[0] == want[0], (name, got[0], want[0])
    assert got[3] == want[3], name
    for key, value in want[1]["model"].items():
        assert torch.equal(got[1]["model"][key], value), (name, key)
    for key, value in want[1]["optimizer"]["state"].items():
        for sub, t in value.items():
            assert torch.equal(torch.as_tensor(got[1]["optimizer"]["state"][key][sub]), torch.as_tensor(t)), \
                (name, key, sub)


def rules_against_no_checkpointing(rank, world_size, stage, steps=2):
    """Every kind of rule, bitwise against the same step without checkpointing; each run's measured figures."""
    plain = _run(rank, stage, None, steps)
    stats = plain[2]
    figures = {"none": (stats.activation_bytes, stats.peak_bytes, stats.recomputed_regions, stats.recomputed_flops)}
    for name, rule in RULES.items():
        if rule is None:
            continue
        got = _run(rank, stage, rule, steps)
        _assert_bitwise(name, got, plain)
        figures[name] = (got[2].activation_bytes, got[2].peak_bytes, got[2].recomputed_regions, got[2].recomputed_flops)
    return figures


def pointwise_against_keeping(rank, world_size, stage, param_dtype, steps=2):
    """The default (cheap pointwise outputs recomputed) bitwise against keeping them; both activation figures."""
    mixed = None if param_dtype is None else zerofx.MixedPrecision(param_dtype=param_dtype)
    kept = _run(rank, stage, None, steps, recompute_pointwise=False, mixed_precision=mixed)
    default = _run(rank, stage, None, steps, mixed_precision=mixed)
    _assert_bitwise("recompute_pointwise", default, kept)
    return {"kept": kept[2].activation_bytes, "recomputed": default[2].activation_bytes}


def budgets(rank, world_size, stage, steps=1):
    """Activation bytes and recomputed FLOPs at activation_budget None (no checkpointing), 1.0, 0.5 and 0.0."""
    losses, _, stats, _ = _run(rank, stage, None, steps, SIX_BLOCKS)
    figures = {None: (stats.activation_bytes, stats.recomputed_flops)}
    for budget in (1.0, 0.5, 0.0):
        got_losses, _, got, _ = _run(rank, stage, None, steps, SIX_BLOCKS, budget)
        assert got_losses == losses, budget
        figures[budget] = (got.activation_bytes, got.recomputed_flops)
    return figures


def offload_against_resident(rank, world_size, stage, memory_plan=False, steps=2):
    """P_a+cpu: checkpoints in host memory, bitwise as keeping them resident; the figures of both runs."""
    resident = _run(rank, stage, "blocks", steps, SIX_BLOCKS, memory_plan=memory_plan)
    offloaded = _run(rank, stage, "blocks", steps, SIX_BLOCKS, offload_activations=True, memory_plan=memory_plan)
    _assert_bitwise("offload_activations", offloaded, resident)
    return {name: {"resident": r[2].resident_checkpoint_bytes, "checkpoint": r[2].checkpoint_bytes,
                   "host": r[2].offloaded_bytes} for name, r in (("resident", resident), ("offloaded", offloaded))}


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


class SelfCheckpointingBlock(nn.Module):
    """A block that checkpoints itself inside its own forward, as Hugging Face's ``GradientCheckpointingLayer`` does:
    the generator-state read is inside the module call zerofx's checkpointing recomputes."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


class SelfCheckpointingGPT(GPT):
    def __init__(self, cfg, use_reentrant=False):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(SelfCheckpointingBlock(block) for block in self.blocks)


def users_checkpoint_against_ddp(rank, world_size, stage, use_reentrant, steps=4, inside_blocks=False, **options):
    def build():
        torch.manual_seed(0)
        model = (SelfCheckpointingGPT if inside_blocks else CheckpointedGPT)(DROPOUT_GPT, use_reentrant)
        return model, torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)

    ref_model, ref_opt = build()
    ddp = DDP(ref_model)
    model, opt = build()
    step = zerofx.compile(train_step, stage=stage, **options)
    for i in range(steps):
        x, y = token_batch(i, rank, cfg=DROPOUT_GPT)
        torch.manual_seed(100 * i + rank)
        ref = train_step(ddp, ref_opt, x, y).item()
        torch.manual_seed(100 * i + rank)
        got = step(model, opt, x, y).item()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=0, msg=f"step {i}")
    assert_matches_ddp(step, ref_model, ref_opt, atol=1e-6)


def hf_gradient_checkpointing_against_ddp(rank, world_size, stage, arch, use_reentrant=None, steps=4):
    """A Hugging Face model with ``gradient_checkpointing_enable()`` (GPT-2: dropout on) against DDP doing the same."""
    ref_model, model = _model(arch), _model(arch)
    kwargs = {} if use_reentrant is None else {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    for m in (ref_model, model):
        m.gradient_checkpointing_enable(**kwargs)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ddp = DDP(ref_model)
    step = zerofx.compile(_hf_step, stage=stage)
    for i in range(steps):
        batch = _batch(i, rank)
        torch.manual_seed(1000 + i)
        ref = _hf_step(ddp, ref_opt, batch).item()
        torch.manual_seed(1000 + i)
        got = step(model, opt, batch).item()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=0, msg=f"{arch} step {i}")
    # one element in a thousand is rounding noise Adam scales up (as without checkpointing: README, limits)
    assert_matches_ddp(step, ref_model, ref_opt, atol=1e-5)
