"""Which torch.optim optimizers zerofx captures, and how.

Hyperparameters are graph inputs (lr, Adam's betas, weight decay; SGD's momentum and dampening), so an LR scheduler
or OneCycleLR's momentum cycling changes the update without a new trace. Each is traced as a 0-dim tensor read with
``.item()``: an unbacked symbolic float, which the update computes with and passes to its ops as it would the Python
float. Where torch.optim also branches on one in Python (``if momentum != 0``, ``if weight_decay != 0``), only the
branch is a guard: the key records which side of zero the value is on, and the trace states that side to the tracer
with ``torch._check``, which decides torch.optim's ``!=`` from it. Any other comparison of an input fails the capture,
so a graph never depends on more than its key says. Crossing zero re-traces once per side; a new non-zero value
does not.

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
    tensor_hyperparams: tuple[HyperparamKey, ...]  # graph inputs
    init_state: Callable[[dict, torch.Tensor], dict]
    zero_tested: tuple[HyperparamKey, ...] = ()  # inputs torch.optim tests ``!= 0`` in Python: the key holds the side

    def __post_init__(self):
        if not set(self.zero_tested) <= set(self.tensor_hyperparams):
            # a constant's value is guarded whole; only an input may be guarded by its side of zero alone
            raise ValueError("every zero-tested hyperparameter must be a graph input")


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


_ADAM = OptimizerSpec(tensor_hyperparams=(("lr", None), ("betas", 0), ("betas", 1), ("weight_decay", None)),
                      zero_tested=(("weight_decay", None),), init_state=_adam_state)
SPECS: dict[type, OptimizerSpec] = {
    # dampening is only computed with (``1 - dampening``) during the step; _sgd_state's test of it decides the state
    # layout before capture, and the layout is part of the key
    torch.optim.SGD: OptimizerSpec(
        tensor_hyperparams=(("lr", None), ("momentum", None), ("dampening", None), ("weight_decay", None)),
        zero_tested=(("momentum", None), ("weight_decay", None)), init_state=_sgd_state),
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


def zero_side(value) -> str:
    """What the guard key holds for a zero-tested hyperparameter."""
    return "!= 0" if value != 0 else "== 0"


def assume_zero_side(traced: torch.SymFloat, value) -> None:
    """State to the tracer the side of zero that the key records for ``value``, so torch.optim's ``if traced != 0``
    is decided while ``traced`` stays symbolic in the arithmetic. On the zero side the tracer folds it to 0.0,
    exact for every value with that key."""
    torch._check(traced != 0 if value != 0 else traced == 0)


def hyperparam_name(key: HyperparamKey) -> str:
    name, index = key
    return name if index is None else f"{name}[{index}]"
