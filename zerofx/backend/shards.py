"""Stages 1-3, and mixed precision at any stage, through the backend: the state ``zerofx.prepare`` takes, and the
eager ``optimizer.step()`` on it.

``prepare`` takes the trainable parameters and their optimizer state as a whole step takes them (`ShardedState`:
stages 1-2 keep each parameter padded and flat, stage 3 this rank's chunk of it; optimizer state is this rank's
chunk at every stage), so ``zerofx.state_dict`` and checkpoints read both paths alike. The optimizer's
``param_groups`` then hold, in place of each parameter, a flat parameter over this rank's chunk (its shard), with
that chunk's state: ``optimizer.step()`` updates shards only, with their shard-shaped gradients, which the compiled
backward graphs hand over (`receive_grad`) instead of autograd.

Mixed precision: the model's parameters are in ``param_dtype`` (so Dynamo captures, and the graphs run, forward and
backward in it, as a whole step is traced), and what the optimizer holds in their place is the fp32 master weight:
the whole parameter at stage 0, this rank's chunk of it from stage 1 on. The gradients the backward graphs hand over
(reduced in ``MixedPrecision.grad_dtype``) are cast to fp32 for it; after ``optimizer.step()`` the updated masters,
cast to ``param_dtype``, are written into the parameters (stages 0-2, before stages 1-2 gather them); stage 3 keeps
no ``param_dtype`` shard, its graphs gather casts of the master shards (``cast_params_at_gather``).

What the model's parameters are: at stages 1-2 views of the padded flat storage (so an update of a shard is an update
of the parameter's chunk, and `gather_after_update`'s graph gathers the other ranks' chunks into the rest); at stage
3 full-shaped tensors without memory, which Dynamo and autograd see as the parameters (shapes, strides, dtype) and
which no compiled graph reads: each runs on the shards, gathering what it reads; eager code reads their gathered
values (`eager_reads`, `gathered_value`). Gradients autograd accumulated outside the compiled backwards,
full-shaped, are reduced into the shards as a backward ends (`receive_eager_grads`).
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
from zerofx.mixed_precision import MixedPrecision
from zerofx.passes import PassContext
from zerofx.sharded_state import ShardedState
from zerofx.sharding import ParamLayout, gather_full


class Shards:
    """This rank's shards of a prepared model and optimizer (stages 1-3), or its fp32 master weights (stage 0 under
    mixed precision)."""

    def __init__(self, binding: StepBinding, model: nn.Module, optimizer: torch.optim.Optimizer, stage: int,
                 ranks: MeshRanks, mixed: MixedPrecision | None):
        self.stage, self.ranks, self.mixed = stage, ranks, mixed
        self.layouts = binding.trainable_layouts(mixed.param_dtype if mixed else None, ranks.size)
        self.state = ShardedState.take(binding, (model, optimizer), self.layouts, stage, ranks.rank, mixed,
                                       group=ranks.group)
        self.params = {fqn: nn.Parameter(self._updated(fqn, binding)) for fqn in self.layouts}
        for fqn, layout in self.layouts.items():
            binding.params[fqn].data = self._module_param(layout)
        self._update_order = self._point_optimizer_at_shards(binding, optimizer)
        if stage == 0:  # state dicts read a stage-0 step's masters as its module's parameters: these are the masters
            binding.params.update(self.params)
        self._gather = None  # stages 1-2: the graph that gathers the updated chunks, built on the first step

    def _updated(self, fqn: str, binding: StepBinding) -> torch.Tensor:
        """What the optimizer updates in place of parameter ``fqn``: this rank's chunk of it, or under mixed
        precision of its fp32 master (at stage 0 the module's parameter as it was, whole)."""
        if self.stage == 0:
            return binding.params[fqn].detach()
        if self.mixed:
            return self.state.masters[fqn]
        return self._compute_chunk(fqn) if self.stage < 3 else self.state.params[fqn]

    def _compute_chunk(self, fqn: str) -> torch.Tensor:
        """Stages 1-2: this rank's chunk of the padded flat parameter forward reads."""
        layout = self.layouts[fqn]
        return self.state.params[fqn].view(layout.world_size, layout.shard_numel)[self.ranks.rank]

    def _module_param(self, layout: ParamLayout) -> torch.Tensor:
        """What the model's parameter becomes: the low-precision copy (stage 0 under mixed precision), a view of
        the padded flat parameter (stages 1-2), or a tensor of its shape that holds nothing (stage 3)."""
        if self.stage == 3:
            return _hollow(layout, self.state.stored(layout.fqn))
        stored = self.state.params[layout.fqn]
        return stored if self.stage == 0 else layout.unpad(stored)

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

    def _cast_masters_into_params(self) -> None:
        """The whole step's write-back after the update (``compute.copy_(master)``): the same rounding."""
        with torch.no_grad():
            for fqn in self._update_order:
                target = self.state.params[fqn] if self.stage == 0 else self._compute_chunk(fqn)
                target.copy_(self.params[fqn])

    @contextlib.contextmanager
    def gathered(self, binding: StepBinding):
        """Stage 3: the parameters full inside the block (for Dynamo run with another backend, ``graph_breaks``'s
        ``explain``, whose graphs would otherwise read the parameters, not the shards), and without memory again
        after it."""
        if self.stage < 3:
            yield
            return
        with torch._C.DisableTorchFunctionSubclass():  # `ShardedParameter` refuses writes from eager code
            for fqn, layout in self.layouts.items():
                full = gather_full(layout, self.graph_input(fqn), self.ranks.group).to(layout.dtype)
                binding.params[fqn].data = full
        try:
            yield
        finally:
            with torch._C.DisableTorchFunctionSubclass():
                for fqn, layout in self.layouts.items():
                    binding.params[fqn].data = _hollow(layout, self.graph_input(fqn))

    def graph_input(self, fqn: str) -> torch.Tensor:
        """Stage 3: what a compiled graph takes in place of parameter ``fqn``: this rank's shard (under mixed
        precision its fp32 master, which the graph reads as a MASTER input: `aot_graphs.add_master_inputs`)."""
        return self.state.stored(fqn)

    def receive_grad(self, fqn: str, grad: torch.Tensor) -> None:
        """A compiled backward's contribution to parameter ``fqn``'s gradient, averaged over ranks (this rank's
        shard of it from stage 1 on), in the precision of what the optimizer updates, accumulated as autograd
        accumulates ``.grad``."""
        p = self.params[fqn]
        if p.grad is None:
            p.grad = grad.to(p.dtype)
        else:
            p.grad.add_(grad)

    def receive_eager_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Gradients autograd accumulated outside every compiled backward (eager code read those parameters), full
        shaped: averaged over ranks (stage 0) or reduce-scattered (stages 1-3) in one flat buffer per dtype, in
        ``MixedPrecision.grad_dtype``, then added to what the optimizer updates as a compiled backward's are. Every
        rank calls it with the same names (`Prepared` has them agree first)."""
        by_dtype: dict[torch.dtype, list[str]] = {}
        for fqn, grad in grads.items():
            by_dtype.setdefault(self.mixed.grad_dtype if self.mixed else grad.dtype, []).append(fqn)
        group, size = self.ranks.group_name, self.ranks.size
        for dtype, names in by_dtype.items():
            layouts = [self.layouts[fqn] for fqn in names]
            if self.stage == 0:
                flat = torch.cat([grads[fqn].reshape(-1).to(dtype) for fqn in names])
                mine = collectives.wait(collectives.all_reduce(flat, "avg", group, size)) if size > 1 else flat
                pieces = mine.split([l.numel for l in layouts])
            else:  # row r: rank r's chunk of every parameter, so that one reduce-scatter leaves each rank its own
                rows = torch.cat([l.padded_flat(grads[l.fqn].to(dtype)).view(l.world_size, l.shard_numel)
                                  for l in layouts], dim=1).reshape(-1)
                mine = collectives.wait(collectives.reduce_scatter(rows, "avg", group, size)) if size > 1 else rows
                pieces = mine.split([l.shard_numel for l in layouts])
            for layout, piece in zip(layouts, pieces):
                self.receive_grad(layout.fqn, piece.view(layout.shape) if self.stage == 0 else piece)

    def gathered_value(self, fqn: str) -> torch.Tensor:
        """Stage 3: parameter ``fqn`` whole, gathered from every rank's shard (under mixed precision from the casts of
        the master shards, as the graphs gather), for an eager read (`eager_reads`). Every rank calls it."""
        layout = self.layouts[fqn]
        shard = self.graph_input(fqn).to(layout.dtype)
        size = self.ranks.size
        full = collectives.wait(collectives.all_gather(shard, self.ranks.group_name, size)) if size > 1 else shard
        return layout.unpad(full if size > 1 else full.clone())  # never the shard itself, which the optimizer updates

    def write_full(self, fqn: str, full: torch.Tensor) -> None:
        """Stage 3: this rank's chunk of ``full`` (parameter ``fqn``'s new value, whole) into its shard (under mixed
        precision into the fp32 master, so the graphs gather its cast as they gather an updated one)."""
        layout, shard = self.layouts[fqn], self.graph_input(fqn)
        with torch.no_grad():
            shard.copy_(layout.shard_of(full.to(shard.device), self.ranks.rank))

    def after_update(self, bucket_bytes: int | None) -> list[collectives.CollectiveRecord]:
        """After ``optimizer.step()``: under mixed precision (stages 0-2) the updated masters cast into the
        parameters; at stages 1-2 every rank's updated chunks gathered into them. The collectives it issued."""
        if self.mixed and self.stage < 3:
            self._cast_masters_into_params()
        if self.stage in (0, 3) or not self._update_order:
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
