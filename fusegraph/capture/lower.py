"""Lower a dynamo graph (or a pattern function) to a functional ATen graph in one tracing pass.

aot_autograd gives the same graph but traces twice (once to collect aliasing and mutation metadata, once to
build the graph): for a 48-layer model that second pass costs ~4 s here. fusegraph only needs inference graphs
whose input mutations stay in the graph (as ``copy_`` into the input at the end, which the program turns into
in-place state writes), so it traces once, the way aot_autograd's second pass does: its Python functionalization
mode (mutations removed, views kept, the same op forms) under ``make_fx``, with dynamo's fake mode and each
node's source metadata (module stack, stack trace) carried over. Captured steps and patterns go through this same function, so they have the same op forms.

Tensor parallelism (``docs/tp.md``): DTensor inputs are lowered the way aot_autograd lowers traceable wrapper
subclasses (``aot_dispatch_subclass``), without its metadata pass: each DTensor becomes a placeholder for its
*local shard* (the inner tensor ``__tensor_flatten__`` names), and inside the trace the shard is wrapped again
(``__tensor_unflatten__``, the real device mesh, the same placements and global shape) before the step runs. So
make_fx records what DTensor's sharding propagation does with local tensors: local ATen ops plus the functional
collectives of its redistributions (``_c10d_functional.all_reduce`` + ``wait_tensor``...), with the collective's
process group as a constant. DTensor outputs are unwrapped to their local shard the same way and wrapped again
after each call (:class:`LocalShards`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._dispatch.python import enable_python_dispatcher
from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.fx.experimental.proxy_tensor import make_fx

from .checks import CaptureRefused


def _functional(fn: Callable[..., Any], shards: dict[int, "ShardSlot"] | None = None,
                out_shards: dict[int, "ShardSlot"] | None = None) -> Callable[..., Any]:
    """``fn`` run on functional wrappers; data mutations of inputs are written back with ``copy_`` at the end
    (what aot_autograd does with ``keep_inference_input_mutations``). Inputs in ``shards`` are local shards:
    ``fn`` gets them as DTensors again; DTensor outputs are returned as their local shard and described in
    ``out_shards`` (by output position)."""
    shards = shards or {}

    def run(*args: Any) -> Any:
        # like aot_autograd: wrapping inputs must not itself be traced (Functionalize TLS off above this mode)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            f_args = [to_fun(a) for a in args]
            # functionalization runs last (below the subclass), as in aot_autograd: DTensor(FunctionalTensor)
            outs = fn(*[shards[i].wrap(f) if i in shards else f for i, f in enumerate(f_args)])
            if out_shards is not None:
                outs = _local_outputs(outs, out_shards)
            for before, f_arg in zip(args, f_args):
                if not isinstance(f_arg, FunctionalTensor):
                    continue
                torch._sync(f_arg)
                if torch._functionalize_has_metadata_mutation(f_arg.elem):
                    raise NotImplementedError("the step changes the shape or strides of an input in place")
                if torch._functionalize_has_data_mutation(f_arg.elem):
                    with fx_traceback.preserve_node_meta(), torch.no_grad():
                        before.copy_(from_fun(f_arg))
            return pytree.tree_map(from_fun, outs)

    return run


# ---- tensor parallelism: DTensors lowered over their local shards -------------------------------------------
def _dtensor_type() -> type | None:
    """DTensor if torch.distributed's tensor package is loaded (nothing can be one otherwise)."""
    import sys

    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls if isinstance(cls, type) else None


@dataclass(frozen=True)
class ShardSlot:
    """A DTensor at one graph input or output position: the graph carries its local shard; this rebuilds the
    DTensor around a local tensor (``__tensor_unflatten__`` with the same mesh, placements and global shape)."""

    position: int
    cls: type
    attr: str  # the inner tensor's attribute ("_local_tensor")
    others: dict  # the other inner attributes (the device mesh, an opaque object)
    ctx: Any  # the __tensor_flatten__ context (placements, tensor meta, shard order, requires_grad)
    size: tuple
    stride: tuple
    local_shape: tuple
    placements: tuple

    @classmethod
    def of(cls, position: int, t: torch.Tensor) -> "ShardSlot":
        attrs, ctx = t.__tensor_flatten__()
        tensors = [a for a in attrs if isinstance(getattr(t, a), torch.Tensor)]
        if len(tensors) != 1 or is_traceable_wrapper_subclass(getattr(t, tensors[0])):
            inner = ", ".join(type(getattr(t, a)).__name__ for a in tensors)
            raise CaptureRefused(f"tensor subclass inputs are not lowered yet (input {position} is a "
                                 f"{type(t).__name__} of {inner})")
        others = {a: getattr(t, a) for a in attrs if a not in tensors}
        local = getattr(t, tensors[0])
        return cls(position, type(t), tensors[0], others, ctx, tuple(t.size()), tuple(t.stride()),
                   tuple(int(s) for s in local.shape), tuple(getattr(t, "placements", ())))

    @property
    def sharding(self) -> Any:
        """The :class:`~fusegraph.program.distributed.Sharding` (mesh, placements, global and local shape); read it
        outside tracing (describing the mesh runs tensor ops)."""
        from ..program.distributed import make_sharding

        return make_sharding(self.placements, self.others.get("device_mesh"), self.size, self.local_shape)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return getattr(t, self.attr)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        return self.cls.__tensor_unflatten__({self.attr: local, **self.others}, self.ctx, self.size, self.stride)


