"""GPU smoke check, for a machine with one CUDA device: the compiled step runs on the GPU and matches eager, at
stage 0 as the loop is usually written and at stage 3 with zero_grad after the update and a short last batch;
stage 3 in bf16 (casts of the masters gathered, or bf16 shards kept) trains and stays within bf16 rounding of
eager; stage 3 with every block checkpointed and its checkpoints offloaded to pinned host memory matches eager too;
stage 3 with gradients accumulated across calls (an update every second call) matches eager;
stage 0 (planned by default) and stage 3 with ``memory_plan`` (intermediates in one arena) match eager, and so do
stage 0 with ``memory_plan=False`` and stage 3 at its default; each line prints
``max_memory_reserved`` beside ``max_memory_allocated`` and the allocations a step asks the caching allocator for,
planned and unplanned; the same eager loops around
``torch.compile(model, backend=zerofx.backend(...))`` at stages 0 and 3 match eager. The checks run with
deterministic algorithms, and planned steps must be bitwise equal to the same steps unplanned.

Then ``memory_plan`` against the same step without it, at GPT-2 small's size (124M parameters, batch 8 × 1024), where
the step's activations, not the model, fill the device: at stages 0 and 3, in interleaved rounds, each configuration
freshly built, one line each with the caching allocator's reserved and allocated high-water marks, the allocations a
step asks it for and the median step time.

    python benchmarks/gpu_smoke.py [--rounds 2] [--no-memory]

World size 1 (NCCL refuses two ranks on one device); the multi-rank paths are the ones the gloo tests cover.
Prints one line per check, runs every check whatever an earlier one did, and exits non-zero if any failed.
"""

import argparse
import gc
import importlib
import itertools
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
import torch  # noqa: E402

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


def update_when_told(model, optimizer, x, y, update):
    """Gradients accumulated across calls: backward every call, the update when the caller says."""
    loss = model(x, y)
    (loss / 2).backward()
    if update:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def every_other_call(fn):
    """``fn(model, optimizer, x, y, update)`` as a four-argument step that updates on every second call."""
    calls = itertools.count()

    def step(model, optimizer, x, y):
        return fn(model, optimizer, x, y, next(calls) % 2 == 1)

    step.compiled = fn
    return step


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
    _release_device_memory()  # reserved memory is measured per check
    if isinstance(getattr(step, "compiled", step), zerofx.CompiledStep):
        full = zerofx.full_state_dict(getattr(step, "compiled", step))["model"]
    elif getattr(step, "prepared", None):
        full = zerofx.full_state_dict(zerofx.prepared(step.prepared["model"]))["model"]
    else:
        full = model.state_dict()
    return losses, full


def checks(device) -> int:
    """Run every check; the number that failed."""
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
    eager = {fn.__name__: run(f"eager {fn.__name__}", cfg, device, make_step, fn)
             for fn, make_step in ((train_step, lambda f: f), (zero_grad_last, lambda f: f),
                                   (update_when_told, every_other_call))}
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
    steps.append(("zerofx stage 3 accumulating", update_when_told,  # its shards kept between calls
                  lambda f: every_other_call(zerofx.compile(f, stage=3)), 1e-4))
    steps += [(f"backend stage {stage}", fn, through_backend(stage), 1e-4)
              for stage, fn in ((0, train_step), (3, zero_grad_last))]
    failed, results = 0, {}
    steps_by_name = {name: {"fn": fn, "make_step": make_step} for name, fn, make_step, _ in steps}
    for name, fn, make_step, rtol in steps:
        try:
            losses, state = results[name] = run(name, cfg, device, make_step, fn)
            ref_losses, ref_state = eager[fn.__name__]
            torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=1e-5)
            if rtol < 1e-3:
                torch.testing.assert_close(state, ref_state, rtol=rtol, atol=1e-5)
        except Exception:  # report it and go on: one device run should show every failure
            failed += 1
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
            _release_device_memory()
    for planned, unplanned in (("zerofx stage 0", "zerofx stage 0 unplanned"),
                               ("zerofx stage 3 memory_plan", "zerofx stage 3")):
        if not _bitwise_equal(planned, unplanned, results):
            failed += 1
            _attribute(planned, unplanned, results, cfg, device, steps_by_name[planned])
    return failed


