"""The tensor path of generic lowering: any ATen op of a decoder step, on values of any shape, inside the kernel.

Patterns are the fast path (the hidden state stays in SBUF in the layout each op wants); what no pattern covers and
the SBUF elementwise path (:mod:`..elementwise`) cannot take runs here: values are strided views of HBM buffers
(:mod:`.view`), each op walks its iteration space in SBUF tiles (:mod:`.tiles`) and is one
:class:`~.instruction.TensorOp` (emitters by kind: :mod:`.pointwise`, :mod:`.reduce`, :mod:`.matmul`, :mod:`.move`;
runtime indices :mod:`.index`, top-k and sort :mod:`.select`, scans :mod:`.scan`, HF's grouped-MoE ops
:mod:`.grouped`),
lowered piece by piece (:mod:`.lower`). Which ops it takes is matching's table
(:mod:`fusegraph.matching.tensor_ops`), checked against :data:`~.instruction.EMITTERS` by a test.
"""
from . import conv, grouped, index, matmul, move, pointwise, reduce, scan, select  # noqa: F401  (emitter registration)
from .instruction import EMITTERS, TensorOp
from .lower import TensorLowering, kernel_view, lower_tensor_piece, store_tensor_output, tensor_piece_refusal
from .view import TRef
from ..registry import provide

provide("tensor output", store_tensor_output)
provide("tensor view", kernel_view)

__all__ = ["EMITTERS", "TRef", "TensorLowering", "TensorOp", "lower_tensor_piece", "tensor_piece_refusal"]
