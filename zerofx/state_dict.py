"""The state of a compiled step as state dicts, keyed by fully qualified names as
``torch.distributed.checkpoint.state_dict.get_state_dict`` keys them::

    {"model": {"wte.weight": ..., "head.weight": ..., "bn.running_mean": ...},     # tied names both listed
     "optimizer": {"state": {"wte.weight": {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}, ...},
                   "param_groups": [{"lr": ..., "params": ["wte.weight", ...]}, ...]},
     "loss_scale": {"scale": ..., "growth_tracker": ...}}           # float16 mixed precision only

``state_dict(step)`` gives this rank's shards in place, for ``torch.distributed.checkpoint``: a sharded tensor is a
``ShardedTensor`` of the full shape whose local shards are views of the step's own storage (``flat_shards``), a
replicated one the live tensor itself (a parameter too small to give every rank an element is gathered instead);
``dcp.save`` writes them without gathering and ``dcp.load`` fills them where they live. Buffers are data-parallel rank
0's on every rank (``state_dict`` broadcasts them in place first, as the next step's forward would): whichever rank a
checkpoint takes a replicated tensor from, it holds the values training goes on from. ``full_state_dict(step)``
gathers full copies. ``load_state_dict(step, sd)`` takes either, or DTensors such as FSDP2's; it checks every key
and shape before it changes anything. Parameters are in their master precision (fp32 under mixed precision); the
low-precision compute copies (stages 0-2, and stage 3's shards with ``cast_at_gather=False``) are derived from them
on load, so masters written in place through ``state_dict(step)`` reach them only through ``load_state_dict``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from zerofx import collectives
from zerofx.flat_shards import every_rank_holds, rank_boxes, sharded_view
from zerofx.mesh import wrap
from zerofx.sharding import ParamLayout, gather_full


def state_dict(step) -> dict:
    """This rank's part of the step's state, in place. Every rank calls it (it gathers only parameters smaller than
    about one element per rank)."""
    binding, args, owned = _bound(step)
    if step._specs and owned is not None and owned.stage >= 1:
        raise NotImplementedError("zerofx.state_dict of a step with tensor-parallel (DTensor) parameters: its shards "
                                  "are not laid out for torch.distributed.checkpoint yet; use "
                                  "zerofx.full_state_dict(step)")
    rank = owned.rank if owned is not None else 0
    in_place = (lambda layout, shard: _sharded(layout, shard, rank), torch.Tensor.detach)
    params = {fqn: _param(fqn, binding, owned, *in_place) for fqn in binding.params}
    buffers = _persistent_buffers(binding, args)
    _broadcast_from_first_rank(list(buffers.values()), step.ranks)
    return _assemble(step, params, lambda oi, fqn, key, value: _state(oi, fqn, key, value, owned, *in_place),
                     {"scale": owned.loss_scale, "growth_tracker": owned.growth_tracker} if _scaled(owned) else None,
                     {name: b.detach() for name, b in buffers.items()})


def full_state_dict(step, *, rank0_only: bool = False) -> dict:
    """Full copies of the step's state. Every rank must call it (stages 1-3 gather); with ``rank0_only`` the other
    ranks get an empty dict. Under a mesh, shards are gathered over its ``"dp"`` dimension and a tensor-parallel
    parameter (and its optimizer state) comes back as a DTensor over ``"tp"``, as the model had it."""
    binding, args, owned = _bound(step)
    group, specs = (owned.group if owned is not None else None), step._specs
    gathered = (lambda layout, shard: gather_full(layout, shard, group), lambda t: t.detach().clone())
    params = {fqn: _as_dtensor(_param(fqn, binding, owned, *gathered), specs.params.get(fqn))
              for fqn in binding.params}

    def state(oi, fqn, key, value):
        return _as_dtensor(_state(oi, fqn, key, value, owned, *gathered), specs.states.get((oi, fqn, key)))

    out = _assemble(step, params, state,
                    {"scale": owned.loss_scale.item(), "growth_tracker": int(owned.growth_tracker.item())}
                    if _scaled(owned) else None,
                    {name: b.detach().clone() for name, b in _persistent_buffers(binding, args).items()})
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out


def load_state_dict(step, sd: dict) -> None:
    """Load ``sd`` (this module's layout, with full tensors, this step's sharded ones, or DTensors) into the step:
    each rank keeps its shards. Raises ``KeyError`` naming every missing or unexpected key and ``ValueError`` for a
    shape that differs, before anything is changed."""
    binding, args, owned = _bound(step)
    if step._specs and owned is not None and owned.stage >= 1:
        raise NotImplementedError("zerofx.load_state_dict into a step with tensor-parallel (DTensor) parameters at "
                                  f"stage {owned.stage} is not supported yet; load the model and optimizer before "
                                  "compiling, or use stage 0")
    expected = state_dict(step)
    _check_fits(expected, sd, binding)
    with torch.no_grad():
        for fqn in binding.params:
            _load_param(fqn, sd["model"][fqn], binding, owned)
        for name, buffer in _persistent_buffers(binding, args).items():
            buffer.copy_(_full(sd["model"][name], name))
        opt_sds = sd["optimizer"] if isinstance(sd["optimizer"], list) else [sd["optimizer"]]
        for oi, (opt, saved) in enumerate(zip(binding.optimizers(args), opt_sds)):
            _load_optimizer(oi, opt, saved, binding, owned)
        if _scaled(owned) and "loss_scale" in sd:
            owned.loss_scale.fill_(float(sd["loss_scale"]["scale"]))
            owned.growth_tracker.fill_(int(sd["loss_scale"]["growth_tracker"]))
        _refresh_compute_copies(binding, owned)


def _bound(step):
    if step._binding is None or (step._owned is None and (step.config.stage >= 1 or step.config.mixed_precision)):
        raise RuntimeError("the step is not bound to a model and optimizer yet: call step.bind(model, optimizer, "
                           "*example_batch) or run it once")
    return step._binding, step._args, step._owned


def _scaled(owned) -> bool:
    return owned is not None and owned.loss_scale is not None


def _assemble(step, params: dict, state_value, loss_scale: dict | None, buffers: dict) -> dict:
    binding, args = step._binding, step._args
    model = {name: params[fqn] for name, fqn in binding.param_aliases.items()}
    model.update(buffers)
    fqn_of = binding.fqn_of
    optimizers = []
    for oi, opt in enumerate(binding.optimizers(args)):
        state = {}
        for fqn, entries in binding.optimizer_state(opt):
            state[fqn] = {key: state_value(oi, fqn, key, value) for key, value in entries.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
                  for g in opt.param_groups]
        optimizers.append({"state": state, "param_groups": groups})
    out = {"model": model, "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers}
    if loss_scale is not None:
        out["loss_scale"] = loss_scale
    return out


def _persistent_buffers(binding, args) -> dict[str, torch.Tensor]:
    """The buffers a module's own ``state_dict`` lists (non-persistent ones are left out, as there), by name."""
    names = []
    for pos, module in zip(binding.module_positions, binding.modules(args)):
        prefix = "" if len(binding.module_positions) == 1 else f"arg{pos}."
        names += [prefix + n for n in module.state_dict(keep_vars=True) if prefix + n in binding.buffer_aliases]
    return {name: binding.buffers[binding.buffer_aliases[name]] for name in names}


