"""Full (unsharded) state of a compiled step: gather it for inspection or saving, or load one to shard it.

Layout, keyed by fully qualified names as ``torch.distributed.checkpoint.state_dict.get_state_dict`` keys them::

    {"model": {"wte.weight": tensor, ..., "bn.running_mean": tensor},
     "optimizer": {"state": {"wte.weight": {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}, ...},
                   "param_groups": [{"lr": ..., "params": ["wte.weight", ...]}, ...]},
     "loss_scale": {"scale": 65536.0, "growth_tracker": 0}}          # float16 mixed precision only
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerofx.sharding import gather_full


def full_state_dict(step, *, rank0_only: bool = False) -> dict:
    """Every rank must call it (stage 3 gathers). With ``rank0_only`` the other ranks get an empty dict."""
    binding, args, owned = _bound(step)
    fqn_of = binding.fqn_of
    model = {}
    for name, fqn in binding.param_aliases.items():
        model[name] = _full_param(fqn, binding, owned)
    for name, fqn in binding.buffer_aliases.items():
        model[name] = binding.buffers[fqn].detach().clone()
    optimizers = []
    for oi, opt in enumerate(binding.optimizers(args)):
        state = {}
        for p, entries in opt.state.items():
            fqn = fqn_of[id(p)]
            state[fqn] = {key: _full_state(oi, fqn, key, value, owned) for key, value in entries.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
                  for g in opt.param_groups]
        optimizers.append({"state": state, "param_groups": groups})
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    out = {"model": model, "optimizer": optimizers[0] if len(optimizers) == 1 else optimizers}
    if owned is not None and owned.loss_scale is not None:
        out["loss_scale"] = {"scale": owned.loss_scale.item(), "growth_tracker": int(owned.growth_tracker.item())}
    return out


def load_full_state_dict(step, state_dict: dict) -> None:
    """Load a full state dict (the layout above) into the step: each rank keeps its shards."""
    binding, args, owned = _bound(step)
    model = state_dict["model"]
    missing = sorted(set(binding.param_aliases) - set(model))
    extra = sorted(set(model) - set(binding.param_aliases) - set(binding.buffer_aliases))
    if missing or extra:
        raise KeyError(f"state dict does not fit the model: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for fqn, p in binding.params.items():
            value = model[fqn]
            if owned is not None and fqn in owned.layouts:
                layout = owned.layouts[fqn]
                target = owned.params[fqn]
                compute = value.to(target.dtype)
                if owned.stage == 0:
                    target.copy_(compute)
                    p.copy_(value)
                else:
                    target.copy_(layout.padded_flat(compute) if target.numel() == layout.padded_numel
                                 else layout.shard_of(compute, owned.rank))
                if fqn in owned.masters:
                    owned.masters[fqn].copy_(layout.shard_of(value, owned.rank))
            else:
                p.copy_(value)
        for fqn, buf in binding.buffers.items():
            buf.copy_(model[fqn])
        fqn_of = binding.fqn_of
        opt_sds = state_dict["optimizer"] if isinstance(state_dict["optimizer"], list) else [state_dict["optimizer"]]
        for oi, (opt, sd) in enumerate(zip(binding.optimizers(args), opt_sds)):
            for p, entries in opt.state.items():
                fqn = fqn_of[id(p)]
                for key in entries:
                    value = sd["state"][fqn][key]
                    if owned is not None and (oi, fqn, key) in owned.opt_state:
                        target = owned.opt_state[(oi, fqn, key)]
                        sharded = (oi, fqn, key) in owned.sharded_state_keys
                        target.copy_(owned.layouts[fqn].shard_of(value, owned.rank) if sharded else value)
                    else:
                        entries[key].copy_(value)
            for group, saved in zip(opt.param_groups, sd["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
        if "loss_scale" in state_dict and owned is not None and owned.loss_scale is not None:
            owned.loss_scale.fill_(state_dict["loss_scale"]["scale"])
            owned.growth_tracker.fill_(state_dict["loss_scale"]["growth_tracker"])


def _bound(step):
    if step._binding is None:
        raise RuntimeError("the step has not run yet: its state is bound on the first call")
    return step._binding, step._args, step._owned


def _full_param(fqn, binding, owned) -> torch.Tensor:
    """The full parameter in its master precision: fp32 under mixed precision."""
    if owned is None or fqn not in owned.layouts or owned.stage == 0:
        return binding.params[fqn].detach().clone()
    layout = owned.layouts[fqn]
    if fqn in owned.masters:
        return gather_full(layout, owned.masters[fqn])
    stored = owned.params[fqn]
    return layout.unpad(stored).clone() if stored.numel() == layout.padded_numel else gather_full(layout, stored)


def _full_state(oi, fqn, key, value, owned):
    if owned is None:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value
    if (oi, fqn, key) in owned.sharded_state_keys:
        return gather_full(owned.layouts[fqn], owned.opt_state[(oi, fqn, key)])
    stored = owned.opt_state.get((oi, fqn, key), value)
    return stored.detach().clone() if isinstance(stored, torch.Tensor) else stored
