"""Tiny models and data for the tests; every rank builds the same ones from the same seed."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogpt import GPT, GPTConfig, param_groups

TINY_GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


def gpt_and_adamw(seed: int = 0, lr: float = 3e-3, cfg: GPTConfig = TINY_GPT):
    torch.manual_seed(seed)
    model = GPT(cfg)
    return model, torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=lr)


def token_batch(step: int, rank: int, batch: int = 4, cfg: GPTConfig = TINY_GPT):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return x, y


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.relu(self.bn(self.fc1(x)))), y)


def bn_and_sgd(seed: int = 0):
    torch.manual_seed(seed)
    model = BNNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def bn_batch(step: int, rank: int, batch: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, 8, generator=g) * (1 + rank), torch.randint(0, 3, (batch,), generator=g)


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


def train_beside(reference_step, compiled_step, ref_args, args, batch, rank: int, steps: int):
    """Run the reference (eager or DDP) and the compiled step on the same batches; both loss lists."""
    ref_losses, losses = [], []
    for i in range(steps):
        x, y = batch(i, rank)
        ref_losses.append(reference_step(*ref_args, x, y).item())
        losses.append(compiled_step(*args, x, y).item())
    return ref_losses, losses


def clipped_train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optimizer.step()
    return loss


def accumulating_train_step(model, optimizer, x, y):
    """Two micro-batches per step, as gradient accumulation does it."""
    optimizer.zero_grad()
    total = 0.0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        loss = model(xs, ys) / 2
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return total
