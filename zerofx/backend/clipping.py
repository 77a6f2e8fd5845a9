"""Gradient clipping for a model given to ``zerofx.prepare``, whose gradients, from stage 1 on (and under mixed
precision), are the optimizer's shards: the model's own parameters have none, so torch's
``clip_grad_norm_(model.parameters())`` would find nothing to clip."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zerofx.backend.prepared import prepared


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` for a model given to ``zerofx.prepare`` (or
    ``torch.compile``'s wrapper of it): the total norm of the whole model's gradients, from every rank's shards (one
    all-reduce from stage 1 on), and each shard scaled as torch scales the whole gradient. Returns the total norm.
    Every rank calls it, between ``loss.backward()`` and ``optimizer.step()``."""
    shards = prepared(model).shards
    if shards is None:  # stage 0 in the model's precision: the gradients are the model's own
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type, error_if_nonfinite)
    params = [p for p in shards.params.values() if p.grad is not None]
    grads = [p.grad for p in params]
    norm_type = float(norm_type)
    device = next(iter(shards.params.values())).device
    total = (torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=device)).float()
    if shards.stage >= 1 and shards.ranks.size > 1:  # each rank holds a disjoint part of every gradient
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=shards.ranks.group)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, group=shards.ranks.group)
            total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), "
                           "so they cannot be clipped (error_if_nonfinite=True)")
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
