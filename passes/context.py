"""What a pass may know: the communication group and the rank-independent configuration. Never the rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PassContext:
    stage: int
    world_size: int
    group_name: str | None  # resolved by the functional collectives; None when world_size is 1
    bucket_bytes: int
    prefetch: int = 1  # stage 3: all-gathers issued this many buckets ahead of use
    reshard_after_forward: bool = True  # stage 3: gather again in backward instead of keeping forward's copies
    reduce_dtype: torch.dtype | None = None  # gradients are cast to this before reduction; None: as computed
    # fqn -> its unit's module path (empty: no unit found, units are cut at unit_cap_bytes alone); None: the user
    # gave bucket_bytes, which then groups every collective
    units: dict[str, str] | None = None
    unit_cap_bytes: int = 64 * 2**20  # no unit is larger (C_B; zerofx.units.UNIT_CAP_BYTES by default)
    # checkpointed regions keep, besides their inputs, this fraction of what backward reads from them; None: inputs
    activation_budget: float | None = None
    offload_activations: bool = False  # checkpointed regions' saved inputs wait in host memory (P_a+cpu)
    recompute_pointwise: bool = False  # backward recomputes cheap pointwise outputs from inputs it keeps anyway
    # tensor parallelism (a mesh's "tp" dimension): its size and group, the parameters whose local tensors differ
    # across its ranks (split by parallelize_module), and whether checkpoints are split across it (P_a)
    tp_size: int = 1
    tp_group_name: str | None = None
    tp_sharded: frozenset[str] = frozenset()
    partition_activations: bool = False
    memory_plan: bool = False  # M_D: intermediates written into one arena, reused every step
    # stage 0: the per-step rank agreement rides on the first bucket (the data-parallel group is every rank)
    carry_agreement: bool = False
    # parameters the step's state already owns (stages 1-3): stored as the trained ones are, even where this graph
    # computes no gradient for them (an evaluation through the step)
    owned_params: frozenset[str] = frozenset()
    # parameters whose gradient the step leaves for its next call to accumulate into (an update every k-th call):
    # from stage 1 on the step keeps this rank's reduced shard of it
    grads_kept: frozenset[str] = frozenset()
    artifacts: dict[str, Any] = field(default_factory=dict)  # what passes leave for the runtime and reports
