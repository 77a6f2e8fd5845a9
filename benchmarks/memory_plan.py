"""``memory_plan=True`` against the same step without it: allocator traffic per step, peak live bytes, the process's
resident high-water mark and step time, on the benchmark GPT (one process, CPU).

    OMP_NUM_THREADS=1 python benchmarks/memory_plan.py [--stages 0 3] [--rounds 5] [--size large --steps 4]

Each configuration runs in a process of its own, which first traces and times the steps alone, as a user's process
runs them. The resident high-water mark is read then, twice: the whole process's (tracing included), and, on Linux,
how far it rises during the timed steps above the resident set they start from (reset after warm-up through
``/proc/self/clear_refs``). After the timed steps the resident set is split into anonymous memory (heap, arena,
Python objects) and mapped files (the code of the libraries the process has run so far). Only after that does the
process measure with the profiler and the tracker. Allocator traffic is the blocks freed in one step after warm-up
(``torch.profiler.profile(profile_memory=True)``), and, where a C compiler and ``LD_PRELOAD`` are at hand (Linux),
the tensor allocations a step makes, counted in a process of its own by ``c10_allocations.c``: the profiler misses a
block an op allocates and frees before it returns. Peak bytes are `zerofx.LiveStorageTracker`'s over one step,
counting the step's state from the start; step time is the median over interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# (batch, sequence, width): the benchmark GPT as the other benchmarks run it, and one whose step allocates far more
# than tracing leaves free on the heap (with a small step, the allocator serves it from what tracing freed)
SIZES = {"small": (8, 64, 128), "large": (32, 256, 256)}


def _setup(stage: int, planned: bool, checkpoint: str | None, size: str, batches: int):
    """The compiled step, the benchmark GPT and its optimizer, and ``batches`` batches."""
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import zerofx
    from gpu_smoke import train_step  # the loop as it is usually written
    from nanogpt import GPT, GPTConfig, param_groups

    torch.manual_seed(0)
    batch_size, sequence, width = SIZES[size]
    model = GPT(GPTConfig(vocab_size=65, block_size=sequence, n_layer=4, n_head=4, n_embd=width))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    step = zerofx.compile(train_step, stage=stage, memory_plan=planned, checkpoint=checkpoint)
    g = torch.Generator().manual_seed(0)
    shape = (batch_size, sequence)
    batch = [(torch.randint(0, 65, shape, generator=g), torch.randint(0, 65, shape, generator=g))
             for _ in range(batches)]
    return step, model, opt, batch


def measure(stage: int, planned: bool, checkpoint: str | None, steps: int, size: str) -> dict:
    import torch

    import zerofx

    step, model, opt, batch = _setup(stage, planned, checkpoint, size, steps + 3)
    for x, y in batch[:2]:
        step(model, opt, x, y)
    # the resident figures and times first, from a process that has run nothing but the steps, as a user's has:
    # the profiler and the tracker below allocate on the same heap and would shape it
    whole_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the reset below may reset this too
    steps_rise_kib = _reset_resident_high_water()
    times = []
    for x, y in batch[3:]:
        start = time.perf_counter()
        step(model, opt, x, y)
        times.append(time.perf_counter() - start)
    rss_kib = max(whole_kib, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    steps_rss_kib = steps_rise_kib() if steps_rise_kib else None
    anon_kib, file_kib = _resident_split()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, opt, *batch[2])
    # the profiler reports every block a step frees with its size, but not every allocation: a step in its steady
    # state frees what it allocates, so frees count the allocator's traffic
    frees = sum(1 for e in prof.events() if e.name == "[memory]" and e.cpu_memory_usage < 0)
    with zerofx.LiveStorageTracker(roots=[zerofx.state_dict(step), *batch[2]]) as tracker:  # the step's own state
        step(model, opt, *batch[2])
    return {"frees": frees, "peak_bytes": tracker.peak_bytes, "rss_kib": rss_kib, "steps_rss_kib": steps_rss_kib,
            "anon_kib": anon_kib, "file_kib": file_kib, "step_ms": statistics.median(times) * 1e3}


def count_allocations(stage: int, planned: bool, checkpoint: str | None, size: str, counter: str) -> float:
    """Tensor allocations per step after warm-up, read from ``counter`` (`c10_allocations.c`, preloaded)."""
    import ctypes

    allocations = ctypes.CDLL(counter).c10_allocations
    allocations.restype = ctypes.c_long
    step, model, opt, batch = _setup(stage, planned, checkpoint, size, 5)
    for x, y in batch[:2]:
        step(model, opt, x, y)
    before = allocations()
    for x, y in batch[2:]:
        step(model, opt, x, y)
    return (allocations() - before) / len(batch[2:])


def _build_counter(directory: str) -> str | None:
    """``c10_allocations.c`` built into ``directory``; None where there is no C compiler or no ``LD_PRELOAD``."""
    if not sys.platform.startswith("linux"):
        return None
    library = os.path.join(directory, "libc10_allocations.so")
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", library, os.path.join(HERE, "c10_allocations.c"),
                        "-ldl"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return library


def _reset_resident_high_water():
    """Linux: reset the process's resident high-water mark to its resident set (``clear_refs`` 5); a function that
    reads how far the mark has risen above that since (KiB), or None where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    at_reset = _status_kib("VmRSS")
    return lambda: _status_kib("VmHWM") - at_reset


