"""Which torch.optim optimizers zerofx captures, and how.

SGD, Adam, AdamW, Adamax, NAdam, RMSprop, Adagrad and Adadelta: every update they make is elementwise per
parameter, so it runs unchanged on shards. (RAdam branches in Python on the step count, Adafactor's factored state is
not shaped like its parameter, LBFGS calls the model again: none fits one traced step sharded by element.)

Hyperparameters are graph inputs (lr, betas, alpha, rho, weight decay; SGD's and RMSprop's momentum, ...), so an LR
scheduler or OneCycleLR's momentum cycling changes the update without a new trace. Each given as a number is traced
as a 0-dim tensor read with ``.item()``: an unbacked symbolic float, which the update computes with and passes to its
ops as it would the Python float; one given as a tensor is traced as that tensor (`traced_as_tensor`). Where torch.optim also branches on one in Python (``if momentum != 0``, ``if momentum > 0``,
``if weight_decay != 0``), only the branch is a guard: the key records the value's sign, and the trace states it to
the tracer with ``torch._check``, which decides torch.optim's comparison with zero from it. Any other comparison of
an input fails the capture, so a graph never depends on more than its key says. Crossing zero re-traces once per
side; a new non-zero value does not.

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
    """What zerofx needs to know of a torch.optim optimizer beyond what tracing its ``step()`` shows."""

    tensor_hyperparams: tuple[HyperparamKey, ...]  # graph inputs
    # the group's state tensors shaped like the parameter (per element: sharded with it from stage 1 on)
    per_element_state: Callable[[dict], tuple[str, ...]]
    scalar_state: tuple[tuple[str, float], ...] = (("step", 0.0),)  # per-parameter 0-dim state and its start
    initial_value: Callable[[dict], float] = lambda group: 0.0  # of the per-element state
    # inputs torch.optim compares with zero in Python (``!= 0``, ``> 0``): the key holds their sign
    zero_tested: tuple[HyperparamKey, ...] = ()
    # a group whose state torch.optim starts from the first gradient (SGD's buffer with dampening): not created
    # here, so the first call traces the step that creates it and the second the steady state
    starts_from_gradient: Callable[[dict], bool] = lambda group: False
    # torch.optim creates a per-element state it finds missing on any step (SGD's buffer, once momentum is raised
    # from zero), not only on a parameter's first: zerofx then adds it to what it holds (others fail eagerly)
    creates_missing_state: bool = False

    def __post_init__(self):
        if not set(self.zero_tested) <= set(self.tensor_hyperparams):
            # a constant's value is guarded whole; only an input may be guarded by its sign alone
            raise ValueError("every zero-tested hyperparameter must be a graph input")

    def init_state(self, group: dict, p: torch.Tensor) -> dict:
        """The state torch.optim creates for ``p`` on its first ``step()``, with the values that step starts from."""
        if self.starts_from_gradient(group):
            return {}
        # torch.optim keeps its counters on the host unless the update runs on the device
        on_device = group.get("capturable") or group.get("fused")
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state = {name: torch.tensor(start, dtype=scalar_dtype, device=p.device if on_device else "cpu")
                 for name, start in self.scalar_state}
        for name in self.per_element_state(group):
            state[name] = torch.full_like(p, self.initial_value(group), memory_format=torch.preserve_format)
        return state

    def state_bytes_per_element(self, group: dict) -> int:
        """K for fp32 state: bytes of this group's optimizer state per parameter element."""
        return 4 * len(self.per_element_state(group))


def _adam_state(group: dict) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")


def _rmsprop_state(group: dict) -> tuple[str, ...]:
    return ("square_avg",) + (("momentum_buffer",) if group["momentum"] > 0 else ()) + \
        (("grad_avg",) if group["centered"] else ())


