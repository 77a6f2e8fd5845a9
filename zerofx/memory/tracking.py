"""Bytes measured at run time, independent of the passes: a dispatch mode that follows live storages.

Every tensor an op reads or writes registers its storage; a storage counts, at its current size, until it is freed.
The size is read again at every sample because a storage can be resized in place without an op (FSDP2 frees and
re-allocates its unsharded parameters with ``untyped_storage().resize_``). ``peak_bytes`` is the high-water mark of
the sum over live storages, sampled after every op (so an op's inputs and outputs count together, as they coexist).
Tensors alive before the block count from the start when passed as ``roots``. A tensor subclass (DTensor) runs
first and comes back as ops on plain tensors, which the tracker then sees. Meta and fake tensors (a trace's, which
a graph keeps as metadata) hold no memory and do not count.
"""

from __future__ import annotations

import bisect
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from zerofx.step_graph import Phase, Role, tag


class LiveStorageTracker(TorchDispatchMode):
    def __init__(self, roots=()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.ops = 0  # dispatched so far, each sampled as it returns
        for t in pytree.tree_leaves(roots):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.start_bytes = self.peak_bytes = self.live_bytes

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata not in self._live:
            nbytes = storage.nbytes()
            self._live[ref.cdata] = (ref, nbytes)
            self.live_bytes += nbytes

    def live_by_storage(self, sweep: bool = True) -> dict[int, int]:
        """Bytes of each live storage; ``sweep=False`` trusts the last sample (nothing freed or resized since)."""
        if sweep:
            self._sweep()
        return {key: nbytes for key, (ref, nbytes) in self._live.items()}

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # None once freed
            if storage is None:
                del self._live[key]
                self.live_bytes -= nbytes
            elif storage.nbytes() != nbytes:
                self._live[key] = (ref, storage.nbytes())
                self.live_bytes += storage.nbytes() - nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and not t.is_meta and not isinstance(t, FakeTensor):  # neither holds memory
                self._track(t)
        self._sweep()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.ops += 1
        return out

    def __exit__(self, *exc):
        self._sweep()
        return super().__exit__(*exc)


class StepProbe(fx.Interpreter):
    """Runs a step graph node by node under a `LiveStorageTracker` and measures, from the live storages:

    - ``peak_bytes`` and ``at_peak``, the bytes alive at that moment by what they hold;
    - ``high_water``, per category the most bytes alive at once, each at its own moment (gathered parameters
      peak where their buckets are in flight, which need not be the overall peak);
    - ``activation_bytes``, the most activation bytes (checkpoints included) alive at once while forward and backward
      run (the optimizer's temporaries, also counted as activations, come after);
    - ``grad_bytes``, gradient storage alive when backward ends (its last node, after the reduce-scatters a stage
      issues inside backward).

    What a storage holds comes from the graph: the role of the input it entered by (parameters, optimizer state,
    batch), gradients (nodes backward leaves as gradients, buffers a communication pass marks ``grad``), gathered
    parameters (buffers a pass marks ``gathered_param``), packed copies of gradients sent by a collective
    (``comm_buffer``), the inputs checkpointed regions keep (``checkpoint``) and their host copies
    (``offloaded``); everything else forward and backward allocate counts as
    ``activations`` (saved activations and temporaries alike). How many bytes comes from the storages themselves.
    A planned buffer (``memory_plan``) counts as what it holds while the step holds it or a view of it; the rest of
    the arena counts as ``arena``.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        for node in gm.graph.nodes:  # an unread value dies right away, as in the graph's own code, not at the end
            if not node.users and node.op == "call_function":
                self.user_to_last_uses.setdefault(node, []).append(node)
        backward = [n for n in gm.graph.nodes if n.op == "call_function" and tag(n) and tag(n).phase == Phase.BACKWARD]
        self._end_of_backward = backward[-1] if backward else None
        self._category: dict[int, tuple[StorageWeakRef, str]] = {}  # live storages; a freed one's key is reused
        self._slots: dict[int, tuple[int, str]] = {}  # the arena's slots in use: first byte -> (end, category)
        self._pointers_of: dict[fx.Node, tuple[int, ...]] = {}
        self._tracker: LiveStorageTracker | None = None
        self.grad_bytes = 0
        self.activation_bytes = 0
        self.peak_bytes = 0
        self.at_peak: dict[str, int] = {}
        self.high_water: dict[str, int] = {}

    def run_step(self, inputs: list, roots=()):
        self._pointers_of.clear()  # another run's tensors
        with LiveStorageTracker(roots) as tracker:
            self._tracker = tracker
            out = self.run(*inputs)
        self.peak_bytes = tracker.peak_bytes
        return out

    def run_node(self, n: fx.Node):
        ops_before = self._tracker.ops
        result = super().run_node(n)
        # an ATen node that dispatched one op was sampled as that op returned, and nothing has let go of a tensor
        # since (its inputs stay in the environment until after this): sweeping the live storages again, as every
        # other node needs, would find the same
        sampled = isinstance(n.target, torch._ops.OpOverload) and self._tracker.ops - ops_before == 1
        category = category_of(n)
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                ref = StorageWeakRef(value.untyped_storage())
                known = self._category.get(ref.cdata)
                # a gradient or gathered parameter may be a view of a buffer made earlier: that buffer holds it now
                relabels = category in ("grads", "gathered_params")
                if known is not None and known[1] == "arena":  # slots count apart
                    if relabels and value.numel():
                        self._relabel_slot(value, category)
                elif known is None or known[0].expired() or relabels:
                    self._category[ref.cdata] = (ref, category)
        if _reads_a_slot(n):
            self._open_slot(result, category_of(next(iter(n.users))))
        live = self._tracker.live_by_storage(sweep=not sampled)
        for key in self._category.keys() - live.keys():  # freed since the last node: the key may be reused
            del self._category[key]
        live_by_category: dict[str, int] = {}
        for key, nbytes in live.items():
            known = self._category.get(key)
            name = known[1] if known is not None else "activations"
            live_by_category[name] = live_by_category.get(name, 0) + nbytes
        for name, nbytes in self._slots_in_use().items():  # the arena's bytes by what its slots hold now
            live_by_category[name] = live_by_category.get(name, 0) + nbytes
            live_by_category["arena"] -= nbytes
        for name, nbytes in live_by_category.items():
            if nbytes > self.high_water.get(name, 0):
                self.high_water[name] = nbytes
        if self._tracker.live_bytes >= sum(self.at_peak.values()):
            self.at_peak = live_by_category
        if n.op == "call_function" and tag(n).phase != Phase.OPTIMIZER:  # after every input is categorized
            self.activation_bytes = max(self.activation_bytes, live_by_category.get("activations", 0)
                                        + live_by_category.get("checkpoints", 0))
        if n is self._end_of_backward:
            self.grad_bytes = live_by_category.get("grads", 0)
        return result

    def _open_slot(self, view: torch.Tensor, category: str) -> None:
        """A planned buffer about to be written: it takes its bytes from any earlier slot there (which the plan
        guarantees is no longer read)."""
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        for first, (last, _) in list(self._slots.items()):
            if first < end and start < last:
                del self._slots[first]
        self._slots[start] = (end, category)

    def _relabel_slot(self, view: torch.Tensor, category: str) -> None:
        """The slot ``view`` lies in holds ``category`` from now on, as an unplanned storage would be relabelled."""
        first = self._slot_of(view.data_ptr(), sorted(self._slots))
        if first is not None:
            self._slots[first] = (self._slots[first][0], category)

    def _slot_of(self, pointer: int, firsts: list[int]) -> int | None:
        """The first byte of the slot (``firsts``, sorted) that ``pointer`` lies in, if any."""
        i = bisect.bisect_right(firsts, pointer) - 1
        return firsts[i] if i >= 0 and pointer < self._slots[firsts[i]][0] else None

    def _pointers(self, node: fx.Node) -> tuple[int, ...]:
        """Where the non-empty tensors of ``node``'s value start, read once: a slot's views never move, and no other
        tensor can start inside the arena, which is allocated all along."""
        pointers = self._pointers_of.get(node)
        if pointers is None:
            pointers = self._pointers_of[node] = tuple(
                t.data_ptr() for t in pytree.tree_leaves(self.env[node]) if isinstance(t, torch.Tensor) and t.numel())
        return pointers

    def _slots_in_use(self) -> dict[str, int]:
        """Bytes of the slots the step still holds (their writer's result or a view of it), by category."""
        if not self._slots:
            return {}
        firsts = sorted(self._slots)
        held = set()
        for node in self.env:
            if node.op == "placeholder":
                continue  # the arena's own list holds every slot
            for pointer in self._pointers(node):
                if (first := self._slot_of(pointer, firsts)) is not None:
                    held.add(first)
        by_category: dict[str, int] = {}
        for first in held:
            end, category = self._slots[first]
            by_category[category] = by_category.get(category, 0) + end - first
        return by_category


def _reads_a_slot(n: fx.Node) -> bool:
    """``arena[i]``: the view a planned op writes its output into (`plan_memory`)."""
    return (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "placeholder" and category_of(n.args[0]) == "arena")


_INPUT_CATEGORY = {Role.PARAM: "params", Role.MASTER: "master_params", Role.OPT_STATE: "optimizer_states",
                   Role.BATCH: "batch", Role.BUFFER: "buffers", Role.GRAD_IN: "grads", Role.ARENA: "arena"}
_PASS_CATEGORY = {"gathered_param": "gathered_params", "comm_buffer": "comm_buffers", "offloaded": "offloaded",
                  "checkpoint": "checkpoints"}


def category_of(n: fx.Node) -> str:
    t = tag(n)
    if n.op == "get_attr":
        return "constants"  # the graph module's own (`plan_scalar_operands`' numbers)
    if n.op == "placeholder" and t is not None and t.slots:
        return _INPUT_CATEGORY.get(t.slots[0].role, "activations")
    if (t is not None and t.has(Role.GRAD)) or n.meta.get("zerofx_category") == "grad":
        return "grads"
    return _PASS_CATEGORY.get(n.meta.get("zerofx_category"), "activations")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[StorageWeakRef(t.untyped_storage()).cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())
