"""``zerofx.plan``: what one rank of a world of any size would hold and send, predicted from the step's graph.

The step is captured with the model on the meta device, passed through the same passes as ``zerofx.compile``'s for
``world_size`` ranks of a fake process group (`fake_world`), and run once on meta tensors, which allocates nothing
and records every collective the rank would issue. Bytes then come from the final graph's buffer lifetimes
(`zerofx.memory.lifetimes`), on the device the step's state is on (host copies apart):

- model states: the bytes of the step's inputs by class (parameters or their shards, master weights, optimizer
  state), and the gradients alive when backward ends;
- peak: the most bytes alive at once, inputs included;
- activations: the most bytes of activations and activation checkpoints alive at once while forward and backward run
  (everything the step allocates that is not a model state, a gathered parameter or a communication buffer), and
  what they are at that moment, by the op that made them. Attention counts as the fused kernel a real run uses
  (`on_meta`): per layer it keeps its output and one fp32 log-sum-exp per query and head, never T × T scores;
- checkpoints: the most checkpoint bytes resident on the device at once, and in host memory (offloaded).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from zerofx.api import compile as compile_step
from zerofx.memory.lifetimes import Lifetime, lifetimes, peak_live, step_device
from zerofx.memory.timeline import live_by_category
from zerofx.planning.on_meta import OnMeta
from zerofx.planning.fake_world import fake_world
from zerofx.stats import StepStats
from zerofx.step_graph import Phase, tag

_MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
_ACTIVATIONS = ("activations", "checkpoints")


def plan(train_step: Callable, model, optimizer, example_batch: tuple, *, world_size: int, stage: int = 0,
         mesh_shape: tuple[int, int] | None = None, **options) -> StepStats:
    """Predict the `StepStats` rank 0 of ``world_size`` ranks would report for ``train_step(model, optimizer,
    *example_batch)`` compiled with ``stage`` and ``options`` (any of ``zerofx.compile``'s: ``mixed_precision``,
    ``checkpoint``, ``partition_activations``, ``offload_activations``, ...), with ``memory_plan`` off: the same
    peak, and no arena kept between steps (``held_plan_bytes`` 0).

    ``model`` is an ``nn.Module`` whose parameters are on the meta device, or, with ``mesh_shape=(dp, tp)``, a
    function of the tensor-parallel ``DeviceMesh`` that returns one (built on meta and split over it); ``optimizer``
    is an optimizer over its parameters, or a function of the model that returns one. The batch may be real or meta
    tensors; only shapes and dtypes matter. Like ``zerofx.compile``'s step, the plan takes the model's parameters
    and optimizer state (at stages 1-3 they end as shards): build a model per plan. Must run in a process without a
    process group: the plan makes its own world.
    """
    if options.get("memory_plan"):
        raise ValueError("memory_plan=True: plan predicts the step as the allocator runs it (meta tensors lack some "
                         "out= kernels a planned graph writes with); planned, the peak is the same")
    options["memory_plan"] = False  # also at stage 0, where zerofx.compile plans by default
    tp = 1
    if mesh_shape is not None:
        if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != world_size:
            raise ValueError(f"mesh_shape must be (dp, tp) with dp * tp == world_size={world_size}, "
                             f"got {mesh_shape!r}")
        tp = mesh_shape[1]
    with fake_world(world_size, tp) as mesh:
        if not isinstance(model, nn.Module):
            model = model(mesh["tp"] if mesh is not None else None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model)
        _check_on_meta(model)
        batch = tuple(torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t
                      for t in example_batch)
        step = compile_step(train_step, stage=stage, mesh=mesh, verify_ranks=False, **options)
        with OnMeta():
            step(model, optimizer, *batch)
        return predicted(step.stats(), step.graph().graph)


def _check_on_meta(model: nn.Module) -> None:
    placed = {p.device.type for p in model.parameters()}
    if placed != {"meta"}:
        raise ValueError(f"model: plan needs its parameters on the meta device (build it inside "
                         f"`with torch.device('meta'):`), found them on {', '.join(sorted(placed))}")


def predicted(stats: StepStats, graph: fx.Graph) -> StepStats:
    """``stats`` of a step run on meta tensors (communication, formula, units), with its bytes predicted from the
    lifetimes of ``graph``, its final graph."""
    nodes = list(graph.nodes)
    spans = lifetimes(graph)
    device = step_device(spans)
    on_device = [s for s in spans if s.device == device]
    live = live_by_category(on_device, len(nodes))
    forward_backward = [i for i, n in enumerate(nodes) if n.op == "call_function" and tag(n).phase != Phase.OPTIMIZER]
    end_of_backward = max((i for i in forward_backward if tag(nodes[i]).phase == Phase.BACKWARD), default=None)
    states = {name: sum(s.nbytes for s in spans if s.is_input and s.category == name)
              for name in ("params", "master_params", "optimizer_states")}
    states["grads"] = _alive_at(spans, "grads", end_of_backward)
    states["total"] = sum(states[name] for name in _MODEL_STATES)
    zero = [0] * len(nodes)
    activations = [sum(live.get(c, zero)[i] for c in _ACTIVATIONS) for i in forward_backward]
    at_peak = forward_backward[max(range(len(activations)), key=activations.__getitem__)] if activations else None
    host = live_by_category([s for s in spans if s.device != device], len(nodes)).get("offloaded")
    return dataclasses.replace(
        stats, model_state_bytes=states, peak_bytes=peak_live(on_device)[0],
        activation_bytes=int(max(activations, default=0)),
        activations_at_peak=_made_by(nodes, on_device, at_peak),
        resident_checkpoint_bytes=int(max(live.get("checkpoints", zero), default=0)),
        offloaded_bytes=int(host.max()) if host is not None else 0)


def _made_by(nodes: list[fx.Node], spans: list[Lifetime], position: int | None) -> dict[str, int]:
    """The activation bytes alive at ``position`` by the op that made them (checkpoints together), largest first."""
    target = {n.name: str(n.target) for n in nodes}
    made_by: dict[str, int] = {}
    for s in spans:
        if position is not None and s.category in _ACTIVATIONS and s.start <= position < s.end:
            what = "checkpoints" if s.category == "checkpoints" else target[s.node]
            made_by[what] = made_by.get(what, 0) + s.nbytes
    return dict(sorted(made_by.items(), key=lambda item: -item[1]))


def _alive_at(spans: list[Lifetime], category: str, position: int | None) -> int:
    if position is None:
        return 0
    return sum(s.nbytes for s in spans if s.category == category and s.start <= position < s.end)
