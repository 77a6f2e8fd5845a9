"""The models the systems train: the repository's GPT, or a Hugging Face ``LlamaForCausalLM`` built from a config
(random weights), called alike: ``model(x, y) -> loss``, its repeated blocks in ``model.blocks`` (FSDP2 wraps
each; zerofx finds them itself). `checkpoint_blocks` applies activation checkpointing as FSDP2's users do."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogpt import GPT, GPTConfig


@dataclass(frozen=True)
class LlamaShape:
    """A Llama of the benchmark's sizes: the GPT's layers, heads, width and context, SwiGLU at 8/3 of the width."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


class CausalLM(nn.Module):
    """A Hugging Face causal LM with the GPT's call: next-token cross-entropy of ``x`` against ``y``."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.blocks = lm.model.layers

    def forward(self, x, y):
        logits = self.lm(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def build(cfg) -> nn.Module:
    """The same model on every rank and for every system (seed 0)."""
    torch.manual_seed(0)
    if isinstance(cfg, GPTConfig):
        return GPT(cfg)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_embd * 8 // 3,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
        max_position_embeddings=cfg.block_size, attn_implementation="sdpa")
    return CausalLM(transformers.LlamaForCausalLM(config))


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Each block under non-reentrant activation checkpointing, with the wrapper torchtitan applies before
    ``fully_shard``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model
