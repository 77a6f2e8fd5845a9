"""What a step does on the meta device while planning: attention as the fused kernel a real run uses, and copies to
another device kept on meta.

On meta tensors ``scaled_dot_product_attention`` has no fused kernel to choose and decomposes into bmm + softmax,
which keeps the (T × T) scores of every head for backward. The kernels a real run picks (flash attention on CUDA and
on CPU, memory-efficient attention) keep only the output and a log-sum-exp per query. While planning, attention on
meta tensors therefore calls the fused CPU kernel's operator directly: its meta implementation gives exactly those
shapes, on any target device.

The plan runs its final graph once on meta tensors to record the collectives; a copy to host memory (offloaded
checkpoints) would have to read data meta tensors do not have, so it stays on meta. The graph's own values still
say where each buffer lives, which is what the plan's bytes come from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_COPY = torch.ops.aten._to_copy.default


class OnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_meta = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"
        if func is F.scaled_dot_product_attention and on_meta:
            return _fused(*args, **kwargs)
        if func is _COPY and on_meta and "device" in kwargs and not isinstance(args[0], FakeTensor):
            kwargs = {**kwargs, "device": torch.device("meta")}  # running, not tracing: graph values stay as built
        return func(*args, **kwargs)


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
    return _FUSED(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
