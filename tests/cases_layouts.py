"""Parameters and buffers not laid out row-major (a channels-last conv net, a transposed weight and buffer), trained
by zerofx and by DDP on every rank of a gloo pool; test_layouts.py calls these."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zerofx
from cases_loops import assert_matches_ddp
from models import train_step


class StridedNet(nn.Module):
    """A conv net in channels-last, as conv nets are trained on accelerators, with a head whose weight is a transpose
    and a mixing buffer that is one too."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before a norm only learns noise
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)
        self.head.weight = nn.Parameter((torch.randn(8, 5) * 0.3).t())
        self.register_buffer("mix", (torch.eye(8) + 0.01 * torch.arange(64.0).view(8, 8)).t())
        self.to(memory_format=torch.channels_last)

    def forward(self, x, y):
        h = F.relu(self.norm(self.conv(x.contiguous(memory_format=torch.channels_last))))
        return F.cross_entropy(self.head(h.mean((2, 3)) @ self.mix), y)


def strided_net_and_adamw(seed=0):
    torch.manual_seed(seed)
    model = StridedNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def image_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)


def strided_layouts_against_ddp(rank, world_size, stage, memory_plan, steps=3):
    model, opt = strided_net_and_adamw()
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last) and not model.head.weight.is_contiguous()
    ref_model, ref_opt = strided_net_and_adamw()
    ddp = DDP(ref_model)
    step = zerofx.compile(train_step, stage=stage, memory_plan=memory_plan)
    # stage 0 computes with the module's own parameters; from stage 1 on with full parameters rebuilt from flat
    # shards in row-major order, whose kernels may round differently (by an ulp here)
    rtol = 0 if stage == 0 else 1e-5
    for i in range(steps):
        x, y = image_batch(i, rank)
        loss, ref_loss = step(model, opt, x, y), train_step(ddp, ref_opt, x, y)  # both, so no rank waits on DDP
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0, msg=f"step {i}")
    assert_matches_ddp(step, ref_model, ref_opt)
    return True


class GroupNormNet(nn.Module):
    """A conv and a group norm that take the batch in whatever layout it comes: their kernels follow it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.norm(self.conv(x)).mean((2, 3))), y)


def layouts_changed_between_calls_against_eager(rank, world_size, stage, memory_plan):
    """The batch alternates between contiguous and channels-last from call to call, and at stage 0 (where the model
    keeps its parameters) the model itself turns channels-last after two calls. Every rank takes the same batch, so
    eager PyTorch on one rank is the referee."""
    torch.manual_seed(0)
    model = GroupNormNet()
    ref_model = GroupNormNet()
    ref_model.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref_model))
    step = zerofx.compile(train_step, stage=stage, memory_plan=memory_plan)
    for i in range(5):
        if i == 2 and stage == 0:
            model.to(memory_format=torch.channels_last)
            ref_model.to(memory_format=torch.channels_last)
        x, y = image_batch(i, rank=0)
        if i % 2:
            x = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(step(model, opt, x, y), train_step(ref_model, ref_opt, x, y), rtol=0, atol=0,
                                   msg=f"call {i}")
    full = zerofx.full_state_dict(step)["model"]
    for fqn, p in ref_model.named_parameters():
        torch.testing.assert_close(full[fqn], p.detach(), rtol=0, atol=0, msg=fqn)
    return step.stats().traces
