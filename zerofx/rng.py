"""The random-number generator's state as graph ops, so that a recomputed region draws what forward drew.

Eager activation checkpointing (``torch.utils.checkpoint``) saves the generator's state with
``torch.get_rng_state()`` when forward runs and restores it around the recompute. Traced, those calls would act
on the tracer's generator once and vanish from the graph, and the recompute would draw a fresh dropout mask every
step. While a step is captured, `traced_rng_state` turns them into the ops ``zerofx::get_rng_state`` and
``zerofx::set_rng_state``, which run at every step; the checkpointing pass inserts the same ops around its own
recomputed regions.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.fx as fx


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    getattr(module, "_lazy_init", lambda: None)()
    return module.default_generators[device.index if device.index is not None else module.current_device()]


@torch.library.custom_op("zerofx::get_rng_state", mutates_args=())
def get_rng_state(device: torch.device) -> torch.Tensor:
    return _generator(device).get_state()


@get_rng_state.register_fake
def _(device: torch.device) -> torch.Tensor:
    return torch.empty(_generator(device).get_state().numel(), dtype=torch.uint8)


@torch.library.custom_op("zerofx::set_rng_state", mutates_args=())
def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    _generator(device).set_state(state)


@set_rng_state.register_fake
def _(state: torch.Tensor, device: torch.device) -> None:
    return None


GET = torch.ops.zerofx.get_rng_state.default
SET = torch.ops.zerofx.set_rng_state.default
fx.node.has_side_effect(SET)  # returns nothing, must never be dropped as dead code


@contextlib.contextmanager
def traced_rng_state():
    """While tracing: the CPU and accelerator ``get_rng_state``/``set_rng_state`` functions become graph ops."""
    patches = [mock.patch.object(torch, "get_rng_state", lambda: GET(torch.device("cpu"))),
               mock.patch.object(torch, "set_rng_state", lambda state: SET(state, torch.device("cpu")))]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        module = torch.get_device_module(accelerator.type)

        def device_of(device):
            d = torch.device(accelerator.type, device) if isinstance(device, int) else \
                torch.device(device or accelerator.type)
            return d if d.index is not None else torch.device(d.type, module.current_device())

        patches += [mock.patch.object(module, "get_rng_state", lambda device=None: GET(device_of(device))),
                    mock.patch.object(module, "set_rng_state",
                                      lambda state, device=None: SET(state, device_of(device)))]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield
