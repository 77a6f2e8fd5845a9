"""zerofx stages 0-3 beside DDP, FSDP2 and DeepSpeed ZeRO 1-3: one GPT, the same data, gloo ranks on CPU.

    make bench          # or: .venv/bin/python benchmarks/compare_peers.py --size default

For each world size every rank runs every system (see ``peers/run.py``); this writes
``benchmarks/results/peers-<date>.md`` (the tables and the exact command), ``peers-<date>.png`` (peak bytes and
step-time ratio per system) and ``peers-<date>.json`` (the raw figures). DeepSpeed is optional
(``pip install -e '.[bench]'``); without it, or if it fails, the table says why it was skipped. The chart needs
matplotlib (the same extra).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue
import shlex
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "examples")]

import torch  # noqa: E402

from nanogpt import GPTConfig  # noqa: E402
from peers import report  # noqa: E402
from peers.models import LlamaShape  # noqa: E402
from peers.run import Settings, worker  # noqa: E402

# (layers, heads, width, context, batch, bucket elements): a bucket about one block's parameters (12·width²), as
# FSDP2 groups them, in elements so that bf16 buckets hold as many parameters as fp32 ones
SIZES = {
    "tiny": (2, 2, 32, 16, 4, 4096),
    "small": (2, 4, 64, 32, 8, 48 * 1024),
    "default": (4, 4, 128, 64, 8, 192 * 1024),
    "large": (6, 6, 384, 128, 8, 1728 * 1024),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world_size: int, settings: Settings, text: str, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world_size, port, settings, text, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=timeout)
    except queue.Empty:
        out = {"error": f"no result from {world_size} ranks within {timeout:.0f}s"}
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def _versions() -> str:
    parts = [f"torch {torch.__version__}", f"Python {platform.python_version()}"]
    if importlib.util.find_spec("deepspeed"):
        from importlib.metadata import version

        parts.append(f"DeepSpeed {version('deepspeed')}")
    return ", ".join(parts)


NOTES = """\
How to read it. *peak*: the high-water mark of the bytes of live storages during one step, measured by
`zerofx.LiveStorageTracker` alike for every system (a dispatch mode: it sees every tensor an op touches, whichever
library issued the op, and reads each storage's size again after every op, so FSDP2's in-place `resize_` of its
unsharded parameters counts). *model states*: the storages a step touched that are still alive once the step, its
batch and its loss are gone — what the system keeps between steps (for zerofx from stage 1 on this leaves out the
gradients, which die after the update; DDP keeps its gradient buckets beside `.grad`). *formula*: the paper's model
states for the stage the system implements (fp32 Adam 16Ψ, bf16 with fp32 masters 16Ψ). *collectives*: counted by
`CommDebugMode` in one step. *comm (Ψ)*: ring accounting of what it saw (`zerofx.stats.ring_volume`: all-reduce
2(N−1)/N of the buffer, reduce-scatter and all-gather (N−1)/N of the full buffer), divided by Ψ·(N−1)/N, so 2
means the paper's 2Ψ; gloo implements reduce-scatter through an all-reduce, so bytes on the wire are not compared.
*step ms*: the median over ranks' slowest of `steps` steps after `warmup`, median over rounds; *× FSDP2 reshard*:
per round, against FSDP2 (`reshard_after_forward=True`, same precision) timed in the same round; median (min–max).
DeepSpeed runs with `DS_ACCELERATOR=cpu`, gloo and `torch_adam`, with buckets (`reduce_bucket_size`,
`allgather_bucket_size`, `stage3_prefetch_bucket_size`) equal to zerofx's and `stage3_param_persistence_threshold=0`
so that it shards every parameter as zerofx does, and with `gradient_clipping` 0 (DeepSpeed clips at 1.0 unless
told, the others do not clip); "defaults" rows keep DeepSpeed's own buckets (5e8 elements), one engine at a time,
timed in one round. Final losses are compared per precision against the median: fp32 trajectories agree to
summation order; bf16 ones are identical over the first steps and then drift apart where a system's bf16 path
rounds differently (DeepSpeed's bucketing, reduction and update differ from FSDP2's and zerofx's, which agree).

zerofx runs at its defaults: stage 3 gathers by units it finds in the model (one block each) and DDP keeps its own
25 MiB buckets; the "tuned buckets" row gives zerofx-3 `bucket_bytes` equal to the row's bucket size instead.
zerofx-3 sends less than 3Ψ: backward gathers only what it reads (not the linear layers' biases nor the position
embedding), and under bf16 it keeps no bf16 shard (its all-gathers cast the fp32 masters, as FSDP2's do), so its bf16
model states are 12Ψ/N_d against the formula's 16Ψ/N_d. What remains at the peak, besides activations (most of it
on this model), is the unit being read and the one prefetched (`prefetch=1`): smaller units (the tuned row) hold less.
Where zerofx's step time goes (torch.profiler and cProfile on 2 ranks): the graph's ATen kernels and the waits on
gloo collectives; zerofx's own Python around the graph is under 1 ms per step. The ranks' agreement on the guard
key (`verify_ranks=True`) rides at stage 0 on the first gradient bucket as one more element once a rank has run
the same graph twice (`carry_rank_agreement`: CommDebugMode counts no collective of its own for it there); at
stages 1-3 it is an 8-byte all-gather issued as the step begins and awaited just before its first collective.
"""


def main(argv: list[str] | None = None) -> tuple[str, list[dict]]:
    """Run every world size, write the results; the path of the Markdown file and the runs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="default")
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                        help="the repository's GPT, or a Hugging Face LlamaForCausalLM of the same sizes")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--skip", nargs="*", choices=["deepspeed", "deepspeed-defaults"], default=[])
    parser.add_argument("--checkpoint", action="store_true",
                        help="activation checkpointing of every block in every system (DeepSpeed skipped)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one world size")
    args = parser.parse_args(argv)

    text = open(os.path.join(ROOT, "examples", "data", "zero.txt")).read()
    layers, heads, width, context, batch, bucket = SIZES[args.size]
    shape = GPTConfig if args.model == "gpt" else LlamaShape
    cfg = shape(vocab_size=len(set(text)), block_size=context, n_layer=layers, n_head=heads, n_embd=width)
    skip = tuple(args.skip) + (("deepspeed",) if args.checkpoint else ())
    if "deepspeed" not in skip and importlib.util.find_spec("deepspeed") is None:
        skip += ("deepspeed",)
    settings = Settings(cfg, batch, bucket, args.rounds, args.warmup, args.steps, tuple(args.precisions), skip,
                        args.checkpoint)

    started = time.perf_counter()
    runs = [run_world(n, settings, text, args.timeout) for n in args.worlds]
    elapsed = time.perf_counter() - started

    os.makedirs(args.out, exist_ok=True)
    name = "-".join(["peers"] + ([args.model] if args.model != "gpt" else []) +
                    (["checkpoint"] if args.checkpoint else []) + [args.date])
    stem = os.path.join(args.out, name)
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare_peers.py " + shlex.join(argv or sys.argv[1:])
    lines = [f"# zerofx beside DDP, FSDP2 and DeepSpeed — {args.date}", "",
             f"    {command.strip()}", "",
             f"{os.cpu_count()} CPU cores, gloo, {_versions()}; {elapsed / 60:.1f} min. "
             f"{'GPT' if args.model == 'gpt' else 'Hugging Face LlamaForCausalLM'} {layers} layers × {width} wide, "
             f"{heads} heads, context {context}, batch {batch} per rank, "
             f"AdamW (lr 3e-3, weight decay 0.1 on matrices), buckets of {bucket:,} elements; "
             f"{args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps."
             + (" Every block's activations checkpointed: zerofx `checkpoint='blocks'`, DDP and FSDP2 "
                "`checkpoint_wrapper` per block (non-reentrant), before `fully_shard`." if args.checkpoint else ""),
             ""]
    if "deepspeed" in skip and "deepspeed" not in args.skip:
        lines += ["DeepSpeed skipped: not installed (`pip install -e '.[bench]'`).", ""]
    for run in runs:
        lines += [report.table(run), ""]
    if importlib.util.find_spec("matplotlib"):
        report.chart(runs, stem + ".png")
        lines += [f"![peak memory and step-time ratio]({name}.png)", ""]
    else:
        lines += ["Chart skipped: matplotlib is not installed (`pip install -e '.[bench]'`).", ""]
    lines += [NOTES]
    with open(stem + ".json", "w") as f:
        json.dump({"command": command.strip(), "runs": runs}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return stem + ".md", runs


if __name__ == "__main__":
    main()
