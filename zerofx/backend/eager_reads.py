"""Stage 3 through the backend: what eager code meets when it uses a parameter.

Between compiled graphs a stage-3 parameter keeps its shape but holds no memory (`zerofx.backend.shards`). Eager
code uses such parameters: a module whose forward Dynamo leaves to eager, a parameter passed to a
``torch._dynamo.disable``d function, a weight norm logged or a state dict taken between steps, weights loaded.
Each parameter is therefore a `ShardedParameter`: a ``torch.nn.Parameter`` whose ``__torch_function__`` handles a
call made outside compiled code:

- a call that reads only metadata (shape, strides, ``.grad``, hooks, ``zeros_like``), a conversion that converts
  nothing (``model.to(its device)``) and autograd's entry points get the parameter itself;
- a call that reads values gets the gathered value in the parameter's place, as FSDP2's pre-forward hooks hand a
  module its unsharded parameters, but at the read itself, so a read outside the owning module's forward is covered
  too. The value is a fresh tensor, differentiable to the parameter (its gradient, full-shaped, accumulates in
  ``.grad`` as autograd does it, and the backend reduces it as a backward ends), gathered once per call and alive
  as long as what the call returns or saves for backward needs it: nothing fills and nothing must be released;
- ``p.copy_(full)`` (``model.load_state_dict``) and ``p.data = full`` (of ``p``'s dtype and device) write this rank's
  chunk of ``full`` into the shard;
- any other write (``mul_``, ``nn.init.normal_``, ``inplace=True``, ``out=p``, an in-place collective, ``.data =`` of
  another dtype) raises, naming the parameter, where it would write into a copy that is then dropped; so does
  reading ``.data``, through which such writes are usually made (``p.data.normal_()``).

``copy.deepcopy`` and pickling give a plain parameter holding the gathered value. Inside compiled code
(``torch.compiler.is_compiling()``) the parameter passes through untouched, so Dynamo and AOTAutograd see it as
before. What the handler cannot see: views taken of a read's result and written later (``p.detach().zero_()``
writes into the gathered copy), and paths that bypass ``__torch_function__`` (``torch.func`` transforms,
``as_subclass``, DLPack).
"""

from __future__ import annotations

import collections
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.utils import _pytree as pytree

Tensor = torch.Tensor

