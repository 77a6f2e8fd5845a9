"""ZeRO over the "dp" dimension of a 2 × 2 mesh, tensor parallelism over "tp": zerofx against FSDP2 (``fully_shard``
over "dp") with the same ``parallelize_module`` plan, in eager. test_tensor_parallel.py calls these."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zerofx
from models import GPTConfig, TensorParallelGPT, token_batch, train_step
from nanogpt import param_groups

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}


def _tensor_parallel_model(mesh):
    torch.manual_seed(0)
    model = TensorParallelGPT(CFG)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], PLAN)
    return model


def _full(value) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _fsdp2(mesh, steps, snapshots):
    """FSDP2's losses, and its full parameters after each number of steps in ``snapshots``."""
    model = _tensor_parallel_model(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    dp_rank = mesh["dp"].get_local_rank()
    losses, params = [], {}
    for i in range(steps):
        losses.append(train_step(model, opt, *token_batch(i, dp_rank, cfg=CFG)).item())
        if i + 1 in snapshots:
            params[i + 1] = {name: _full(p.detach()) for name, p in model.named_parameters()}
    return losses, params


def _zerofx(mesh, stage, steps, **compile_kwargs):
    model = _tensor_parallel_model(mesh)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    step = zerofx.compile(train_step, stage=stage, mesh=mesh, **compile_kwargs)
    dp_rank = mesh["dp"].get_local_rank()
    losses = [step(model, opt, *token_batch(i, dp_rank, cfg=CFG)).item() for i in range(steps)]
    return losses, zerofx.full_state_dict(step)["model"], step


CHECKPOINTED = {"checkpoint": "blocks", "track_memory": True}
VARIANTS = {"plain": {}, "blocks": CHECKPOINTED, "P_a": {**CHECKPOINTED, "partition_activations": True},
            "P_a+cpu": {**CHECKPOINTED, "partition_activations": True, "offload_activations": True}}


def stages_match_fsdp2(rank, world_size, runs=tuple((s, "plain", 10) for s in range(4))):
    """Each (stage, variant, steps) of ``runs`` against one FSDP2 + TP run: losses and full parameters within
    rtol 1e-5. Returns each run's losses and measured figures."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    want_losses, want_params = _fsdp2(mesh, max(steps for *_, steps in runs), {steps for *_, steps in runs})
    out = {}
    for stage, variant, steps in runs:
        losses, got, step = _zerofx(mesh, stage, steps, **VARIANTS[variant])
        name = f"stage {stage} {variant}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses[:steps]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        for key, want in want_params[steps].items():
            torch.testing.assert_close(_full(got[key]), want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}, {key}: {m}")
        stats = step.stats()
        out[name] = {"losses": losses, "resident": stats.resident_checkpoint_bytes,
                     "offloaded": stats.offloaded_bytes, "checkpoint_bytes": stats.checkpoint_bytes,
                     "tp_comm": stats.tp_comm_volume, "activation_comm": stats.activation_comm_volume,
                     "report": zerofx.report(step, print_output=False)}
    return out


# --- gradients kept between calls for tensor-parallel parameters ---------------------------------------------------

def _update_without_zero_grad(model, optimizer, x, y, update):
    """No ``zero_grad()`` anywhere in the step: the next call adds to the gradients an update used (eager's
    behaviour), unless the caller zeroes them between calls."""
    loss = model(x, y)
    loss.backward()
    if update:
        optimizer.step()
    return loss


def _loop(step, model, opt, dp_rank, calls):
    """``calls`` of (update?, zero_grad between calls: None, or set_to_none); ``model.to()`` its own device after
    the first call."""
    losses = []
    for i, (update, zero) in enumerate(calls):
        losses.append(step(model, opt, *token_batch(i, dp_rank, cfg=CFG), update).item())
        if zero is not None:
            opt.zero_grad(set_to_none=zero)
        if i == 0:
            model.to(model.wte.weight.device)
    return losses


# an update every call with nothing between (the step adds to the gradient an update used), the same zeroed in
# place between calls, accumulation over two calls and set to None between calls
KEPT_GRAD_CALLS = ((True, None), (True, False), (True, None), (False, None), (True, True), (True, None))


def kept_gradients_match_fsdp2(rank, world_size, stages=range(4)):
    """``KEPT_GRAD_CALLS`` with zerofx at each of ``stages`` against FSDP2 + the same tensor-parallel plan running
    the same loop eagerly (its gradient sync off on calls without an update): losses within rtol 1e-5, full
    parameters within 1e-5. Then reads of a kept tensor-parallel gradient between calls. Returns, per stage, each
    read's error, or None."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = _tensor_parallel_model(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)

    def fsdp2_step(model, opt, x, y, update):
        model.set_requires_gradient_sync(update)
        return _update_without_zero_grad(model, opt, x, y, update)

    want_losses = _loop(fsdp2_step, model, opt, dp_rank, KEPT_GRAD_CALLS)
    want_params = {name: _full(p.detach()) for name, p in model.named_parameters()}
    refusals = {}
    for stage in stages:
        model = _tensor_parallel_model(mesh)
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
        step = zerofx.compile(_update_without_zero_grad, stage=stage, mesh=mesh)
        losses = _loop(step, model, opt, dp_rank, KEPT_GRAD_CALLS)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0,
                                   msg=lambda m: f"stage {stage}: {m}")
        got = zerofx.full_state_dict(step)["model"]
        for key, want in want_params.items():
            torch.testing.assert_close(_full(got[key]), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"stage {stage}, {key}: {m}")
        grad = model.blocks[0].attn.q.weight.grad
        refusals[stage] = {read: _error_of(getattr(grad, read)) for read in ("norm", "to_local", "full_tensor")}
    return refusals


def _error_of(read) -> str | None:
    try:
        read()
    except zerofx.CaptureError as e:
        return str(e)
    return None
