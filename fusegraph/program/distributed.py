"""What a tensor-parallel program knows about its distribution: sharded inputs and the collectives it runs.

A tensor-parallel step (HF ``tp_plan="auto"``, ``parallelize_module``) is captured as the ATen graph of *one rank*:
its inputs are that rank's local shards and its communication is torch's functional collectives
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` ... each followed by a
``wait_tensor``). Codegen, reports and the executors need the global picture back, so the program records it as
plain data on the nodes:

* an input that was a DTensor carries a :class:`Sharding` (``sharding`` node attribute): its mesh, placements,
  global and local shape. The value the executors see is the local shard (``DTensor.__tensor_flatten__``'s inner
  tensor), exactly what the ATen graph computes on;
* a collective op carries a :class:`Collective` (``collective`` node attribute): which collective, its reduce
  op, its process group (name, global ranks, size) and the values it communicates; its ``wait_tensor`` carries
  ``collective_wait`` (the id of the collective it completes).

Nothing here imports ``torch.distributed`` unless a distributed object is actually being described, so an
undistributed capture does not pay for it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: op namespaces of torch's functional collectives (DTensor redistributions, funcol, dynamo's rewrite of
#: in-place ``dist.all_reduce``)
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})
#: the op that completes an asynchronous functional collective (it is not itself communication)
WAIT_OPS = frozenset({"wait_tensor"})


@dataclass(frozen=True)
class GroupInfo:
    """A process group as a collective names it: torch's group name plus, when this process knows the group,
    its global ranks (in group-rank order) and size."""

    name: str
    ranks: tuple[int, ...] | None = None
    size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": list(self.ranks) if self.ranks is not None else None, "size": self.size}


@dataclass(frozen=True)
class MeshInfo:
    """A ``DeviceMesh``: its shape, dim names, global ranks (row-major) and the process group of each dim."""

    device_type: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None
    groups: tuple[str, ...] = ()  # group name of each mesh dim

    def to_dict(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "shape": list(self.shape), "ranks": list(self.ranks),
                "dim_names": list(self.dim_names) if self.dim_names else None, "groups": list(self.groups)}


@dataclass(frozen=True)
class Sharding:
    """How a graph input that was a DTensor is distributed; the program holds its ``local_shape`` part."""

    mesh: MeshInfo
    placements: tuple[str, ...]  # repr of each placement, one per mesh dim: "Shard(dim=0)", "Replicate()"...
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    shard_dims: tuple[int | None, ...] = ()  # per mesh dim: the tensor dim it shards (None: not a Shard)

    def describe(self) -> str:
        """``Shard(dim=0) over 2 ranks, global (1000, 256)`` (for messages and reports)."""
        n = 1
        for s in self.mesh.shape:
            n *= s
        return f"{', '.join(self.placements)} over {n} rank{'s' if n != 1 else ''}, global {self.global_shape}"

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": self.mesh.to_dict(), "placements": list(self.placements),
                "global_shape": list(self.global_shape), "local_shape": list(self.local_shape),
                "shard_dims": list(self.shard_dims)}


@dataclass(frozen=True)
class Collective:
    """One functional collective of the program (the op that starts the communication)."""

    op: str  # short name: "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"...
    group: GroupInfo
    inputs: tuple[str, ...]  # program node ids of the tensors it communicates
    reduce_op: str | None = None  # "sum", "avg", "max"... for reductions
    group_size: int | None = None  # as the op states it (all_gather / reduce_scatter carry it)
    extra: dict[str, Any] = field(default_factory=dict)  # other constant arguments by schema name (src, splits)
    wait: str | None = None  # the wait_tensor node that completes it (None: waited elsewhere or never)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "reduce_op": self.reduce_op, "group": self.group.to_dict(),
                "group_size": self.group_size, "inputs": list(self.inputs), "wait": self.wait,
                "extra": {k: v for k, v in self.extra.items()}}


# ---- recognizing collectives -----------------------------------------------------------------------------
def _namespace(target: Any) -> str | None:
    ns = getattr(target, "namespace", None)  # OpOverload
    if ns is None:
        ns = getattr(target, "_qualified_op_name", "").partition("::")[0] or None  # OpOverloadPacket
    return ns


def _op_short_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", target)
    return getattr(packet, "__name__", None) or str(target).split(".")[1]


def is_functional_collective(target: Any) -> bool:
    """A functional collective op (communication), not its ``wait_tensor``."""
    return _namespace(target) in COLLECTIVE_NAMESPACES and _op_short_name(target) not in WAIT_OPS


def is_wait(target: Any) -> bool:
    return _namespace(target) in COLLECTIVE_NAMESPACES and _op_short_name(target) in WAIT_OPS


def collective_arguments(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name (``input``, ``reduce_op``, ``group_size``, ``group_name``...)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return {}
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
    return out


# ---- describing distributed objects ----------------------------------------------------------------------
def resolve_group(name: str) -> GroupInfo:
    """The ranks and size of the process group torch knows by ``name`` in this process; name only if it is not
    known (a graph traced without the group, e.g. a pattern)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(name)
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        return GroupInfo(name=name, ranks=ranks, size=int(pg.size()))
    except Exception as e:  # noqa: BLE001 - an unknown group is described by its name only
        log.debug("process group %r not resolvable here: %s", name, e)
        return GroupInfo(name=name)


