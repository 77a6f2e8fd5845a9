"""Readable dumps: the graph after capture and after each pass, as Python with shapes, one file per pass.

Each file starts with a header (pass, node count, the collectives and their bytes) so ``diff`` between consecutive
files shows what a pass did.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import torch
import torch.fx as fx

from zerofx import collectives
from zerofx.step_graph import TAG


def collective_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in collectives.COLLECTIVES]


def summary(gm: fx.GraphModule) -> list[str]:
    """Header lines: node count per phase and each collective with its elements and bytes."""
    phases = Counter(n.meta[TAG].phase.value for n in gm.graph.nodes if TAG in n.meta and n.op == "call_function")
    lines = [f"nodes: {len(gm.graph.nodes)} ({', '.join(f'{k} {v}' for k, v in sorted(phases.items()))})"]
    colls = collective_nodes(gm)
    total = sum(numel * dtype.itemsize for numel, dtype in map(full_buffer, colls))
    lines.append(f"collectives: {len(colls)} ({total} bytes)")
    for n in colls:
        numel, dtype = full_buffer(n)
        lines.append(f"  {n.name}: {n.target.__name__} {numel} x {dtype} "
                     f"({numel * dtype.itemsize} bytes, {n.meta[TAG].phase.value})")
    return lines


def full_buffer(node: fx.Node) -> tuple[int, object]:
    """Elements and dtype of the collective's full buffer, as records count them: the gathered output(s), or the
    reduced input."""
    if node.target is collectives.all_gather_coalesced:
        vals = node.meta["val"]
        return sum(v.numel() for v in vals), vals[0].dtype
    val = node.meta["val"] if node.target is collectives.all_gather else node.args[0].meta["val"]
    return val.numel(), val.dtype


def render(gm: fx.GraphModule, title: str) -> str:
    """A module that imports: the header as comments, the imports the body names, then ``class Step``."""
    header = "\n".join(f"# {line}" for line in [title, *summary(gm)])
    imports = ["import torch", "from math import inf, nan", "from torch import device"]
    functions = dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "call_function"
                              and getattr(n.target, "__module__", "").startswith("zerofx."))
    for module in dict.fromkeys(f.__module__ for f in functions):
        imports.append(f"import {module}")
    # the names fx's code gives them: the qualified name, dots as underscores
    imports += [f"{f.__module__.replace('.', '_')}_{f.__name__} = {f.__module__}.{f.__name__}" for f in functions]
    body = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    body = re.sub(r"^class \S+\(torch\.nn\.Module\):\n", "class Step(torch.nn.Module):\n" + _constants(gm), body,
                  count=1, flags=re.M)
    return f"{header}\n\n" + "\n".join(imports) + f"\n\n\n{body}"


def _constants(gm: fx.GraphModule) -> str:
    """``__init__`` making the one-element tensors the graph reads as attributes (`plan_scalar_operands`'
    numbers, `carry_rank_agreement`'s flag), so that the module runs as it is; nothing where it reads none."""
    scalars = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr" and "." not in n.target}
    scalars = {name: value for name, value in scalars.items()
               if isinstance(value, torch.Tensor) and value.numel() == 1}
    if not scalars:
        return ""
    lines = ["    def __init__(self):", "        super().__init__()"]
    for name, value in scalars.items():
        device = "" if value.device.type == "cpu" else f", device={str(value.device)!r}"
        lines.append(f"        self.register_buffer({name!r}, torch.tensor({value.tolist()!r}, "
                     f"dtype={value.dtype}{device}))")
    return "\n".join(lines) + "\n\n"


def write(dump_dir: str, index: int, name: str, gm: fx.GraphModule) -> str:
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, f"{index:02d}_{name}.py")
    with open(path, "w") as f:
        f.write(render(gm, f"pass {index}: {name}"))
    return path


def write_units(dump_dir: str, artifacts: dict) -> str:
    """``units.txt``: every communication bucket the passes planned (module path or parameters, bytes, why it was cut
    there) and, at stage 3, each all-gather issued, and which parameters read again later were kept gathered or
    gathered again; with activation checkpointing, each region recomputed in backward."""
    lines = []
    for key, title in (("gather_buckets", "parameter units (stage 3 all-gathers)"),
                       ("grad_buckets", "gradient buckets (all-reduce or reduce-scatter)"),
                       ("param_buckets", "parameter buckets (all-gather after the update)")):
        if artifacts.get(key):
            lines.append(f"{title}:")
            lines += [f"  {_bucket_line(b)}" for b in artifacts[key]]
    if artifacts.get("kept_gathered"):
        lines.append("kept gathered until a later read (no larger than the largest unit): "
                     + ", ".join(artifacts["kept_gathered"]))
    if artifacts.get("gathers"):
        lines.append("all-gathers issued (first micro-batch):")
        lines += [f"  {phase.value:<8} {_bucket_line(b)}" for phase, b in artifacts["gathers"]]
    if artifacts.get("recomputed"):
        lines.append("checkpointed regions recomputed in backward:")
        lines += [f"  {name}: {r.nodes} nodes, {r.flops:,} FLOPs, from {r.checkpoint_bytes:,} bytes of saved inputs"
                  for name, r in artifacts["recomputed"].items()]
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, "units.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _bucket_line(bucket) -> str:
    names = bucket.names if len(bucket.names) <= 3 else bucket.names[:3] + [f"... {len(bucket.names) - 3} more"]
    return f"{bucket.unit or '(outside units)'}: {bucket.nbytes:,} bytes, {bucket.reason}; {', '.join(names)}"
