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
class LossScaling:
    """Dynamic loss scaling as ``torch.amp.GradScaler`` does it; used with ``param_dtype=torch.float16``."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None  # gradients are reduced in this dtype; None: param_dtype
    loss_scaling: LossScaling | None = None  # None: on for float16, off otherwise

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def scaling(self) -> LossScaling | None:
        return self.loss_scaling or (LossScaling() if self.param_dtype == torch.float16 else None)

    def __post_init__(self):
        if not self.param_dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype, got {self.param_dtype}")


FOUND_INF = "zerofx_found_inf"  # node.meta flag: this rank's "a gradient is not finite", before ranks agree
PER_TENSOR_CHECK = "zerofx_finite_check"  # node.meta flag: a per-gradient finiteness reduction (global once agreed)


@contextlib.contextmanager
def master_weight_hooks(optimizer: torch.optim.Optimizer, compute: dict, master: dict, scaling=None):
    """While tracing: masters take the compute gradients (cast, and unscaled with loss scaling) before the step;
    compute parameters take the updated masters (cast) after it. ``compute`` and ``master`` map fqn -> traced
    tensor; ``scaling`` is (LossScaling, scale, growth tracker) as traced tensors. With scaling the update is
    computed together with "a gradient is not finite", which passes make global and turn into a skipped step,
    and the scale is updated as GradScaler updates it."""
    found = []

    def grads_to_master(*_):
        for fqn, m in master.items():
            g = compute[fqn].grad
            m.grad = None if g is None else g.to(m.dtype)
        if scaling is not None:
            config, scale, _ = scaling
            inverse = scale.double().reciprocal().float()
            checks = []
            for m in master.values():
                if m.grad is not None:
                    m.grad.mul_(inverse)
                    checks.append(torch.isfinite(m.grad).all())
                    _flag(checks[-1], PER_TENSOR_CHECK)
            found.append(torch.stack(checks).all().logical_not().float())
            _flag(found[-1], FOUND_INF)

    def masters_to_compute(*_):
        with torch.no_grad():
            for fqn, m in master.items():
                compute[fqn].copy_(m)
            if scaling is not None:
                config, scale, growth = scaling
                torch._amp_update_scale_(scale, growth, found[-1], config.growth_factor, config.backoff_factor,
                                         config.growth_interval)

    handles = [optimizer.register_step_pre_hook(grads_to_master), optimizer.register_step_post_hook(masters_to_compute)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _flag(tensor: torch.Tensor, key: str) -> None:
    """Mark the graph node that computes ``tensor`` (while tracing)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is not None:
        get_proxy_slot(tensor, mode.tracer).proxy.node.meta[key] = True
