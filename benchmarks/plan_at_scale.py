"""``zerofx.plan`` at the paper's scales, against the paper's figures (ZeRO, Rajbhandari et al. 2020), on one CPU.

    python benchmarks/plan_at_scale.py [paper_table] [max_model] [max_model_stage_3] [max_model_with_activations]
        [one_trillion] [one_trillion_kept_shard] [activations] [tensor_parallel] [time_and_memory]

Every figure is a plan: the model is built on the meta device and its whole training step (AdamW; bf16 mixed
precision unless said) traced and passed through the stage's passes for rank 0 of the world shown. Sizes in GB of
10^9 bytes per rank, as the paper gives them. The paper's figures are quoted beside ours (PAPER below).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import torch
from tabulate import tabulate

from zerofx.mixed_precision import MixedPrecision
from zerofx.planning.decoder import num_params, plan_decoder
from zerofx.planning.search import SHALLOW, deepest
from zerofx.planning.shapes import gpt_of_size, model_shape

GB = 1e9
MIXED = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}
# stage 3 with a bf16 copy of each shard kept, as DeepSpeed and the paper's accounting keep it
KEPT_SHARD = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, cast_at_gather=False)}
PAPER = {  # the paper's text, sections 1, 3, 5.1-5.4 and 6
    "model states, 7.5B, N_d=64, stages 0-3 (GB)": [120, 31.4, 16.6, 1.88],
    "largest model, 32 GB, N_d=64, stages 1-3 (parameters)": [7.5e9, 14e9, 128e9],
    "model states, 1T, N_d=1024, stage 3 (GB)": 16,
    "activations, 1.5B GPT-2, batch 32, seq 1024: none / checkpointed blocks (GB)": [60, 8],
    "checkpoints, 100B, batch 32, seq 1024, MP 16: blocks / P_a / P_a+cpu on device (GB)": [33, 2, 0],
}


def _kept(options: dict) -> str:
    return ", bf16 shard kept" if options is KEPT_SHARD else ""


def paper_table() -> None:
    """Stages 0-3 of the paper's 7.5B model on 64 ranks: model states per rank."""
    shape = gpt_of_size("7.5B")
    psi = num_params(shape)
    rows = []
    papers = PAPER["model states, 7.5B, N_d=64, stages 0-3 (GB)"]
    for stage, paper, options in [*((s, p, MIXED) for s, p in enumerate(papers)), (3, papers[3], KEPT_SHARD)]:
        stats = plan_decoder(shape, world_size=64, stage=stage, **options)
        states = stats.model_state_bytes
        rows.append([f"{stage}{_kept(options)}", f"{states['total'] / GB:.2f}", paper,
                     f"{states['total'] / GB / paper - 1:+.1%}",
                     f"{stats.formula.evaluate(stats.formula.model_states, psi, 64) / GB:.2f}",
                     *(f"{states[c] / GB:.3f}" for c in ("params", "grads", "master_params", "optimizer_states"))])
    print(f"\n## Model states per rank: {shape.name} GPT ({shape.n_layer} layers, d_model {shape.d_model}), "
          f"Ψ = {psi / 1e9:.3f}B, N_d = 64, bf16 mixed-precision AdamW")
    print(tabulate(rows, headers=["stage", "plan (GB)", "paper (GB)", "plan/paper", "zerofx formula (GB)",
                                  "params", "grads", "fp32 masters", "Adam states"], disable_numparse=True))