def _broadcast_from_first_rank(buffers: list[torch.Tensor], ranks) -> None:
    """Overwrite ``buffers`` in place with data-parallel rank 0's values: one flat broadcast per dtype."""
    if ranks.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    for same_dtype in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in same_dtype])
        collectives.broadcast_control(flat, 0, ranks.group)
        for b, piece in zip(same_dtype, flat.split([b.numel() for b in same_dtype])):
            b.detach().copy_(piece.view_as(b))


# --- reading -------------------------------------------------------------------------------------------------------

def _sharded(layout: ParamLayout, shard: torch.Tensor, rank: int):
    if layout.world_size == 1:
        return layout.unpad(shard)
    if not every_rank_holds(layout):  # fewer elements than ranks, about: a gathered copy, loaded back by copying
        return gather_full(layout, shard)
    return sharded_view(layout, shard, rank)


def _param(fqn, binding, owned, of_shard, whole):
    """Parameter ``fqn`` as ``of_shard(layout, shard)`` where the step holds a shard, else as ``whole(tensor)``."""
    if owned is None or fqn not in owned.layouts or owned.stage == 0:
        return whole(binding.params[fqn])
    layout = owned.layouts[fqn]
    stored = owned.stored(fqn)
    if stored.numel() == layout.padded_numel:  # stages 1-2 (or one rank): the whole parameter, padded
        return whole(layout.unpad(stored))
    return of_shard(layout, stored)


def _as_dtensor(value, spec):
    return value if spec is None or isinstance(value, DTensor) else wrap(value, spec)


def _state(oi, fqn, key, value, owned, of_shard, whole):
    if owned is not None and (oi, fqn, key) in owned.sharded_state_keys:
        return of_shard(owned.layouts[fqn], owned.opt_state[(oi, fqn, key)])
    stored = owned.opt_state.get((oi, fqn, key), value) if owned is not None else value
    return whole(stored) if isinstance(stored, torch.Tensor) else stored


# --- loading -----------------------------------------------------------------------------------------------------

OPTIONAL_KEYS = ("loss_scale.",)  # a float16 run's loss scale: kept or dropped when the precision changes on resume


