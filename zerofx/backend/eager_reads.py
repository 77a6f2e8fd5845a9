"""Stage 3 through the backend: what eager code reads when it reads a parameter.

Between compiled graphs a stage-3 parameter keeps its shape but holds no memory (`zerofx.backend.shards`). Eager
code reads such parameters: a module whose forward Dynamo leaves to eager, a parameter passed to a
``torch._dynamo.disable``d function, a weight norm logged between steps. Each parameter is therefore a
`ShardedParameter`: a ``torch.nn.Parameter`` whose ``__torch_function__`` hands a call made outside compiled code the
gathered value in the parameter's place, as FSDP2's pre-forward hooks hand a module its unsharded parameters, but at
the read itself, so a read outside the owning module's forward is covered too. The gathered value is a fresh
tensor, differentiable to the parameter (its gradient, full-shaped, accumulates in ``.grad`` as autograd does it,
and the backend reduces it as a backward ends), and lives as long as what the call returns or saves for backward
needs it: nothing is filled and nothing must be released.

Inside compiled code (``torch.compiler.is_compiling()``) the parameter passes through untouched, so Dynamo and
AOTAutograd see it as before. Calls that read only metadata (shape, strides, ``.grad``, hooks) pass through too;
calls that would write into the parameter raise, naming it, instead of writing into a copy that is then dropped.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.utils import _pytree as pytree

Tensor = torch.Tensor

# what a call may do with a parameter that holds no memory without reading it (Tensor properties other than the
# ones below reach __torch_function__ as their descriptor's __get__ / __set__ and read no values either)
_METADATA = frozenset({
    Tensor.size, Tensor.stride, Tensor.dim, Tensor.ndimension, Tensor.numel, Tensor.nelement, Tensor.element_size,
    Tensor.storage_offset, Tensor.untyped_storage, Tensor.data_ptr, Tensor.is_contiguous, Tensor.is_floating_point,
    Tensor.is_complex, Tensor.get_device, Tensor._is_view, Tensor.__hash__, Tensor.__len__, Tensor.requires_grad_,
    Tensor.register_hook, Tensor.register_post_accumulate_grad_hook,
})
_ALIASING_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})  # they return the storage itself
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__set__"} | {f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")})


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter of a prepared model: full-shaped, without memory outside compiled graphs; eager reads see
    its gathered value (`read_gathered`, set by ``zerofx.prepare``)."""

    read_gathered: Callable[[ShardedParameter], Tensor]
    fqn: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if not torch.compiler.is_compiling() and not _reads_no_values(func):
                args, kwargs = pytree.tree_map_only(ShardedParameter, lambda p: _value_for(func, p, args, kwargs),
                                                    (args, kwargs))
            return func(*args, **kwargs)


# Called from eager code while a compiled model runs (from torch.nn's modules, which Dynamo leaves to eager), the
# handler and what it calls (the ranks' agreement, the gather) would be frames Dynamo compiles as regions of their
# own; they must run as written, while Dynamo still traces the handler inline inside compiled code
# (torch._dynamo.skip would make that a graph break). The exec strategy acts on frames only, not on inlining.
set_code_exec_strategy(ShardedParameter.__torch_function__.__func__.__code__,
                       FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def _reads_no_values(func) -> bool:
    if func in _METADATA:
        return True
    descriptor = getattr(func, "__self__", None)
    return (getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__")
            and getattr(descriptor, "__name__", None) not in _ALIASING_PROPERTIES)


def _value_for(func, p: ShardedParameter, args, kwargs) -> Tensor:
    """What ``func`` gets in place of ``p``: ``p`` itself where it holds its full value (a whole-graph run gathered
    it, `Shards.gathered`), else its gathered value; a write raises."""
    if p.untyped_storage().nbytes():
        return p
    name = getattr(func, "__name__", repr(func))
    if _writes(func, name, p, args, kwargs):
        raise RuntimeError(
            f"zerofx stage 3: {name} would write into parameter {p.fqn!r}, which outside compiled code holds only "
            "this rank's shard; write to the parameters before zerofx.prepare, or load them with "
            "zerofx.load_state_dict")
    if name == "__get__":
        raise RuntimeError(
            f"zerofx stage 3: parameter {p.fqn!r} holds only this rank's shard outside compiled code, so its "
            f"`.{func.__self__.__name__}` has no memory behind it; read the parameter itself (p.detach(), p * 1), "
            "which eager code receives gathered")
    return p.read_gathered(p)


def _writes(func, name: str, p: ShardedParameter, args, kwargs) -> bool:
    """Whether ``func`` writes into ``p``: an in-place method or function (``mul_``, ``+=``, ``x[i] = ``, a
    ``torch._foreach_*_`` over a list holding it, ``.data = ``), or ``out=p``."""
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
    written = pytree.tree_leaves(args[0]) if in_place and args else []
    return any(t is p for t in [*written, *pytree.tree_leaves(kwargs.get("out"))])


class GatheredForRead(torch.autograd.Function):
    """The gathered value of a parameter, a new tensor whose gradient flows, as it is, to the parameter."""

    @staticmethod
    def forward(ctx, param: Tensor, gather: Callable[[], Tensor]) -> Tensor:
        return gather()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None