def max_model(only_stage_3: bool = False) -> None:
    """The deepest model of the 7.5B one's width whose model states fit 32 GB on 64 ranks, per stage (stage 3 by
    zerofx's default layout and with a bf16 shard kept)."""
    shape = gpt_of_size("7.5B")
    rows = []
    papers = PAPER["largest model, 32 GB, N_d=64, stages 1-3 (parameters)"]
    for stage, paper, options in [*((s, p, MIXED) for s, p in zip((1, 2, 3), papers)), (3, papers[2], KEPT_SHARD)]:
        if only_stage_3 and stage < 3:
            continue

        def states(s, stage=stage, options=options):
            return plan_decoder(s, world_size=64, stage=stage, **options).model_state_bytes["total"]

        started = time.perf_counter()
        depth = deepest(shape, states, 32 * 10**9, confirm=stage < 3)  # stage 3's 600 blocks: the line alone
        psi = num_params(shape.with_depth(depth))
        rows.append([f"{stage}{_kept(options)}", depth, f"{psi / 1e9:.1f}B", f"{paper / 1e9:g}B",
                     f"{psi / paper - 1:+.1%}",
                     "yes" if stage < 3 else "no", f"{time.perf_counter() - started:.0f}"])
    print(f"\n## Largest model whose model states fit 32 GB, N_d = 64 (d_model {shape.d_model}, depth searched)")
    print(tabulate(rows, headers=["stage", "layers", "Ψ", "paper", "plan/paper", "confirmed by a plan of it",
                                  "seconds"], disable_numparse=True))


def max_model_stage_3() -> None:
    """`max_model`'s stage-3 rows alone: a line through plans at 2 and 4 blocks (seconds each)."""
    max_model(only_stage_3=True)


def max_model_with_activations() -> None:
    """The same search by the peak (model states, activations and the rest) at 1 × 1024 tokens per rank, from the line
    through plans at 2 and 4 blocks (not confirmed by a plan of the model found)."""
    shape = gpt_of_size("7.5B")
    rows = []
    for stage in (1, 2, 3):
        def peak(s, stage=stage):
            return plan_decoder(s, world_size=64, stage=stage, batch=1, seq=1024, **MIXED).peak_bytes

        depth = deepest(shape, peak, 32 * 10**9)
        rows.append([stage, depth, f"{num_params(shape.with_depth(depth)) / 1e9:.1f}B"])
    print(f"\n## Largest model whose peak fits 32 GB at 1 x 1024 tokens per rank, N_d = 64 (d_model {shape.d_model})")
    print(tabulate(rows, headers=["stage", "layers", "Ψ"], disable_numparse=True))


def one_trillion(options: dict = MIXED) -> None:
    shape = gpt_of_size("1T")
    started = time.perf_counter()
    stats = plan_decoder(shape, world_size=1024, stage=3, **options)
    psi = num_params(shape)
    print(f"\n## 1T ({shape.n_layer} layers, d_model {shape.d_model}, Ψ = {psi / 1e12:.3f}T), N_d = 1024, "
          f"stage 3{_kept(options)}: "
          f"model states {stats.model_state_bytes['total'] / GB:.2f} GB per rank (paper: "
          f"{PAPER['model states, 1T, N_d=1024, stage 3 (GB)']} GB); planned in {time.perf_counter() - started:.0f} s")


def one_trillion_kept_shard() -> None:
    one_trillion(KEPT_SHARD)


def activations() -> None:
    """GPT-2 1.5B at batch 32 × 1024 tokens on one rank, with and without checkpointed blocks."""
    shape = model_shape("gpt2-xl")
    rows, made_by = [], {}
    for paper, options in zip(PAPER["activations, 1.5B GPT-2, batch 32, seq 1024: none / checkpointed blocks (GB)"],
                              ({}, {"checkpoint": "blocks"})):
        stats = plan_decoder(shape, world_size=1, stage=0, batch=32, seq=1024, **MIXED, **options)
        checkpointing = "blocks" if options else "none"
        rows.append([checkpointing, f"{stats.activation_bytes / GB:.1f}", paper,
                     f"{stats.checkpoint_bytes / GB:.2f}", f"{stats.peak_bytes / GB:.1f}"])
        made_by[checkpointing] = stats.activations_at_peak
    print(f"\n## Activations: {shape.name} (Ψ = {num_params(shape) / 1e9:.2f}B), batch 32 x 1024 tokens, bf16")
    print(tabulate(rows, headers=["checkpointing", "activations (GB)", "paper (GB)", "checkpoints (GB)",
                                  "peak (GB)"], disable_numparse=True))
    print("\nWhat the activations are at their peak, by the op that made them (GB):")
    for checkpointing, parts in made_by.items():
        shown = list(parts.items())[:5]
        rest = sum(parts.values()) - sum(nbytes for _, nbytes in shown)
        print(f"- {checkpointing}: " + ", ".join(f"{what} {nbytes / GB:.2f}" for what, nbytes in shown)
              + f", the rest {rest / GB:.2f}")