# calls that use a parameter without reading its values (Tensor properties other than the aliasing ones below
# reach __torch_function__ as their descriptor's __get__ / __set__ and read no values either)
_METADATA = frozenset({
    Tensor.size, Tensor.stride, Tensor.dim, Tensor.ndimension, Tensor.numel, torch.numel, Tensor.nelement,
    Tensor.element_size, Tensor.storage_offset, Tensor.untyped_storage, Tensor.data_ptr, Tensor.is_contiguous,
    Tensor.is_floating_point, Tensor.is_complex, Tensor.is_signed, Tensor.is_pinned, Tensor.is_shared,
    Tensor.is_same_size, Tensor.dim_order, Tensor.get_device, Tensor._is_view, Tensor.__hash__, Tensor.__len__,
    Tensor.requires_grad_, Tensor.register_hook, Tensor.register_post_accumulate_grad_hook,
    Tensor.new_empty, Tensor.new_zeros, Tensor.new_ones, Tensor.new_full, torch.empty_like, torch.zeros_like,
    torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.autograd.grad, torch.autograd.backward, Tensor.backward,
})
_ALIASING_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})  # views: they read values
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__set__"} | {f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")})
_WRITING_COLLECTIVES = frozenset({  # torch.distributed functions that write into their first argument
    "broadcast", "all_reduce", "reduce", "recv", "irecv", "scatter", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single"})
_CONVERSIONS = {Tensor.to: None, Tensor.cpu: "cpu", Tensor.cuda: "cuda", Tensor.float: torch.float32,
                Tensor.double: torch.float64, Tensor.half: torch.float16, Tensor.bfloat16: torch.bfloat16}


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter of a prepared model: full-shaped, without memory outside compiled graphs. ``zerofx.prepare``
    sets ``fqn``, ``read_gathered`` (the parameter whole, for one read) and ``write_full`` (a full value's chunk into
    the shard)."""

    fqn: str
    read_gathered: Callable[[ShardedParameter], Tensor]
    write_full: Callable[[str, Tensor], None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if torch.compiler.is_compiling():  # first: Dynamo traces this handler, and must see nothing else of it
                return func(*args, **kwargs)
            if _uses_no_values(func, args, kwargs):  # before the walk over the arguments: `.grad` comes every step
                return func(*args, **kwargs)
            hollow = _hollow_in(args, kwargs)
            if not hollow:
                return func(*args, **kwargs)
            if func is Tensor.copy_ and args[0] is hollow[0]:
                return _copy_into(hollow[0], args[1])
            if _assigns_new_value(func, args):
                hollow[0].write_full(hollow[0].fqn, args[1])
                return None
            if _writes(func, hollow, args, kwargs):
                raise _write_error(_name(func), hollow[0])
            if _property(func) == ("__get__", "data"):
                raise RuntimeError(
                    f"zerofx stage 3: parameter {hollow[0].fqn!r} holds only this rank's shard outside compiled "
                    f"code, so its {_name(func)} has no memory behind it; read the parameter itself (p.detach(), "
                    "p * 1), which eager code receives gathered")
            gathered = {id(p): p.read_gathered(p) for p in hollow}
            versions = _versions(gathered)
            args, kwargs = pytree.tree_map_only(ShardedParameter, lambda p: gathered.get(id(p), p), (args, kwargs))
            result = func(*args, **kwargs)
            for p in hollow:  # a write the name did not give away (inplace=True, max_norm=, an aten overload)
                if versions and gathered[id(p)]._version != versions[id(p)]:
                    raise _write_error(_name(func), p)
            return result

    def __deepcopy__(self, memo):
        return self._plain()

    def __reduce_ex__(self, protocol):
        return self._plain().__reduce_ex__(protocol)

    def _plain(self) -> nn.Parameter:
        """A plain parameter holding this one's value (gathered where it holds none)."""
        with torch._C.DisableTorchFunctionSubclass():
            value = self.read_gathered(self) if not self.untyped_storage().nbytes() else self
            return nn.Parameter(value.detach().clone(), self.requires_grad)


# Called from eager code while a compiled model runs (from torch.nn's modules, which Dynamo leaves to eager), the
# handler and what it calls (the ranks' agreement, the gather) would be frames Dynamo compiles as regions of their
# own; they must run as written, while Dynamo still traces the handler inline inside compiled code
# (torch._dynamo.skip would make that a graph break). The exec strategy acts on frames only, not on inlining.
set_code_exec_strategy(ShardedParameter.__torch_function__.__func__.__code__,
                       FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def _hollow_in(args, kwargs) -> list[ShardedParameter]:
    """The parameters among the arguments that hold no memory (each once, in order)."""
    found = collections.OrderedDict()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, ShardedParameter) and not leaf.untyped_storage().nbytes():
            found.setdefault(id(leaf), leaf)
    return list(found.values())


def _property(func) -> tuple[str, str | None]:
    """(``__get__``/``__set__``/..., the property's name) for a Tensor property's accessor, else (name, None)."""
    name = getattr(func, "__name__", "")
    return name, getattr(getattr(func, "__self__", None), "__name__", None) if name.startswith("__") else None


def _versions(gathered: dict[int, Tensor]) -> dict[int, int]:
    """The gathered values' version counters (none under inference mode, whose tensors keep none)."""
    if torch.is_inference_mode_enabled():
        return {}
    return {key: value._version for key, value in gathered.items()}


def _assigns_new_value(func, args) -> bool:
    """``p.data = value`` where ``value`` is ``p``'s new value whole, in its dtype and on its device (HF's
    ``_adjust_bias``, ``vector_to_parameters``): a write of the whole value, as ``copy_`` is. A ``value`` of another
    dtype or device (``model.half()``) would change the parameter, not its value, and is refused as a write."""
    if _property(func) != ("__set__", "data"):
        return False
    p, value = args
    return isinstance(value, Tensor) and (value.shape, value.dtype, value.device) == (p.shape, p.dtype, p.device)


def _name(func) -> str:
    """What the messages call ``func``: a property's assignment as ``.data =``."""
    accessor, attribute = _property(func)
    if accessor in ("__get__", "__set__", "__delete__"):
        return f"`.{attribute}{' =' if accessor == '__set__' else ''}`"
    return getattr(func, "__name__", repr(func))


def _uses_no_values(func, args, kwargs) -> bool:
    if func in _METADATA:
        return True
    if func is Tensor.type:
        return len(args) == 1 and not kwargs  # the type's name
    if func in _CONVERSIONS:
        return _converts_nothing(func, args, kwargs)
    accessor, attribute = _property(func)
    if (accessor, attribute) == ("__set__", "data"):
        return args[1] is args[0]  # `param.data = param` (Module._apply after a conversion that converted nothing)
    return accessor in ("__get__", "__set__", "__delete__") and attribute not in _ALIASING_PROPERTIES


def _converts_nothing(func, args, kwargs) -> bool:
    p, target = args[0], _CONVERSIONS[func]
    if func is Tensor.to:
        kwargs = dict(kwargs)
        copies = kwargs.pop("copy", False)
        positional = list(args[1:])
        flags = [i for i, a in enumerate(positional) if isinstance(a, bool)]  # non_blocking, then copy
        if len(flags) == 2:
            copies = positional.pop(flags[1])
        device, dtype, _, memory_format = torch._C._nn._parse_to(*positional, **kwargs)
        return not copies and (device is None or _same_device(device, p)) and dtype in (None, p.dtype) and \
            memory_format in (None, torch.preserve_format)
    if isinstance(target, torch.dtype):
        return p.dtype == target and len(args) == 1 and not kwargs
    if target == "cpu":
        return p.device.type == "cpu"
    device = args[1] if len(args) > 1 else kwargs.get("device")
    return _same_device(torch.device("cuda", device) if isinstance(device, int) else device or "cuda", p)


def _same_device(device, p: Tensor) -> bool:
    """Whether ``device`` names ``p``'s device (``"cuda"`` names the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device == p.device


def _writes(func, hollow: list[ShardedParameter], args, kwargs) -> bool:
    """Whether ``func`` would write into one of ``hollow``: an in-place method or function (``mul_``, ``+=``,
    ``x[i] = ``, ``nn.init.normal_(tensor=p)``, a ``torch._foreach_*_`` over a list holding it, an aten overload
    ``add_.Tensor``), an in-place collective, ``.data = ``, or ``out=p``."""
    base = getattr(func, "__name__", "").split(".")[0]
    in_place = (base.endswith("_") and not base.endswith("__")) or base in _IN_PLACE_DUNDERS or (
        base in _WRITING_COLLECTIVES and getattr(func, "__module__", "").startswith(dist.__name__))
    first = args[0] if args else next(iter(kwargs.values()), None)
    written = pytree.tree_leaves(first) if in_place else []
    return any(t is p for p in hollow for t in [*written, *pytree.tree_leaves(kwargs.get("out"))])


def _copy_into(p: ShardedParameter, source) -> ShardedParameter:
    """``p.copy_(source)``: ``source`` is ``p``'s new value whole (``model.load_state_dict``), so this rank's chunk of it
    goes into the shard and nothing is gathered."""
    if torch.is_grad_enabled() and p.requires_grad:
        raise RuntimeError(f"a leaf Variable that requires grad ({p.fqn!r}) is being used in an in-place operation")
    if isinstance(source, ShardedParameter) and not source.untyped_storage().nbytes():
        source = source.read_gathered(source)
    p.write_full(p.fqn, torch.as_tensor(source).expand(p.shape))
    return p


def _write_error(name: str, p: ShardedParameter) -> RuntimeError:
    return RuntimeError(
        f"zerofx stage 3: {name} would write into parameter {p.fqn!r}, which outside compiled code holds only this "
        "rank's shard (the write would land in a gathered copy and be lost); write to the parameters before "
        "zerofx.prepare, or load full values with model.load_state_dict or param.copy_")


class GatheredForRead(torch.autograd.Function):
    """The gathered value of a parameter, a new tensor whose gradient flows, as it is, to the parameter."""

    @staticmethod
    def forward(ctx, param: Tensor, gather: Callable[[], Tensor]) -> Tensor:
        return gather()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None
