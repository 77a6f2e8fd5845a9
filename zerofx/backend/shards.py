"""Stages 1-3 through the backend: the state ``zerofx.prepare`` takes, and the eager ``optimizer.step()`` on it.

``prepare`` takes the trainable parameters and their optimizer state as a whole step takes them (`ShardedState`:
stages 1-2 keep each parameter padded and flat, stage 3 this rank's chunk of it; optimizer state is this rank's
chunk at every stage), so ``zerofx.state_dict`` and checkpoints read both paths alike. The optimizer's
``param_groups`` then hold, in place of each parameter, a flat parameter over this rank's chunk (its shard), with
that chunk's state: ``optimizer.step()`` updates shards only, with their shard-shaped gradients, which the compiled
backward graphs hand over (`receive_grad`) instead of autograd.

What the model's parameters are: at stages 1-2 views of the padded flat storage (so an update of a shard is an update
of the parameter's chunk, and `gather_after_update`'s graph gathers the other ranks' chunks into the rest); at stage
3 full-shaped tensors without memory, which Dynamo and autograd see as the parameters (shapes, strides, dtype) and
which no compiled graph reads: each runs on the shards, gathering what it reads.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from zerofx import collectives
from zerofx.api import UNSHARDED_BUCKET_BYTES
from zerofx.backend.update_graph import gather_after_update
from zerofx.binding import StepBinding
from zerofx.mesh import MeshRanks
from zerofx.passes import PassContext
from zerofx.sharded_state import ShardedState
from zerofx.sharding import ParamLayout, gather_full


class Shards:
    """This rank's shards of a prepared model and optimizer (stages 1-3)."""

    def __init__(self, binding: StepBinding, model: nn.Module, optimizer: torch.optim.Optimizer, stage: int,
                 ranks: MeshRanks):
        self.stage, self.ranks = stage, ranks
        self.layouts = {fqn: ParamLayout(fqn, tuple(p.shape), p.dtype, ranks.size)
                        for fqn, p in binding.params.items() if p.requires_grad}
        self.state = ShardedState.take(binding, (model, optimizer), self.layouts, stage, ranks.rank,
                                       group=ranks.group)
        self.params = {fqn: nn.Parameter(self._chunk(fqn)) for fqn in self.layouts}
        for fqn, layout in self.layouts.items():
            binding.params[fqn].data = layout.unpad(self.state.params[fqn]) if stage < 3 else _hollow(layout,
                                                                                                   self._chunk(fqn))
        self._update_order = self._point_optimizer_at_shards(binding, optimizer)
        self._gather = None  # stages 1-2: the graph that gathers the updated chunks, built on the first step

    def _chunk(self, fqn: str) -> torch.Tensor:
        stored, layout = self.state.params[fqn], self.layouts[fqn]
        return stored.view(layout.world_size, layout.shard_numel)[self.ranks.rank] if self.stage < 3 else stored

    def _point_optimizer_at_shards(self, binding: StepBinding, optimizer: torch.optim.Optimizer) -> list[str]:
        """Swap each parameter the shards replace for its shard in ``optimizer``, with the state the shards hold;
        the names of the parameters in the order the optimizer updates them."""
        fqn_of = binding.fqn_of
        order = []
        for group in optimizer.param_groups:
            order += [fqn_of[id(p)] for p in group["params"] if fqn_of[id(p)] in self.params]
            group["params"] = [self.params.get(fqn_of[id(p)], p) for p in group["params"]]
        for p in [p for p in optimizer.state if fqn_of[id(p)] in self.params]:
            fqn = fqn_of[id(p)]
            entries = optimizer.state.pop(p)
            optimizer.state[self.params[fqn]] = {key: self.state.opt_state.get((0, fqn, key), value)
                                                 for key, value in entries.items()}
        # checkpoints name the optimizer's state by the parameter a shard belongs to
        fqn_of.update({id(shard): fqn for fqn, shard in self.params.items()})
        return order

    @contextlib.contextmanager
    def gathered(self, binding: StepBinding):
        """Stage 3: the parameters full inside the block (for code that runs the model without the backend, which
        would read parameters that hold nothing), and without memory again after it."""
        if self.stage < 3:
            yield
            return
        for fqn, layout in self.layouts.items():
            binding.params[fqn].data = gather_full(layout, self.state.params[fqn], self.ranks.group)
        try:
            yield
        finally:
            for fqn, layout in self.layouts.items():
                binding.params[fqn].data = _hollow(layout, self.state.params[fqn])

    def graph_input(self, fqn: str) -> torch.Tensor:
        """Stage 3: what a compiled graph takes in place of parameter ``fqn``: this rank's shard."""
        return self.state.params[fqn]

    def receive_grad(self, fqn: str, shard: torch.Tensor) -> None:
        """A compiled backward's contribution to parameter ``fqn``'s gradient, averaged over ranks: this rank's
        shard of it, accumulated as autograd accumulates ``.grad``."""
        p = self.params[fqn]
        if p.grad is None:
            p.grad = shard
        else:
            p.grad.add_(shard)

    def after_update(self, bucket_bytes: int | None) -> list[collectives.CollectiveRecord]:
        """Stages 1-2, after ``optimizer.step()``: every rank's updated chunks gathered into the parameters; the
        collectives it issued."""
        if self.stage >= 3 or not self._update_order:
            return []
        if self._gather is None:
            ctx = PassContext(self.stage, self.ranks.size, self.ranks.group_name,
                              bucket_bytes or UNSHARDED_BUCKET_BYTES)
            first = self.state.params[self._update_order[0]]
            self._gather = gather_after_update([self.layouts[f] for f in self._update_order], ctx, first.device)
        with collectives.recording() as records:
            self._gather(*[self.state.params[f] for f in self._update_order], self.ranks.rank)
        return records


def _hollow(layout: ParamLayout, like: torch.Tensor) -> torch.Tensor:
    """A tensor of the parameter's shape and strides whose storage holds nothing."""
    t = torch.empty(layout.shape, dtype=layout.dtype, device=like.device)
    t.untyped_storage().resize_(0)
    return t
