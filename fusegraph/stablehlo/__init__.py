"""fusegraph's StableHLO importer: StableHLO (from JAX, a serialized export, or torch-xla) -> the ATen graph
the rest of fusegraph works on. Needs the MLIR bindings of jaxlib (the ``fusegraph[jax]`` extra).

``import_stablehlo(text_or_bytes_or_module, arg_kinds=[...])`` returns an :class:`ImportedGraph`; an op it
cannot translate raises :class:`UnsupportedOp` naming it. See docs/jax.md for what maps to what.
"""
from .importer import ImportedGraph, ImportedInput, ImportedOutput, import_stablehlo, unsupported_ops
from .ir import Module, UnsupportedOp
from .parse import parse_module

__all__ = ["ImportedGraph", "ImportedInput", "ImportedOutput", "Module", "UnsupportedOp", "import_stablehlo",
           "parse_module", "unsupported_ops"]
