"""Attention on the meta device counted as the fused kernel a real run uses.

On meta tensors ``scaled_dot_product_attention`` has no fused kernel to choose and decomposes into bmm + softmax,
which keeps the (T × T) scores of every head for backward. The kernels a real run picks (flash attention on CUDA and
on CPU, memory-efficient attention) keep only the output and a log-sum-exp per query. While planning, attention on
meta tensors therefore calls the fused CPU kernel's operator directly: its meta implementation gives exactly those
shapes, on any target device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class FusedAttentionOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta":
            return _fused(*args, **kwargs)
        return func(*args, **kwargs)


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
    return _FUSED(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
