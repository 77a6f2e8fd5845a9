"""Mixed precision: compute and communicate parameters in ``param_dtype``, keep fp32 master weights.

The names follow FSDP2's ``MixedPrecisionPolicy``. The step is traced with the module's parameters in
``param_dtype`` (so forward and backward run, and gradients come out, in that dtype) while the optimizer is pointed
at fp32 master copies: before its step each master's gradient is the compute gradient cast to fp32, and after it
each compute parameter is the updated master cast back. Passes shard the master weights with the optimizer state
(P_os) and move compute parameters and gradients in the low precision: the paper's b_p = b_g = 2, K = 4 + 8.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None  # gradients are reduced in this dtype; None: param_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    def __post_init__(self):
        if not self.param_dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype, got {self.param_dtype}")
        if self.param_dtype == torch.float16:
            raise ValueError("param_dtype=torch.float16 needs loss scaling, which zerofx does not do yet: "
                             "use torch.bfloat16")


@contextlib.contextmanager
def master_weight_hooks(optimizer: torch.optim.Optimizer, compute: dict, master: dict):
    """While tracing: masters take the compute gradients (cast) before the step; compute parameters take the
    updated masters (cast) after it. ``compute`` and ``master`` map fqn -> traced tensor."""
    def grads_to_master(*_):
        for fqn, m in master.items():
            g = compute[fqn].grad
            m.grad = None if g is None else g.to(m.dtype)

    def masters_to_compute(*_):
        with torch.no_grad():
            for fqn, m in master.items():
                compute[fqn].copy_(m)

    handles = [optimizer.register_step_pre_hook(grads_to_master), optimizer.register_step_post_hook(masters_to_compute)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
