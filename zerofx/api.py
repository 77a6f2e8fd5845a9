"""The public entry point: ``zerofx.compile(train_step, stage=...)`` and the step it returns."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from zerofx import collectives, guards, optim_support, ranks, runtime
from zerofx.capture import StepBinding
from zerofx.passes import PassContext
from zerofx.stats import StepStats

log = logging.getLogger("zerofx")


@dataclass(frozen=True)
class Config:
    stage: int = 0
    bucket_bytes: int = 25 * 2**20
    dump_dir: str | None = None
    verify_ranks: bool = True  # one 8-byte all-gather per step: a rank that diverges raises instead of hanging

    def __post_init__(self):
        if self.stage not in (0,):
            raise ValueError(f"stage={self.stage!r}: zerofx implements stage 0 so far")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")


def compile(train_step=None, *, stage: int = 0, bucket_bytes: int = 25 * 2**20, dump_dir: str | None = None,
            verify_ranks: bool = True):
    """Capture ``train_step(model, optimizer, *batch)`` into one graph on its first call and run it data-parallel.

    Usable as ``step = zerofx.compile(train_step, stage=0)`` or as a decorator ``@zerofx.compile(stage=0)``.
    ``dump_dir`` (or the environment variable ``ZEROFX_DUMP``) writes the graph after capture and after each pass.
    """
    config = Config(stage, bucket_bytes, dump_dir or os.environ.get("ZEROFX_DUMP"), verify_ranks)
    if train_step is None:
        return functools.partial(CompiledStep, config=config)
    return CompiledStep(train_step, config=config)


class CompiledStep:
    def __init__(self, train_step, *, config: Config):
        functools.update_wrapper(self, train_step)
        self.train_step = train_step
        self.config = config
        self._cache: dict[tuple, runtime.CompiledGraph] = {}
        self._binding: StepBinding | None = None
        self._binding_ids: tuple = ()
        self._last_key: dict | None = None
        self._last: runtime.CompiledGraph | None = None
        self._last_records: list = []

    def __call__(self, *args):
        with collectives.recording() as records:
            out = self._step(args)
        self._last_records = records
        return out

    def _step(self, args: tuple):
        binding = self._bind(args)
        for opt in binding.optimizers(args):
            optim_support.init_lazy_state(opt)
        world_size, group_name = runtime.world()
        key = guards.step_key(binding, args)
        if world_size > 1 and self.config.verify_ranks:
            ranks.verify_same(guards.key_hash(key), "the step's inputs",
                              lambda: guards.describe_change({}, key) if self._last_key is None
                              else f"{guards.describe_change(self._last_key, key) or 'same as its last step'}")
        frozen = guards.freeze(key)
        compiled = self._cache.get(frozen)
        if compiled is None:
            compiled = self._build(binding, args, key, frozen, world_size, group_name)
        if world_size > 1 and not compiled.verified:
            ranks.verify_same(compiled.fingerprint, "the captured graph",
                              lambda: f"graph fingerprint {compiled.fingerprint:x}")
            compiled.verified = True
        self._last_key, self._last = key, compiled
        return runtime.execute(compiled, binding, args)

    def _bind(self, args: tuple) -> StepBinding:
        ids = tuple(id(a) for a in args if isinstance(a, (nn.Module, torch.optim.Optimizer)))
        if self._binding is None or ids != self._binding_ids:
            first = self._binding is None
            self._binding, self._binding_ids = StepBinding.from_args(args), ids
            world_size, _ = runtime.world()
            if first and world_size > 1:
                runtime.sync_module_states(self._binding)
        return self._binding

    def _build(self, binding, args, key, frozen, world_size, group_name) -> runtime.CompiledGraph:
        if self._last_key is not None:
            log.warning("zerofx: re-tracing %s because %s", self.train_step.__name__,
                        guards.describe_change(self._last_key, key))
        dump_dir = self.config.dump_dir
        if dump_dir and self._cache:
            dump_dir = os.path.join(dump_dir, f"trace{len(self._cache)}")
        if dump_dir and world_size > 1 and dist.get_rank() != 0:
            dump_dir = None  # the graph is the same on every rank: rank 0 writes it
        ctx = PassContext(self.config.stage, world_size, group_name, self.config.bucket_bytes)
        compiled = runtime.build(self.train_step, binding, args, ctx, dump_dir)
        self._cache[frozen] = compiled
        return compiled

    def graph(self, name: str | None = None) -> fx.GraphModule:
        """The final graph of the last step, or the graph after capture ("capture") or after the named pass."""
        if self._last is None:
            raise RuntimeError("the step has not run yet: call it once before asking for its graph")
        if name is None:
            return self._last.gm
        if name not in self._last.snapshots:
            raise KeyError(f"no graph named {name!r}; known: {', '.join(self._last.snapshots)}")
        return self._last.snapshots[name]

    def stats(self) -> StepStats:
        if self._last is None:
            raise RuntimeError("the step has not run yet: call it once before asking for its stats")
        binding = self._binding
        num_params = sum(p.numel() for p in binding.params.values() if p.requires_grad)
        return StepStats(self.config.stage, self._last.ctx.world_size, num_params, list(self._last_records),
                         traces=len(self._cache))