_LR, _WEIGHT_DECAY = ("lr", None), ("weight_decay", None)
_BETAS = (("betas", 0), ("betas", 1))
_ADAM_INPUTS = (_LR, *_BETAS, _WEIGHT_DECAY)  # Adam's, Adamax's, and NAdam's but for its momentum decay
_ADAM = OptimizerSpec(tensor_hyperparams=_ADAM_INPUTS, zero_tested=(_WEIGHT_DECAY,), per_element_state=_adam_state)
SPECS: dict[type, OptimizerSpec] = {
    # With dampening 0, a zero buffer updated once equals the clone torch.optim makes on its first step, bit for
    # bit; with dampening it does not. Dampening is otherwise only computed with (``1 - dampening``), so the test
    # of it here decides the state layout before capture, and the layout is part of the key.
    torch.optim.SGD: OptimizerSpec(
        tensor_hyperparams=(_LR, ("momentum", None), ("dampening", None), _WEIGHT_DECAY),
        zero_tested=(("momentum", None), _WEIGHT_DECAY), scalar_state=(),
        per_element_state=lambda group: ("momentum_buffer",) if group["momentum"] != 0 else (),
        starts_from_gradient=lambda group: group["momentum"] != 0 and group["dampening"] != 0,
        creates_missing_state=True),
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAM,
    torch.optim.Adamax: OptimizerSpec(tensor_hyperparams=_ADAM_INPUTS, zero_tested=(_WEIGHT_DECAY,),
                                      per_element_state=lambda group: ("exp_avg", "exp_inf")),
    torch.optim.NAdam: OptimizerSpec(
        tensor_hyperparams=(*_ADAM_INPUTS, ("momentum_decay", None)), zero_tested=(_WEIGHT_DECAY,),
        scalar_state=(("step", 0.0), ("mu_product", 1.0)), per_element_state=lambda group: ("exp_avg", "exp_avg_sq")),
    torch.optim.RMSprop: OptimizerSpec(
        tensor_hyperparams=(_LR, ("alpha", None), ("momentum", None), _WEIGHT_DECAY),
        zero_tested=(("momentum", None), _WEIGHT_DECAY), per_element_state=_rmsprop_state),
    torch.optim.Adagrad: OptimizerSpec(
        tensor_hyperparams=(_LR, ("lr_decay", None), _WEIGHT_DECAY), zero_tested=(_WEIGHT_DECAY,),
        per_element_state=lambda group: ("sum",), initial_value=lambda group: group["initial_accumulator_value"]),
    torch.optim.Adadelta: OptimizerSpec(tensor_hyperparams=(_LR, ("rho", None), _WEIGHT_DECAY),
                                        zero_tested=(_WEIGHT_DECAY,),
                                        per_element_state=lambda group: ("square_avg", "acc_delta")),
}
SCALAR_STATE = frozenset(name for spec in SPECS.values() for name, _ in spec.scalar_state)

# Kernel choices, not math: the traced graph holds the per-parameter update either way.
KERNEL_FLAGS = {"foreach": False, "fused": False}


def spec_for(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    spec = SPECS.get(type(optimizer))
    if spec is None:
        supported = ", ".join(sorted(t.__name__ for t in SPECS))
        raise CaptureError(
            f"unsupported optimizer {type(optimizer).__name__}",
            hint=f"zerofx captures {supported}: optimizers whose update is elementwise and branches in Python on "
                 "hyperparameters only",
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


def raw_hyperparam(group: dict, key: HyperparamKey):
    name, index = key
    return group[name] if index is None else group[name][index]


def read_hyperparam(group: dict, key: HyperparamKey) -> float:
    return float(raw_hyperparam(group, key))


def traced_as_tensor(spec: OptimizerSpec, group: dict, key: HyperparamKey) -> bool:
    """Whether the hyperparameter enters the graph as the tensor the user gave (``lr=torch.tensor(1e-3)``):
    torch.optim then computes with it in its dtype, as it does eagerly. A number, or a tensor compared with zero
    (the key holds its sign), enters as a number."""
    return isinstance(raw_hyperparam(group, key), torch.Tensor) and key not in spec.zero_tested


def write_hyperparam(group: dict, key: HyperparamKey, value) -> None:
    name, index = key
    if index is None:
        group[name] = value
    else:
        items = list(group[name])
        items[index] = value
        group[name] = tuple(items)


def zero_side(value) -> str:
    """What the guard key holds for a zero-tested hyperparameter: its sign."""
    return "> 0" if value > 0 else "< 0" if value < 0 else "== 0"


def assume_zero_side(traced: torch.SymFloat, value) -> None:
    """State to the tracer the sign that the key records for ``value``, so torch.optim's ``if traced != 0`` (SGD)
    or ``if traced > 0`` (RMSprop's momentum) is decided while ``traced`` stays symbolic in the arithmetic. At zero
    the tracer folds it to 0.0, exact for every value with that key."""
    torch._check(traced > 0 if value > 0 else traced < 0 if value < 0 else traced == 0)


def hyperparam_name(key: HyperparamKey) -> str:
    name, index = key
    return name if index is None else f"{name}[{index}]"
