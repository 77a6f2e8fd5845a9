"""Which torch.optim optimizers zerofx captures, and how.

A hyperparameter the optimizer only computes with (lr, Adam's betas) becomes a graph input, so an LR scheduler or
OneCycleLR's momentum cycling changes the update without a new trace. One that torch.optim branches on in Python
(``weight_decay != 0``, SGD's ``momentum != 0``) is a guard: a new value re-traces.

State that torch.optim creates on the first ``step()`` is created here before capture, with the values the first
step would start from, so the first and later steps share one graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from zerofx.errors import CaptureError

# (group key, index into a tuple value or None)
HyperparamKey = tuple[str, int | None]


@dataclass(frozen=True)
class OptimizerSpec:
    tensor_hyperparams: tuple[HyperparamKey, ...]
    init_state: Callable[[dict, torch.Tensor], dict]


def _adam_state(group: dict, p: torch.Tensor) -> dict:
    on_device = group.get("capturable") or group.get("fused")
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {
        "step": torch.tensor(0.0, dtype=scalar_dtype, device=p.device if on_device else "cpu"),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _sgd_state(group: dict, p: torch.Tensor) -> dict:
    # With dampening 0, a zero buffer updated once equals the clone torch.optim makes on its first step, bit for
    # bit. With dampening it does not: the state stays lazy and the second call traces the steady-state graph.
    if group["momentum"] != 0 and group["dampening"] == 0:
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return {}


_ADAM = OptimizerSpec(tensor_hyperparams=(("lr", None), ("betas", 0), ("betas", 1)), init_state=_adam_state)
SPECS: dict[type, OptimizerSpec] = {
    torch.optim.SGD: OptimizerSpec(tensor_hyperparams=(("lr", None),), init_state=_sgd_state),
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAM,
}

# Kernel choices, not math: the traced graph holds the per-parameter update either way.
KERNEL_FLAGS = {"foreach": False, "fused": False}


def spec_for(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    spec = SPECS.get(type(optimizer))
    if spec is None:
        supported = ", ".join(sorted(t.__name__ for t in SPECS))
        raise CaptureError(
            f"unsupported optimizer {type(optimizer).__name__}",
            hint=f"zerofx captures {supported}",
        )
    return spec


def init_lazy_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state torch.optim would create on its first step, for every trainable parameter lacking it."""
    spec = spec_for(optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                fresh = spec.init_state(group, p)
                if fresh:
                    optimizer.state[p] = fresh


def read_hyperparam(group: dict, key: HyperparamKey) -> float:
    name, index = key
    value = group[name] if index is None else group[name][index]
    return float(value)


def write_hyperparam(group: dict, key: HyperparamKey, value) -> None:
    name, index = key
    if index is None:
        group[name] = value
    else:
        items = list(group[name])
        items[index] = value
        group[name] = tuple(items)


def hyperparam_name(key: HyperparamKey) -> str:
    name, index = key
    return name if index is None else f"{name}[{index}]"
