"""Lower a dynamo graph (or a pattern function) to a functional ATen graph in one tracing pass.

aot_autograd gives the same graph but traces twice (once to collect aliasing and mutation metadata, once to
build the graph): for a 48-layer model that second pass costs ~4 s here. fusegraph only needs inference graphs
whose input mutations stay in the graph (as ``copy_`` into the input at the end, which the program turns into
in-place state writes), so it traces once, the way aot_autograd's second pass does: its Python functionalization
mode (mutations removed, views kept, the same op forms) under ``make_fx``, with dynamo's fake mode and each
node's source metadata (module stack, stack trace) carried over. Captured steps and patterns go through this same function, so they have the same op forms.
"""
from __future__ import annotations

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


def _functional(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on functional wrappers; data mutations of inputs are written back with ``copy_`` at the end
    (what aot_autograd does with ``keep_inference_input_mutations``)."""

    def run(*args: Any) -> Any:
        # like aot_autograd: wrapping inputs must not itself be traced (Functionalize TLS off above this mode)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            f_args = [to_fun(a) for a in args]
            outs = fn(*f_args)
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


def _refuse_tensor_subclasses(args: Sequence[Any]) -> None:
    """Wrapper tensor subclasses (DTensor, quantized or two-part tensors) cannot be lowered by one ``make_fx``
    pass: it traces *through* their ``__torch_dispatch__``, so their inner tensors are baked into the graph as
    (fake) constants, not inputs. aot_autograd desugars them first; this pass does not, so it refuses them
    instead of building a program that cannot run."""
    for i, a in enumerate(args):
        if is_traceable_wrapper_subclass(a):
            raise CaptureRefused(f"tensor subclass inputs are not lowered yet (input {i} is a {type(a).__name__})")


def to_aten(fn: Callable[..., Any] | fx.GraphModule, args: Sequence[Any],
            fake_mode: FakeTensorMode | None = None) -> fx.GraphModule:
    """The functional ATen graph of ``fn(*args)`` (inference: no autograd), traced on fake tensors."""
    _refuse_tensor_subclasses(args)
    if fake_mode is None:
        fake_mode = torch._guards.detect_fake_mode(args) or FakeTensorMode()
    fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
                 for a in args]
    if isinstance(fn, fx.GraphModule):
        gm = fn

        def fn(*a: Any) -> Any:  # an Interpreter sets each node's metadata as current while it runs
            return fx.Interpreter(gm).run(*a)

    with fx_traceback.preserve_node_meta(), fake_mode, torch.no_grad(), enable_python_dispatcher(), \
            FunctionalTensorMode(_allow_token_discovery=True):
        gm = make_fx(_functional(fn), record_module_stack=True)(*fake_args)
    gm.graph.eliminate_dead_code()  # in-place writes (copy_) are impure and stay
    gm.recompile()
    return gm