@dataclass
class LocalShards:
    """The calling convention of a graph lowered over local shards: which inputs the caller passes as DTensors
    (the graph takes their local shard) and which outputs the caller gets back as DTensors."""

    inputs: dict[int, ShardSlot] = field(default_factory=dict)
    outputs: dict[int, ShardSlot] = field(default_factory=dict)

    def unwrap_inputs(self, args: Sequence[Any]) -> list:
        out = list(args)
        for i, slot in self.inputs.items():
            out[i] = slot.local(out[i])
        return out

    def wrap_outputs(self, outs: Sequence[Any]) -> list:
        out = list(outs)
        for i, slot in self.outputs.items():
            out[i] = slot.wrap(out[i])
        return out


def _local_outputs(outs: Any, slots: dict[int, ShardSlot]) -> Any:
    """DTensor outputs of the traced step replaced by their local shard (recorded in ``slots``)."""
    cls = _dtensor_type()
    if cls is None:
        return outs
    flat = outs if isinstance(outs, (list, tuple)) else [outs]
    if not any(isinstance(o, cls) for o in flat):
        return outs
    new = []
    for i, o in enumerate(flat):
        if isinstance(o, cls):
            slots[i] = ShardSlot.of(i, o)
            o = slots[i].local(o)
        new.append(o)
    return type(outs)(new) if isinstance(outs, (list, tuple)) else new[0]


def local_shards(gm: fx.GraphModule) -> LocalShards | None:
    """The local-shard calling convention of a graph :func:`to_aten` lowered, if it had DTensor inputs/outputs."""
    return gm.meta.get("fusegraph_local_shards")


def on_local_shards(gm: fx.GraphModule, runner: Callable[[Sequence[Any]], list]) -> Callable[[Sequence[Any]], list]:
    """``runner`` (which computes ``gm`` over local shards) called the way dynamo calls the graph: DTensor
    arguments are unwrapped to their local shard, DTensor outputs wrapped again. Other graphs: ``runner`` itself."""
    shards = local_shards(gm)
    if shards is None:
        return runner

    def run(args: Sequence[Any]) -> list:
        return shards.wrap_outputs(runner(shards.unwrap_inputs(args)))

    return run


def _shard_slots(args: Sequence[Any]) -> dict[int, ShardSlot]:
    """DTensor inputs, lowered over their local shard; other wrapper tensor subclasses (quantized or two-part
    tensors) are refused: one ``make_fx`` pass would trace *through* their ``__torch_dispatch__`` and bake their
    inner tensors into the graph as (fake) constants, and what their inner tensors mean is not modelled here."""
    dtensor = _dtensor_type()
    slots: dict[int, ShardSlot] = {}
    for i, a in enumerate(args):
        if dtensor is not None and isinstance(a, dtensor):
            slots[i] = ShardSlot.of(i, a)
        elif is_traceable_wrapper_subclass(a):
            raise CaptureRefused(f"tensor subclass inputs are not lowered yet (input {i} is a {type(a).__name__})")
    return slots


def to_aten(fn: Callable[..., Any] | fx.GraphModule, args: Sequence[Any],
            fake_mode: FakeTensorMode | None = None) -> fx.GraphModule:
    """The functional ATen graph of ``fn(*args)`` (inference: no autograd), traced on fake tensors.

    DTensor arguments are traced over their local shard (see the module docstring); the graph's
    :func:`local_shards` then says how to call it."""
    shards = _shard_slots(args)
    if fake_mode is None:
        fake_mode = torch._guards.detect_fake_mode(args) or FakeTensorMode()
    args = [shards[i].local(a) if i in shards else a for i, a in enumerate(args)]
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
                 for a in args]
    if isinstance(fn, fx.GraphModule):
        gm = fn

        def fn(*a: Any) -> Any:  # an Interpreter sets each node's metadata as current while it runs
            return fx.Interpreter(gm).run(*a)

    with fx_traceback.preserve_node_meta(), fake_mode, torch.no_grad(), enable_python_dispatcher(), \
            FunctionalTensorMode(_allow_token_discovery=True):
        out_shards: dict[int, ShardSlot] = {}
        gm = make_fx(_functional(fn, shards, out_shards), record_module_stack=True)(*fake_args)
    gm.graph.eliminate_dead_code()  # in-place writes (copy_) are impure and stay
    gm.recompile()
    if shards or out_shards:
        gm.meta["fusegraph_local_shards"] = LocalShards(shards, out_shards)
    return gm
