"""GPU smoke check, for a machine with one CUDA device: the compiled step runs on the GPU and matches eager, at
stage 0 as the loop is usually written and at stage 3 with zero_grad after the update and a short last batch;
stage 3 in bf16 (casts of the masters gathered, or bf16 shards kept) trains and stays within bf16 rounding of
eager; stage 3 with every block checkpointed and its checkpoints offloaded to pinned host memory matches eager too;
stage 0 (planned by default) and stage 3 with ``memory_plan`` (intermediates in one arena) match eager, and so do
stage 0 with ``memory_plan=False`` and stage 3 at its default; each line prints
``max_memory_reserved`` beside ``max_memory_allocated`` and the allocations a step asks the caching allocator for,
planned and unplanned; the same eager loops around
``torch.compile(model, backend=zerofx.backend(...))`` at stages 0 and 3 match eager.

    python benchmarks/gpu_smoke.py

World size 1 (NCCL refuses two ranks on one device); the multi-rank paths are the ones the gloo tests cover.
Prints one line per check and exits non-zero on the first mismatch.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import zerofx  # noqa: E402
from nanogpt import GPT, GPTConfig, param_groups  # noqa: E402


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


def zero_grad_last(model, optimizer, x, y):
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def through_backend(stage):
    """``fn`` as written, around the model and optimizer prepared for ``stage`` and the model compiled with zerofx's
    backend (on the first call, when the model exists)."""
    def make_step(fn):
        prepared = {}

        def step(model, optimizer, x, y):
            if not prepared:
                model, optimizer = zerofx.prepare(model, optimizer, stage=stage)
                prepared.update(model=torch.compile(model, backend=zerofx.backend(stage=stage)), optimizer=optimizer)
            return fn(prepared["model"], prepared["optimizer"], x, y)

        step.prepared = prepared
        return step

    return make_step


def _allocations() -> int:
    """Blocks the CUDA caching allocator has handed out so far (its own count, cached blocks included)."""
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def run(name, cfg, device, make_step, fn):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    step = make_step(fn)
    losses, start = [], None
    for i in range(20):
        g = torch.Generator(device="cpu").manual_seed(i)
        batch = 4 if i == 19 else 8  # the epoch's short last batch
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
        y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
        if i == 5:
            torch.cuda.synchronize()
            start, allocations = time.perf_counter(), _allocations()
        if i == 19:  # the short batch re-traces: its step allocates anew
            allocations = (_allocations() - allocations) / 14
        losses.append(step(model, opt, x, y).item())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / 15 * 1e3
    print(f"{name:26s} final loss {losses[-1]:.5f}  {ms:.2f} ms/step  {allocations:.0f} allocations/step  max allocated "
          f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, reserved "
          f"{torch.cuda.max_memory_reserved() / 2**20:.1f} MiB")
    torch.cuda.empty_cache()  # reserved memory is measured per check
    torch.cuda.reset_peak_memory_stats()
    if isinstance(step, zerofx.CompiledStep):
        full = zerofx.full_state_dict(step)["model"]
    elif getattr(step, "prepared", None):
        full = zerofx.full_state_dict(zerofx.prepared(step.prepared["model"]))["model"]
    else:
        full = model.state_dict()
    return losses, full


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    device = torch.device("cuda")
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
    eager = {fn.__name__: run(f"eager {fn.__name__}", cfg, device, lambda f: f, fn)
             for fn in (train_step, zero_grad_last)}
    checks = [("zerofx stage 0", train_step, {"stage": 0}, 1e-4),  # planned: the default at stage 0
              ("zerofx stage 0 unplanned", train_step, {"stage": 0, "memory_plan": False}, 1e-4),
              ("zerofx stage 3", zero_grad_last, {"stage": 3}, 1e-4),
              ("zerofx stage 3 bf16", zero_grad_last,
               {"stage": 3, "mixed_precision": zerofx.MixedPrecision(torch.bfloat16)}, 3e-2),
              ("zerofx stage 3 bf16 kept", zero_grad_last,  # cast_at_gather=False
               {"stage": 3, "mixed_precision": zerofx.MixedPrecision(torch.bfloat16, cast_at_gather=False)}, 3e-2),
              ("zerofx stage 3 offload", zero_grad_last,
               {"stage": 3, "checkpoint": "blocks", "offload_activations": True}, 1e-4),
              ("zerofx stage 3 memory_plan", zero_grad_last, {"stage": 3, "memory_plan": True}, 1e-4)]
    steps = [(name, fn, lambda f, kwargs=kwargs: zerofx.compile(f, **kwargs), rtol)
             for name, fn, kwargs, rtol in checks]
    steps += [(f"backend stage {stage}", fn, through_backend(stage), 1e-4)
              for stage, fn in ((0, train_step), (3, zero_grad_last))]
    for name, fn, make_step, rtol in steps:
        losses, state = run(name, cfg, device, make_step, fn)
        ref_losses, ref_state = eager[fn.__name__]
        torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=1e-5)
        if rtol < 1e-3:
            torch.testing.assert_close(state, ref_state, rtol=rtol, atol=1e-5)
    print("gpu smoke: OK")


if __name__ == "__main__":
    main()
