"""``python -m zerofx plan``: per stage, what one rank of a world of any size would hold and send, as a table.

    python -m zerofx plan --model gpt2-xl|llama-7b|7.5B|<Hugging Face id> --world 64 --stage 0,1,2,3 [--tp 16]
        [--checkpoint blocks] [--partition-activations] [--offload-activations] [--batch B --seq T]
        [--precision bf16|fp32|pure-bf16] [--device-memory 32GB] [--max-model [--confirm]]

Sizes are decimal (1 GB = 10^9 bytes), as the paper gives them; communication is in elements sent per rank and step,
in units of Ψ. ``--max-model`` prints instead, per stage, the deepest model of the given one's width that fits
``--device-memory``: by model states alone (as the paper counts) and by the peak at the given batch.
"""

from __future__ import annotations

import argparse
import re

import torch
from tabulate import tabulate

from zerofx.mixed_precision import MixedPrecision
from zerofx.planning.decoder import num_params, plan_decoder
from zerofx.planning.search import deepest
from zerofx.planning.shapes import ModelShape, model_shape

GB = 10**9
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|kB|MB|GB|GiB|TB)?\s*$", re.IGNORECASE)
_UNIT = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": GB, "TB": 10**12, "GIB": 2**30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="gpt2 ... gpt2-xl, llama-7b ..., a size (7.5B, 100B, 1T: the "
                                                       "paper's GPT-like models) or a Hugging Face model id or path")
    parser.add_argument("--world", type=int, required=True, help="ranks in all (data x tensor parallel)")
    parser.add_argument("--stage", type=_stages, default=[0, 1, 2, 3], help="comma-separated ZeRO stages")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per data-parallel rank")
    parser.add_argument("--checkpoint", choices=["blocks"], help="recompute each block's activations in backward")
    parser.add_argument("--partition-activations", action="store_true", help="P_a: checkpoints split over tp")
    parser.add_argument("--offload-activations", action="store_true", help="checkpoints wait in host memory")
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the model's longest)")
    parser.add_argument("--precision", choices=["bf16", "fp32", "pure-bf16"], default="bf16",
                        help="bf16: mixed precision with fp32 master weights (the paper's 16 bytes per parameter); "
                             "pure-bf16: parameters, gradients and optimizer state in bf16 (with --tp, which mixed "
                             "precision does not support)")
    parser.add_argument("--keep-param-shard", action="store_true",
                        help="bf16, stage 3: keep a bf16 copy of each shard (MixedPrecision(cast_at_gather=False)), "
                             "DeepSpeed's and the paper's layout, instead of gathering casts of the fp32 masters")
    parser.add_argument("--device-memory", type=parse_bytes, help="bytes per device, e.g. 32GB, 80GiB")
    parser.add_argument("--max-model", action="store_true", help="the deepest model that fits, per stage")
    parser.add_argument("--confirm", action="store_true", help="with --max-model: plan the model found, too")


def run(args: argparse.Namespace) -> str:
    shape = model_shape(args.model)
    options = _options(args)
    if args.max_model:
        if args.device_memory is None:
            raise SystemExit("--max-model needs --device-memory")
        return max_model_table(shape, args.world, args.stage, args.device_memory, args.confirm, options)
    return plan_table(shape, args.world, args.stage, args.device_memory, options)


