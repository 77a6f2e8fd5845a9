"""The paper's formulas as sympy expressions: model-state bytes and communication per rank and step.

b_p bytes per stored parameter element, b_g per gradient element, K per parameter for master weights and optimizer
state; Ψ parameters over N_d ranks; M micro-batches per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

Psi, N_d, b_p, b_g, K, M = sympy.symbols("Psi N_d b_p b_g K M", positive=True)

# per category: (params, grads, master weights + optimizer state)
_CATEGORIES = {
    0: (b_p * Psi, b_g * Psi, K * Psi),
    1: (b_p * Psi, b_g * Psi, K * Psi / N_d),
    2: (b_p * Psi, b_g * Psi / N_d, K * Psi / N_d),
    3: (b_p * Psi / N_d, b_g * Psi / N_d, K * Psi / N_d),
}


@dataclass(frozen=True)
class Formula:
    stage: int
    params: sympy.Expr
    grads: sympy.Expr
    optimizer: sympy.Expr  # master weights and optimizer state: K
    comm: sympy.Expr  # elements this rank sends per step
    bytes_per_element: dict  # {b_p: 4, b_g: 4, K: 8} for fp32 Adam; M: micro-batches per step

    @property
    def model_states(self) -> sympy.Expr:
        return self.params + self.grads + self.optimizer

    def evaluate(self, expr: sympy.Expr, psi: int, world_size: int) -> float:
        return float(expr.subs({**self.bytes_per_element, Psi: psi, N_d: world_size}))


def formula(stage: int, *, b_param: int = 4, b_grad: int = 4, k_optimizer: int = 8,
            reshard_after_forward: bool = True, micro_batches: int = 1, casts_masters: bool = False) -> Formula:
    """Stage 0-3 formulas; the defaults are fp32 Adam (the fp32 parameters are the master weights).

    ``casts_masters``: stage 3 under mixed precision, where zerofx (as FSDP2) keeps no low-precision shard and
    gathers casts of the fp32 masters: the b_pΨ/N_d term is gone, (b_g + K)Ψ/N_d in all.

    Communication with M micro-batches per step: stages 0-1 reduce once (2Ψ); stage 2 reduce-scatters every
    micro-batch and gathers once ((M+1)Ψ); stage 3 gathers twice and reduce-scatters once per micro-batch (3MΨ;
    2MΨ without resharding)."""
    params, grads, optimizer = _CATEGORIES[stage]
    if casts_masters and stage == 3:
        params = sympy.Integer(0)
    moved = {0: 2, 1: 2, 2: M + 1, 3: (3 if reshard_after_forward else 2) * M}[stage]
    comm = moved * Psi * (N_d - 1) / N_d
    values = {b_p: b_param, b_g: b_grad, K: k_optimizer, M: micro_batches}
    return Formula(stage, params, grads, optimizer, comm, values)


def optimizer_bytes_per_param(optimizer) -> int:
    """K for fp32 state: bytes of optimizer state per parameter element (Adam 8, SGD with momentum 4), the most of
    any of its groups."""
    from zerofx import optim_support

    spec = optim_support.spec_for(optimizer)
    return max((spec.state_bytes_per_element(group) for group in optimizer.param_groups), default=0)
