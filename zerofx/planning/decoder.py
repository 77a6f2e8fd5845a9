"""The decoder-only transformer the planner traces for a `ModelShape`: GPT-2 or Llama style, built on the meta device
so that no weight is ever allocated.

Attention projects q, k and v separately and counts heads from the width it receives, so that splitting the
projections' output features over tensor-parallel ranks (`tensor_parallel_plan`, as Megatron-LM splits them) splits
whole heads. ``forward(tokens, targets)`` returns the mean cross-entropy loss. `plan_decoder` plans its training
step with AdamW.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from zerofx.planning.predict import plan
from zerofx.planning.shapes import GPT2, ModelShape
from zerofx.stats import StepStats


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        bias = shape.style == GPT2
        kv_width = shape.kv_heads * shape.head_dim
        self.head_dim, self.rotary = shape.head_dim, shape.style != GPT2
        self.groups = shape.n_head // shape.kv_heads  # query heads per key/value head
        self.q = nn.Linear(shape.d_model, shape.d_model, bias=bias)
        self.k = nn.Linear(shape.d_model, kv_width, bias=bias)
        self.v = nn.Linear(shape.d_model, kv_width, bias=bias)
        self.proj = nn.Linear(shape.d_model, shape.d_model, bias=bias)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.rotary:
            q, k = _rotate(q), _rotate(k)
        if self.groups > 1:  # as Hugging Face's Llama does: every query head reads its own copy
            k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def _rotate(x):
    """Rotary position embedding (RoFormer) over the last dimension of ``x`` (batch, heads, positions, head_dim)."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(x.shape[-2], device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gated = shape.style != GPT2  # SwiGLU
        bias = not self.gated
        self.fc = nn.Linear(shape.d_model, shape.d_ff, bias=bias)
        self.gate = nn.Linear(shape.d_model, shape.d_ff, bias=False) if self.gated else None
        self.proj = nn.Linear(shape.d_ff, shape.d_model, bias=bias)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.fc(x) if self.gated else F.gelu(self.fc(x), approximate="tanh")
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        norm = nn.LayerNorm if shape.style == GPT2 else nn.RMSNorm
        self.ln1, self.attn, self.ln2, self.mlp = norm(shape.d_model), Attention(shape), norm(shape.d_model), \
            MLP(shape)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.wte = nn.Embedding(shape.vocab_size, shape.d_model)
        self.wpe = nn.Embedding(shape.max_seq, shape.d_model) if shape.style == GPT2 else None
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.d_model) if shape.style == GPT2 else nn.RMSNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tied_embeddings:
            self.head.weight = self.wte.weight

    def forward(self, tokens, targets):
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def tensor_parallel_plan(shape: ModelShape) -> dict:
    """Per block, Megatron-LM's split: q, k, v and the MLP's input projections by output feature, the output
    projections by input feature (one all-reduce after each)."""
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    if shape.style != GPT2:
        plan["mlp.gate"] = ColwiseParallel()
    return plan


def build(shape: ModelShape, tp_mesh=None, dtype: torch.dtype = torch.float32) -> Decoder:
    """The model on the meta device in ``dtype``; its blocks split over ``tp_mesh`` when one is given."""
    with torch.device("meta"):
        model = Decoder(shape).to(dtype)
    if tp_mesh is not None:
        if shape.n_head % tp_mesh.size() or shape.kv_heads % tp_mesh.size():
            raise ValueError(f"tp={tp_mesh.size()} must divide the model's {shape.n_head} heads "
                             f"({shape.kv_heads} key/value heads)")
        for block in model.blocks:
            parallelize_module(block, tp_mesh, tensor_parallel_plan(shape))
    return model


def train_step(model, optimizer, tokens, targets):
    """The step the planner traces: forward, backward and the update, as a training loop runs it."""
    optimizer.zero_grad()
    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    return loss


def num_params(shape: ModelShape) -> int:
    """Ψ: the distinct parameters of the model (a tied embedding once), counted on meta."""
    return sum(p.numel() for p in build(shape).parameters())


def plan_decoder(shape: ModelShape, *, world_size: int, stage: int, tp: int = 1, batch: int = 1,
                 seq: int | None = None, dtype: torch.dtype = torch.float32, **options) -> StepStats:
    """`plan` of `train_step` for ``shape`` with AdamW, ``batch`` sequences of ``seq`` tokens (the model's longest
    by default) per data-parallel rank, and ``world_size / tp`` data-parallel ranks of ``tp`` tensor-parallel ones;
    parameters (and so gradients and optimizer state) in ``dtype``; ``options`` as `plan` takes them."""
    seq = seq or shape.max_seq
    if not 1 <= seq <= shape.max_seq:
        raise ValueError(f"seq must be between 1 and the model's {shape.max_seq} positions, got {seq}")
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return plan(train_step, lambda tp_mesh: build(shape, tp_mesh, dtype), lambda m: torch.optim.AdamW(m.parameters()),
                (tokens, tokens), world_size=world_size, stage=stage,
                mesh_shape=(world_size // tp, tp) if tp > 1 else None, **options)
