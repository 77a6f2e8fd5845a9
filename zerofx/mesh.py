"""ZeRO on a device mesh: state sharded over the ``"dp"`` dimension, tensor parallelism over ``"tp"`` by DTensor.

The user applies PyTorch's ``parallelize_module`` over ``mesh["tp"]``; its parameters (and the optimizer's state for
them) are then DTensors. The step graph deals in local tensors only: each DTensor the step reads enters the graph as
its local tensor and is rebuilt inside the trace as a DTensor of the same spec, so DTensor's dispatch records the
tensor-parallel collectives as ordinary functional collectives over the tp group, and every ZeRO pass sees local
tensors sharded over the dp group. (Traced as DTensors directly, make_fx would bake their local tensors into the graph
as constants.) What the step leaves behind (gradients, new optimizer state) is wrapped back into DTensors, as eager
would leave it. DTensor's private constructor, used to rebuild a leaf of the traced graph, is wrapped here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zerofx.errors import CaptureError
from zerofx.step_graph import Role, Slot

DATA_PARALLEL, TENSOR_PARALLEL = "dp", "tp"


@dataclass(frozen=True)
class MeshRanks:
    """This rank's place: in the group ZeRO shards over (the mesh's ``"dp"`` dimension, or every rank without a
    mesh), and in the tensor-parallel group (``"tp"``; alone without one)."""
    size: int
    rank: int
    group: dist.ProcessGroup | None  # None: the default group
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None

    @property
    def group_name(self) -> str | None:
        return (self.group or dist.group.WORLD).group_name if self.size > 1 else None

    @property
    def tp_group_name(self) -> str | None:
        return self.tp_group.group_name if self.tp_group is not None else None


def mesh_ranks(mesh) -> MeshRanks:
    """This rank's place in ``mesh`` (every rank is data parallel when ``mesh`` is None)."""
    if mesh is None:
        if dist.is_available() and dist.is_initialized():
            return MeshRanks(dist.get_world_size(), dist.get_rank(), None)
        return MeshRanks(1, 0, None)
    names = mesh.mesh_dim_names or ()
    if DATA_PARALLEL not in names or not set(names) <= {DATA_PARALLEL, TENSOR_PARALLEL}:
        raise ValueError(f"mesh= needs dimensions named ('dp',) or ('dp', 'tp'), got {names or 'unnamed ones'}: "
                         "build it with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
    dp = mesh[DATA_PARALLEL]
    if TENSOR_PARALLEL not in names:
        return MeshRanks(dp.size(), dp.get_local_rank(), dp.get_group())
    tp = mesh[TENSOR_PARALLEL]
    return MeshRanks(dp.size(), dp.get_local_rank(), dp.get_group(), tp.size(), tp.get_local_rank(), tp.get_group())


@dataclass
class DTensorSpecs:
    """The DTensor spec of every parameter that is a DTensor, and of its per-element optimizer state, recorded
    before the step takes (and releases) the originals."""
    params: dict[str, object] = field(default_factory=dict)  # fqn -> DTensorSpec
    states: dict[tuple[int, str, str], object] = field(default_factory=dict)  # (optimizer, fqn, key) -> DTensorSpec

    def record(self, binding, args, mesh) -> None:
        for fqn, p in binding.params.items():
            if isinstance(p, DTensor) and fqn not in self.params:
                if mesh is None:
                    raise CaptureError(f"parameter '{fqn}' is a DTensor (tensor parallel over {p.device_mesh}); "
                                       "zerofx needs to know which mesh dimension it shards over",
                                       hint="pass mesh= (a DeviceMesh with dimensions ('dp', 'tp')) to "
                                            "zerofx.compile")
                tp = mesh[TENSOR_PARALLEL] if TENSOR_PARALLEL in (mesh.mesh_dim_names or ()) else None
                if tp is None or p.device_mesh != tp:
                    raise CaptureError(f"parameter '{fqn}' is a DTensor over {p.device_mesh}, not over the mesh's "
                                       f"'tp' dimension ({tp}): zerofx shards over 'dp' itself",
                                       hint="apply parallelize_module over mesh['tp'] only, and no fully_shard")
                self.params[fqn] = p._spec
        for oi, opt in enumerate(binding.optimizers(args)):
            for fqn, entries in binding.optimizer_state(opt):
                for key, value in entries.items():
                    if isinstance(value, DTensor):
                        self.states.setdefault((oi, fqn, key), value._spec)

    def of(self, slot: Slot):
        """The spec of the DTensor graph input ``slot`` stands for; None for a plain tensor."""
        if slot.role in (Role.PARAM, Role.MASTER, Role.GRAD_IN, Role.GRAD_OUT):
            return self.params.get(slot.fqn)
        if slot.role in (Role.OPT_STATE, Role.NEW_STATE):
            return self.states.get((slot.optimizer, slot.fqn, slot.key))
        return None

    def split(self) -> frozenset[str]:
        """The parameters whose local tensors differ across the tp group (not replicated over it)."""
        return frozenset(fqn for fqn, spec in self.params.items() if not all(p.is_replicate() for p in spec.placements))

    def __bool__(self) -> bool:
        return bool(self.params)


def local(value):
    """A DTensor's local tensor itself (in a trace, the tensor the graph tracks); anything else as it is."""
    return value._local_tensor if isinstance(value, DTensor) else value


def rebuild(local_tensor: torch.Tensor, spec, requires_grad: bool = False) -> DTensor:
    """Inside a trace: a DTensor leaf over the graph input ``local_tensor``, so that in-place updates of the DTensor
    (the optimizer's) are recorded on the input itself."""
    return DTensor(local_tensor, spec, requires_grad=requires_grad)


def wrap(local_tensor: torch.Tensor, spec) -> DTensor:
    """A run's output as the DTensor eager would have left (a gradient, an optimizer state tensor)."""
    return DTensor.from_local(local_tensor, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


def release(tensor: torch.Tensor) -> None:
    """Free a tensor's memory in place, keeping the object (and, for a DTensor, its spec)."""
    target = local(tensor)
    target.data = torch.empty(0, dtype=target.dtype, device=target.device)
    setattr(target, _RELEASED, True)


def released(tensor: torch.Tensor) -> bool:
    """Whether `release` freed ``tensor``'s memory and nothing has filled it since."""
    target = local(tensor)
    return getattr(target, _RELEASED, False) and target.numel() == 0


_RELEASED = "_zerofx_released"  # an attribute of what `release` freed
