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


def _seeded_with_sgd(module_class, seed: int):
    torch.manual_seed(seed)
    model = module_class()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def bn_and_sgd(seed: int = 0):
    return _seeded_with_sgd(BNNet, seed)


def bn_batch(step: int, rank: int, batch: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, 8, generator=g) * (1 + rank), torch.randint(0, 3, (batch,), generator=g)


class ConvBNNet(nn.Module):
    """An image classifier with BatchNorm2d and GroupNorm, as a small ResNet stem."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.down, self.gn = nn.Conv2d(8, 8, 3, stride=2), nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.gn(self.down(F.relu(self.bn(self.conv(x)))))
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), y)


def conv_bn_and_sgd(seed: int = 0):
    return _seeded_with_sgd(ConvBNNet, seed)


def image_batch(step: int, rank: int, batch: int = 6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, 3, 8, 8, generator=g) * (1 + rank), torch.randint(0, 3, (batch,), generator=g)


def mlp_and_adamw():
    """A small regression model, for a batch of floats."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def regression_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


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


class HeadsAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections and heads counted from the width it receives, so that
    splitting the projections' output features over tensor-parallel ranks splits whole heads."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(B, T, -1)), self.dropout, self.training)


class HeadsBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(cfg.n_embd), HeadsAttention(cfg), nn.LayerNorm(cfg.n_embd)
        self.fc, self.proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TensorParallelGPT(GPT):
    """The test GPT with blocks whose linear layers split over a tensor-parallel group as Megatron-LM splits them
    (`TENSOR_PARALLEL_PLAN`, per block)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(HeadsBlock(cfg) for _ in range(cfg.n_layer))
        self.blocks.apply(self._init_weights)