def global_shape(value) -> tuple[int, ...] | None:
    """The full shape of a tensor, DTensor or ShardedTensor; None for anything else."""
    if isinstance(value, ShardedTensor):
        return tuple(value.metadata().size)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _check_fits(expected: dict, given: dict, binding) -> None:
    """Every key of ``expected`` is in ``given`` and no other; tensors have the same shapes; groups hold the same
    parameters. One error lists every difference."""
    want, have = flatten(expected), flatten(given)
    missing = sorted(k for k in set(want) - set(have) if not k.startswith(OPTIONAL_KEYS))
    unexpected = sorted(k for k in set(have) - set(want) if not k.startswith(OPTIONAL_KEYS))
    if missing or unexpected:
        raise KeyError(f"state dict does not fit the step: missing {missing}, unexpected {unexpected}")
    shapes = [f"{key}: {global_shape(have[key])} given, {global_shape(value)} expected" for key, value in want.items()
              if key in have and global_shape(have[key]) not in (None, global_shape(value))]
    if shapes:
        raise ValueError("state dict does not fit the step: shapes differ for " + "; ".join(shapes))
    for key, value in want.items():
        if key.endswith(".params") and ".param_groups." in key:
            mine = [binding.param_aliases[n] for n in value]
            theirs = [binding.param_aliases.get(n, n) for n in have[key]]
            if mine != theirs:
                raise ValueError(f"state dict does not fit the step: {key} holds {theirs}, the optimizer {mine}")


def flatten(sd, prefix: str = "") -> dict:
    """``{dotted.key: value}`` as ``torch.distributed.checkpoint`` flattens nested dicts and lists."""
    if _is_leaf(sd):
        return {prefix[:-1]: sd}
    out = {}
    for k, v in (sd.items() if isinstance(sd, dict) else enumerate(sd)):
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def _is_leaf(value) -> bool:
    """DCP's rule: dicts are traversed; a list too if it holds a tensor, a dict or a traversed list."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or not _is_leaf(v) for v in value)


def _full(value, name: str) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, ShardedTensor):
        raise ValueError(f"{name}: a ShardedTensor of another layout; load it with torch.distributed.checkpoint, "
                         "which reshards")
    return value


def _shard(value, layout: ParamLayout, rank: int, name: str) -> torch.Tensor:
    """This rank's flat shard of ``value`` (full, DTensor, or a ShardedTensor laid out as ``layout``)."""
    if not isinstance(value, ShardedTensor):
        return layout.shard_of(_full(value, name), rank)
    boxes = {box.offsets: box for box in rank_boxes(layout, rank)}
    local = value.local_shards()
    if sorted(tuple(s.metadata.shard_offsets) for s in local) != sorted(boxes):
        raise ValueError(f"{name}: sharded for another world size; load it with torch.distributed.checkpoint, "
                         "which reshards")
    like = local[0].tensor if local else torch.empty(0, dtype=layout.dtype)
    shard = torch.zeros(layout.shard_numel, dtype=like.dtype, device=like.device)
    start = rank * layout.shard_numel
    for s in local:
        box = boxes[tuple(s.metadata.shard_offsets)]
        shard[box.flat_start - start:box.flat_start - start + box.numel] = s.tensor.reshape(-1)
    return shard


def _load_param(fqn, value, binding, owned) -> None:
    p = binding.params[fqn]
    if owned is None or fqn not in owned.layouts or owned.stage == 0:
        p.copy_(_full(value, fqn))
        return
    layout = owned.layouts[fqn]
    target = owned.stored(fqn)
    if target.numel() == layout.padded_numel and layout.world_size > 1:  # stages 1-2 store the full parameter
        full = gather_full(layout, _shard(value, layout, owned.rank, fqn)) if isinstance(value, ShardedTensor) \
            else _full(value, fqn)
        target.copy_(layout.padded_flat(full))
    else:
        target.copy_(_shard(value, layout, owned.rank, fqn))


def _load_optimizer(oi, opt, saved: dict, binding, owned) -> None:
    for fqn, entries in binding.optimizer_state(opt):
        for key, current in entries.items():
            value = saved["state"][fqn][key]
            name = f"optimizer.state.{fqn}.{key}"
            if owned is not None and (oi, fqn, key) in owned.sharded_state_keys:
                owned.opt_state[(oi, fqn, key)].copy_(_shard(value, owned.layouts[fqn], owned.rank, name))
            elif isinstance(current, torch.Tensor):
                target = owned.opt_state.get((oi, fqn, key), current) if owned is not None else current
                target.copy_(_full(value, name))
            else:
                entries[key] = value
    for group, saved_group in zip(opt.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _refresh_compute_copies(binding, owned) -> None:
    """Mixed precision: the low-precision parameters forward reads, from the loaded master weights."""
    if owned is None or owned.mixed is None:
        return
    for fqn, layout in owned.layouts.items():
        if owned.stage == 0:
            owned.params[fqn].copy_(binding.params[fqn])
        elif owned.stage < 3:
            owned.params[fqn].copy_(layout.padded_flat(gather_full(layout, owned.masters[fqn])))
        elif fqn in owned.params:  # stage 3 keeps a param_dtype shard only with cast_at_gather=False
            owned.params[fqn].copy_(owned.masters[fqn])