def _bitwise_equal(name: str, reference: str, results: dict) -> bool:
    """Whether two checks' losses and final states are bitwise equal (printed either way, with the first step whose
    loss differs: step 0 means the forward already differs)."""
    if name not in results or reference not in results:
        print(f"{name} against {reference}: not compared (one did not run)")
        return False
    (losses, state), (ref_losses, ref_state) = results[name], results[reference]
    differ = [key for key in ref_state if not torch.equal(state[key], ref_state[key])]
    first = next((i for i, (a, b) in enumerate(zip(losses, ref_losses)) if a != b), None)
    equal = first is None and not differ
    print(f"{name} against {reference}: {'bitwise equal' if equal else 'DIFFERENT'}"
          + (f" (first loss that differs: step {first}; tensors that differ: {len(differ)} of {len(ref_state)}, max "
             f"difference {max((state[k] - ref_state[k]).abs().max().item() for k in differ):.3g})" if differ else ""),
          flush=True)
    return equal


def _attribute(planned: str, unplanned: str, results: dict, cfg, device, check: dict) -> None:
    """Which of the two passes a planned step adds makes the difference: the planned step again with the scalar
    operands left as numbers (``plan_scalar_operands`` taken out of the pipeline for this run only)."""
    pipeline = importlib.import_module("zerofx.passes.pipeline")
    name = f"{planned} without plan_scalar_operands"
    saved = dict(pipeline._STAGES)
    pipeline._STAGES.update({stage: tuple(p for p in passes if p is not pipeline.plan_scalar_operands)
                             for stage, passes in saved.items()})
    try:
        results[name] = run(name, cfg, device, check["make_step"], check["fn"])
    finally:
        pipeline._STAGES.update(saved)
    _bitwise_equal(name, unplanned, results)


def _release_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def measure_memory(stage: int, planned: bool, device, steps: int) -> dict:
    """One freshly built configuration's figures over ``steps`` steps (the first traces)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    step = zerofx.compile(train_step, stage=stage, memory_plan=planned)
    g = torch.Generator(device="cpu").manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (8, cfg.block_size), generator=g).to(device) for _ in range(2))
    times = []
    for i in range(steps):
        if i == 2:
            allocations = _allocations()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, opt, x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    figures = {"reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated(),
               "allocations": (_allocations() - allocations) / (steps - 2), "ms": statistics.median(times[2:]) * 1e3}
    del step, model, opt, x, y
    _release_device_memory()
    return figures


def compare_memory(device, rounds: int, steps: int = 8) -> None:
    """Planned against unplanned at stages 0 and 3, interleaved; one line per configuration (medians of rounds)."""
    configs = [(stage, planned) for stage in (0, 3) for planned in (False, True)]
    results = {config: [] for config in configs}
    for _ in range(rounds):
        for config in configs:
            results[config].append(measure_memory(*config, device, steps))
    print(f"\nmemory_plan at GPT-2 small's size (batch 8 x 1024), medians of {rounds} rounds:")
    for (stage, planned), runs in results.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"stage {stage} memory_plan={planned!s:5}  max reserved {median['reserved'] / 2**20:9.1f} MiB  "
              f"max allocated {median['allocated'] / 2**20:9.1f} MiB  {median['allocations']:5.0f} allocations/step  "
              f"{median['ms']:7.2f} ms/step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the memory comparison")
    parser.add_argument("--no-memory", action="store_true", help="only the checks against eager")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    device = torch.device("cuda")
    # eager and compiled steps compared on the same kernels: no atomics, one cuBLAS workspace configuration
    torch.use_deterministic_algorithms(True, warn_only=True)
    failed = checks(device)
    torch.use_deterministic_algorithms(False)  # the memory comparison runs as users run
    if not args.no_memory:
        compare_memory(device, args.rounds)
    if failed:
        sys.exit(f"gpu smoke: {failed} check(s) failed")
    print("gpu smoke: OK")


if __name__ == "__main__":
    main()
