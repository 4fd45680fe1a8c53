"""The public API an op is written against: a built-in op folder (``fusegraph.patterns.<op>``) and a plugin's op
import this module only, never the codegen modules behind it, so those can change without breaking an op.

An op is one folder: its pattern(s) (:mod:`fusegraph.matching`), its instruction class(es) (an
:class:`Instruction` with ``emit``/``reference``), its lowering (:func:`register_lowering`, given the pattern
objects it lowers so the names it reads are checked when the module is imported), its Jinja2 templates (the
folder's ``templates/``), its host-side input conversions (callables in :class:`ArgSource`) and its test cases
(``cases.py``: :class:`OpCase` programs built with :class:`Builder`, checked against the op's torch reference,
registered with :func:`register_cases`; :mod:`fusegraph.codegen.testing`). See docs/patterns.md ("An op as one
folder").
"""
from __future__ import annotations

from . import ir
from . import weights
from .bind import weight_for_use
from .emitters import (IND, MOVING_MAX, PSUM_FREE_FP32, Context, Emitted, act_op, aten, code, expr, inst_name,
                       linear_chunks, linear_pieces, nbytes, norm_param_chunk, tiles)
from .errors import CodegenError
from .inline_source import InlineSource
from .ir import Constant, Constraints, Instruction, Value, ValueKind
from .layout import PMAX, Layout, experts_intermediate_layout, largest_divisor
from .lowering import ArgSource, Lowerer, preserves_order
from .op_helpers import (KV_INDEX, KV_NEXT, kv_positions, numel, per_token_features, position_assumption,
                         sb2sb_dma_engine, x_tokens)
from .reference import rotate_half
from .registry import add_template_dir, provide, register_codegen_options, register_instruction, register_lowering
from .render import nl_dtype
from .stream import Chunk, ChunkUse, PrefetchPoint
from .testing import (BF16_TOL, EXACT, FP32_TOL, Builder, CaseProgram, OpCase, Tol, length_mask,
                      register_cases, tol_for)

W = weights

__all__ = [
    "act_op", "add_template_dir", "ArgSource", "aten", "Chunk", "ChunkUse", "code", "CodegenError", "Constant",
    "Constraints", "Context", "Emitted", "experts_intermediate_layout", "expr", "IND", "InlineSource", "inst_name",
    "Instruction", "ir", "KV_INDEX", "KV_NEXT", "kv_positions", "largest_divisor", "Layout", "linear_chunks", "linear_pieces", "lower_on_host", "Lowerer",
    "MOVING_MAX", "nbytes", "nl_dtype", "norm_param_chunk", "numel", "per_token_features", "PMAX", "position_assumption", "PrefetchPoint",
    "preserves_order", "provide", "PSUM_FREE_FP32", "register_codegen_options", "register_instruction",
    "register_lowering", "rotate_half", "sb2sb_dma_engine", "tiles", "Value", "ValueKind", "W", "weight_for_use",
    "weights", "x_tokens",
    # an op's test cases (its cases.py; fusegraph.codegen.testing)
    "BF16_TOL", "Builder", "CaseProgram", "EXACT", "FP32_TOL", "length_mask", "OpCase", "register_cases", "Tol",
    "tol_for",
]


def lower_on_host(L: Lowerer, m: object) -> None:
    """The lowering of a host-side op (rotary tables, masks, cache positions): its match stays on the eager path
    and feeds the kernel as a per-step input. Register it with ``register_lowering(PATTERN, host_side=True)``."""
    L.host(m)