def tensor_parallel() -> None:
    """Checkpoints of the paper's 100B model at batch 32 × 1024 tokens split over 16 tensor-parallel ranks (bf16
    parameters: zerofx's tensor parallelism runs without mixed precision). Every block keeps the same checkpoints, so
    plans of the model at 2 and 4 blocks give the bytes per block, and so the full depth's (a plan of all 124 blocks
    traces DTensor's dispatch for each, for many minutes on this CPU)."""
    shape = gpt_of_size("100B")
    variants = {"blocks": {"checkpoint": "blocks"},
                "P_a": {"checkpoint": "blocks", "partition_activations": True},
                "P_a+cpu": {"checkpoint": "blocks", "partition_activations": True, "offload_activations": True}}
    rows = []
    for (name, options), paper in zip(variants.items(), PAPER["checkpoints, 100B, batch 32, seq 1024, MP 16: "
                                                               "blocks / P_a / P_a+cpu on device (GB)"]):
        started = time.perf_counter()
        plans = [plan_decoder(shape.with_depth(depth), world_size=16, tp=16, stage=0, batch=32, seq=1024,
                              dtype=torch.bfloat16, **options) for depth in SHALLOW]
        device, host = (_full_depth(shape, [getattr(p, figure) for p in plans])
                        for figure in ("resident_checkpoint_bytes", "offloaded_bytes"))
        per_block = (plans[1].checkpoint_bytes - plans[0].checkpoint_bytes) / (SHALLOW[1] - SHALLOW[0])
        rows.append([name, f"{device / GB:.2f}", paper, f"{host / GB:.2f}", f"{per_block / 1e6:.0f}",
                     f"{time.perf_counter() - started:.0f}"])
    print(f"\n## Checkpoints per rank: {shape.name} ({shape.n_layer} layers, d_model {shape.d_model}), tp = 16, "
          "batch 32 x 1024 tokens, bf16 (from plans at 2 and 4 blocks)")
    print(tabulate(rows, headers=["variant", "on the device (GB)", "paper (GB)", "in host memory (GB)",
                                  "full checkpoints per block (MB)", "seconds"], disable_numparse=True))


def _full_depth(shape, at_shallow: list[int]) -> float:
    """A figure that grows by the same bytes per block, at the model's depth, from its values at `SHALLOW`."""
    (d1, d2), (b1, b2) = SHALLOW, at_shallow
    return b1 + (b2 - b1) / (d2 - d1) * (shape.n_layer - d1)


def time_and_memory() -> None:
    """``python -m zerofx plan`` for a 7B model on 1024 ranks, in a process of its own: wall time and peak RSS."""
    rows = []
    for model, stages in (("llama-7b", "3"), ("llama-7b", "0,1,2,3")):
        command = [sys.executable, "-m", "zerofx", "plan", "--model", model, "--world", "1024", "--stage", stages]
        started = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        out = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ).stdout
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        rows.append([" ".join(command[1:]), f"{time.perf_counter() - started:.1f}",
                     f"{rss / 2**20:.2f}" if rss > before else "(below an earlier child's)"])
        print(out)
    print("\n## Time and resident memory of a plan (one process each, imports included)")
    print(tabulate(rows, headers=["command", "seconds", "peak RSS (GiB)"], disable_numparse=True))


SECTIONS = {f.__name__: f for f in (paper_table, max_model, max_model_stage_3, max_model_with_activations, one_trillion,
                                    one_trillion_kept_shard, activations,
                                    tensor_parallel, time_and_memory)}

if __name__ == "__main__":
    for name in sys.argv[1:] or SECTIONS:
        SECTIONS[name]()
        sys.stdout.flush()