def _options(args) -> dict:
    if args.keep_param_shard and args.precision != "bf16":
        raise SystemExit(f"--keep-param-shard keeps a bf16 copy of each shard of bf16 mixed precision; with "
                         f"--precision {args.precision} there is none to keep")
    options = {"tp": args.tp, "batch": args.batch, "seq": args.seq}
    if args.precision == "bf16":
        options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                                    cast_at_gather=not args.keep_param_shard)
    if args.precision == "pure-bf16":
        options["dtype"] = torch.bfloat16
    for name in ("checkpoint", "partition_activations", "offload_activations"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    return options


def plan_table(shape: ModelShape, world: int, stages: list[int], device_memory: int | None, options: dict) -> str:
    headers = ["stage", "model states", "activations", "checkpoints", "peak", "dp comm (Ψ)"]
    tp = options["tp"]
    headers += ["tp comm (Ψ)"] * (tp > 1) + ["fits"] * (device_memory is not None)
    rows = []
    for stage in stages:
        s = plan_decoder(shape, world_size=world, stage=stage, **options)
        checkpoints = _gb(s.resident_checkpoint_bytes) + (f" (+{_gb(s.offloaded_bytes)} host)"
                                                           if s.offloaded_bytes else "")
        row = [stage, _gb(s.model_state_bytes["total"]), _gb(s.activation_bytes), checkpoints, _gb(s.peak_bytes),
               f"{s.comm_volume_psi:.2f}"]
        if tp > 1:
            row.append(f"{(s.tp_comm_volume + s.activation_comm_volume) / s.num_params:.2f}")
        if device_memory is not None:
            row.append("yes" if s.peak_bytes <= device_memory else "no")
        rows.append(row)
    return _title(shape, world, options) + "\n" + tabulate(rows, headers=headers, disable_numparse=True,
                                                           colalign=("right",) * len(headers))


def max_model_table(shape: ModelShape, world: int, stages: list[int], device_memory: int, confirm: bool,
                    options: dict) -> str:
    rows = []
    for stage in stages:
        def states(s, stage=stage):
            return plan_decoder(s, world_size=world, stage=stage, **options).model_state_bytes["total"]

        def peak(s, stage=stage):
            return plan_decoder(s, world_size=world, stage=stage, **options).peak_bytes

        by_states, by_peak = (deepest(shape, needed, device_memory, confirm) for needed in (states, peak))
        rows.append([stage, by_states, _billions(shape, by_states), by_peak, _billions(shape, by_peak)])
    headers = ["stage", "layers (model states)", "Ψ", "layers (peak)", "Ψ (peak)"]
    title = (f"largest {shape.name}-wide model (d_model {shape.d_model}) in {device_memory / GB:g} GB per device; "
             + _title(shape, world, options, with_size=False))
    return title + "\n" + tabulate(rows, headers=headers, disable_numparse=True, colalign=("right",) * len(headers))


def _billions(shape: ModelShape, depth: int) -> str:
    return f"{num_params(shape.with_depth(depth)) / 1e9:.1f}B" if depth else "-"


def _title(shape: ModelShape, world: int, options: dict, with_size: bool = True) -> str:
    tp = options["tp"]
    parts = [f"{shape.name}: Ψ = {num_params(shape) / 1e9:.2f}B ({shape.n_layer} layers)"] if with_size else []
    parts.append(f"{world} ranks" + (f" = {world // tp} dp x {tp} tp" if tp > 1 else ""))
    parts.append(f"batch {options['batch']} x {options['seq'] or shape.max_seq} tokens per dp rank")
    parts.append("bf16 mixed precision" if "mixed_precision" in options else
                 "bf16" if options.get("dtype") == torch.bfloat16 else "fp32")
    mixed = options.get("mixed_precision")
    extras = [name for name, flag in (("bf16 shard kept at stage 3", mixed is not None and not mixed.cast_at_gather),
                                      ("checkpointed blocks", options.get("checkpoint")),
                                      ("P_a", options.get("partition_activations")),
                                      ("offloaded checkpoints", options.get("offload_activations"))) if flag]
    return ", ".join(parts + extras) + "; bytes per rank"


def _gb(nbytes: int | None) -> str:
    """Bytes in the largest decimal unit that leaves a whole part (a tiny model's states are not 0.00 GB)."""
    if nbytes is None:
        return "-"
    for unit in ("TB", "GB", "MB", "kB"):
        if nbytes >= _UNIT[unit.upper()]:
            return f"{nbytes / _UNIT[unit.upper()]:.2f} {unit}"
    return f"{nbytes} B"


def _stages(text: str) -> list[int]:
    try:
        stages = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"stages must be comma-separated integers, got {text!r}") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"stages must be among 0, 1, 2, 3, got {text!r}")
    return stages


def parse_bytes(text: str) -> int:
    """"32GB", "80GiB", "512 MB" or a plain number of bytes."""
    match = _BYTES.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"device memory must look like 32GB or 80GiB, got {text!r}")
    return int(float(match.group(1)) * _UNIT.get((match.group(2) or "").upper(), 1))
