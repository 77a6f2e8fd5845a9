"""The step as it runs (`zerofx.fast_calls`: ATen calls through torch's bindings) against the same step calling the
graph's own overloads, and eager beside both: the benchmark GPT, one process, one thread, steps interleaved.

    .venv/bin/python benchmarks/fast_calls.py [--stages 0 3] [--steps 40]

Prints per stage how many of the final graph's ATen calls move to bindings, the median step time of each system
("overloads": the final graph itself), the median of per-step ratios, and whether the two zerofx steps' losses are
bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..")]

import torch  # noqa: E402

import zerofx  # noqa: E402
from zerofx.fast_calls import bindings_graph  # noqa: E402
from nanogpt import GPT, GPTConfig, param_groups  # noqa: E402
from peers.systems import _train_step  # noqa: E402

CFG = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _aten_calls(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))


def run(stage: int, steps: int) -> None:
    systems = {}
    for name in ("eager", "overloads", "bindings"):
        torch.manual_seed(0)
        model = GPT(CFG)
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
        systems[name] = (_train_step if name == "eager" else zerofx.compile(_train_step, stage=stage), model, optimizer)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 65, (8, 64), generator=g), torch.randint(0, 65, (8, 64), generator=g))
               for _ in range(steps + 2)]
    for step, model, optimizer in systems.values():
        for x, y in batches[:2]:
            step(model, optimizer, x, y)
    compiled = systems["overloads"][0]._last
    compiled.__dict__["runnable"] = compiled.gm  # this one runs the final graph itself
    before, after = _aten_calls(compiled.gm.graph), _aten_calls(bindings_graph(compiled.gm))
    print(f"stage {stage}: {before - after} of {before} ATen calls through bindings")
    times = {name: [] for name in systems}
    losses = {name: [] for name in systems}
    for x, y in batches[2:]:
        for name, (step, model, optimizer) in systems.items():
            start = time.perf_counter()
            loss = step(model, optimizer, x, y)
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())
    for name in systems:
        to_eager = statistics.median(a / b for a, b in zip(times[name], times["eager"]))
        print(f"  {name:18s} {statistics.median(times[name]) * 1e3:7.2f} ms  {to_eager:.3f} x eager")
    ratio = statistics.median(a / b for a, b in zip(times["bindings"], times["overloads"]))
    print(f"  bindings / overloads: {ratio:.3f}; losses bitwise equal: {losses['bindings'] == losses['overloads']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[0, 3])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for stage in args.stages:
        run(stage, args.steps)


if __name__ == "__main__":
    main()
