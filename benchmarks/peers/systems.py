"""The systems compared. Each starts from the same model (same seed; the GPT or a Hugging Face Llama, `models`),
trains it with AdamW over nanoGPT's two parameter groups at the same learning rate, and exposes one call:
``step(x, y) -> loss`` on this rank's batch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

import zerofx
from nanogpt import GPTConfig, param_groups
from peers.models import build, checkpoint_blocks

LR = 3e-3
WEIGHT_DECAY = 0.1


@dataclass
class System:
    name: str
    precision: str  # "fp32" or "bf16"
    stage: int  # the ZeRO stage whose formula describes what it keeps
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    keep: list = field(default_factory=list)  # objects the step needs alive
    held_plan_bytes: Callable[[], int] = lambda: 0  # what zerofx's memory_plan keeps between steps


def _train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


def zerofx_system(cfg: GPTConfig, stage: int, bf16: bool, bucket_bytes: int | None = None,
                  reshard_after_forward: bool = True, checkpoint: bool = False, **options) -> System:
    """zerofx as its users run it (``bucket_bytes=None``: units from the model's blocks), or with buckets given;
    ``checkpoint``: its own activation checkpointing of the blocks; ``options``: any other ``zerofx.compile``
    keywords."""
    model = build(cfg)
    optimizer = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR)
    mixed = zerofx.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    compiled = zerofx.compile(_train_step, stage=stage, bucket_bytes=bucket_bytes, mixed_precision=mixed,
                              reshard_after_forward=reshard_after_forward, checkpoint="blocks" if checkpoint else None,
                              **options)
    name = f"zerofx-{stage}" + ("" if reshard_after_forward or stage < 3 else " no-reshard") + \
        ("" if bucket_bytes is None else " tuned buckets")
    return System(name, "bf16" if bf16 else "fp32", stage, lambda x, y: compiled(model, optimizer, x, y),
                  keep=[model, optimizer, compiled], held_plan_bytes=lambda: compiled.stats().held_plan_bytes)


def ddp_system(cfg: GPTConfig, checkpoint: bool = False) -> System:
    """DDP at its defaults (25 MiB buckets), as its users run it; ``checkpoint``: each block checkpointed."""
    from torch.nn.parallel import DistributedDataParallel

    model = checkpoint_blocks(build(cfg)) if checkpoint else build(cfg)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR)
    return System("DDP", "fp32", 0, lambda x, y: _train_step(ddp, optimizer, x, y), keep=[ddp, optimizer])


def fsdp2_system(cfg: GPTConfig, bf16: bool, reshard_after_forward: bool, checkpoint: bool = False) -> System:
    """``fully_shard`` per block and at the root; ``checkpoint``: each block checkpointed first (torchtitan's order)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = checkpoint_blocks(build(cfg)) if checkpoint else build(cfg)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR)
    name = "FSDP2 reshard" if reshard_after_forward else "FSDP2 no-reshard"
    return System(name, "bf16" if bf16 else "fp32", 3, lambda x, y: _train_step(model, optimizer, x, y),
                  keep=[model, optimizer])


def deepspeed_system(cfg: GPTConfig, stage: int, bf16: bool, batch_size: int, bucket_elements: int | None) -> System:
    """DeepSpeed on CPU (``DS_ACCELERATOR=cpu``) over the gloo group already set up, with torch's AdamW. With
    ``bucket_elements`` its buckets match zerofx's and stage 3 shards every parameter as zerofx does; ``None`` keeps
    DeepSpeed's defaults (buckets of 5e8 elements, parameters under 1e5 elements left unsharded at stage 3)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    model = build(cfg)
    zero: dict = {"stage": stage}
    if bucket_elements is not None:
        zero.update(reduce_bucket_size=bucket_elements, allgather_bucket_size=bucket_elements,
                    stage3_prefetch_bucket_size=bucket_elements, stage3_param_persistence_threshold=0)
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; the other systems do not clip
        "steps_per_print": 2**31 - 1,
    }
    own_linear = torch.nn.functional.linear
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, WEIGHT_DECAY),
                                           config=config, dist_init_required=False)
    # ZeRO-3 replaces torch.nn.functional.linear for the whole process ("This will persist unless manually
    # reset"): it changes every other system's numerics and memory. Its linear is put back only for its own steps.
    ds_linear, torch.nn.functional.linear = torch.nn.functional.linear, own_linear

    def step(x, y):
        torch.nn.functional.linear = ds_linear
        try:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        finally:
            torch.nn.functional.linear = own_linear
        return loss

    name = f"DeepSpeed-{stage}" + ("" if bucket_elements is not None else " defaults")
    return System(name, "bf16" if bf16 else "fp32", stage, step, keep=[engine])


def release(system: System) -> None:
    """Drop the system's model and state (DeepSpeed's default buckets alone are gigabytes)."""
    system.keep.clear()
    system.step = None