def group_known(name: str) -> bool:
    return resolve_group(name).size is not None


def mesh_info(mesh: Any) -> MeshInfo:
    """Plain data of a ``DeviceMesh``."""
    import torch

    ranks = tuple(int(r) for r in torch.as_tensor(mesh.mesh).reshape(-1).tolist())
    groups: list[str] = []
    for d in range(mesh.ndim):
        try:
            groups.append(mesh.get_group(d).group_name)
        except Exception:  # noqa: BLE001 - a mesh dim without a group in this process (other ranks' submesh)
            groups.append("")
    return MeshInfo(device_type=str(mesh.device_type), shape=tuple(int(s) for s in mesh.shape), ranks=ranks,
                    dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None, groups=tuple(groups))


def sharding_of(dtensor: Any) -> Sharding:
    """The :class:`Sharding` of a DTensor (real or fake: only metadata is read)."""
    local = dtensor.__tensor_flatten__()[0][0]  # the inner tensor's attribute name ("_local_tensor")
    return make_sharding(dtensor.placements, dtensor.device_mesh, tuple(dtensor.shape),
                         tuple(getattr(dtensor, local).shape))


def make_sharding(placements: Any, mesh: Any, global_shape: tuple, local_shape: tuple) -> Sharding:
    """A :class:`Sharding` from a DTensor's parts (call it outside tracing: reading a mesh runs tensor ops)."""
    placements = tuple(placements)
    return Sharding(
        mesh=mesh_info(mesh), placements=tuple(repr(p) for p in placements),
        global_shape=tuple(int(s) for s in global_shape), local_shape=tuple(int(s) for s in local_shape),
        shard_dims=tuple(getattr(p, "dim", None) if p.is_shard() else None for p in placements),
    )


def describe_distributed(v: Any) -> str:
    """``DTensor (Shard(dim=0) over 2 ranks)`` / ``DeviceMesh (2 ranks)``: a distributed object, for messages."""
    placements = getattr(v, "placements", None)
    mesh = getattr(v, "device_mesh", v)
    try:
        size = mesh.size()
        ranks = f" over {size} rank{'s' if size != 1 else ''}"
    except Exception:  # noqa: BLE001 - a mesh without a size: name the type only
        ranks = ""
    where = f"{', '.join(map(repr, placements))}{ranks}" if placements else ranks.strip()
    return f"{type(v).__name__} ({where})" if where else type(v).__name__