def _resident_split() -> tuple[int | None, int | None]:
    """Linux: the resident set now, anonymous and file-mapped (KiB); None where the system cannot say."""
    try:
        return _status_kib("RssAnon"), _status_kib("RssFile")
    except (OSError, StopIteration):
        return None, None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[0, 3])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one configuration, print its figures as JSON
    parser.add_argument("--count-with", help=argparse.SUPPRESS)  # ... or count its allocations with this library
    args = parser.parse_args()
    if args.one:
        stage, planned = json.loads(args.one)
        if args.count_with:
            print(json.dumps(count_allocations(stage, planned, args.checkpoint, args.size, args.count_with)))
        else:
            print(json.dumps(measure(stage, planned, args.checkpoint, args.steps, args.size)))
        return
    with tempfile.TemporaryDirectory() as directory:
        counter = _build_counter(directory)
        counts = {(stage, planned): _run_one(args, stage, planned, counter) if counter else None
                  for stage in args.stages for planned in (False, True)}
    rows = {}
    for _ in range(args.rounds):
        for stage in args.stages:
            for planned in (False, True):
                rows.setdefault((stage, planned), []).append(_run_one(args, stage, planned))
    print(f"| stage | memory_plan | blocks freed per step (profiler) | tensor allocations per step | peak live bytes "
          f"| resident high-water KiB, whole process: median (least-most) | its rise over the timed steps | after them: anonymous KiB | mapped files KiB "
          f"| step ms (median of {args.rounds} rounds) |")
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for (stage, planned), runs in rows.items():
        count = counts[(stage, planned)]
        print(f"| {stage} | {'yes' if planned else 'no'} | {statistics.median(r['frees'] for r in runs):.0f} | "
              f"{'-' if count is None else f'{count:.0f}'} | "
              f"{statistics.median(r['peak_bytes'] for r in runs):,.0f} | "
              f"{_median_and_range([r['rss_kib'] for r in runs])} | "
              f"{_median_or_dash([r['steps_rss_kib'] for r in runs])} | "
              f"{_median_or_dash([r['anon_kib'] for r in runs])} | {_median_or_dash([r['file_kib'] for r in runs])} | "
              f"{statistics.median(r['step_ms'] for r in runs):.1f} |")


def _run_one(args, stage: int, planned: bool, counter: str | None = None):
    """One configuration in a process of its own: its figures, or with ``counter`` its allocations per step."""
    cmd = [sys.executable, __file__, "--one", json.dumps([stage, planned]), "--steps", str(args.steps),
           "--size", args.size]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    env = None
    if counter:
        cmd += ["--count-with", counter]
        env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, [os.environ.get("LD_PRELOAD"), counter]))}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.splitlines()[-1])


def _median_and_range(values: list) -> str:
    """A figure that varies by megabytes between identical processes, with its range."""
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def _median_or_dash(values: list) -> str:
    return "-" if None in values else f"{statistics.median(values):,.0f}"


if __name__ == "__main__":
    main()
