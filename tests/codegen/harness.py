"""Build one-instruction kernel programs around an activation input (loaded by an embedding of rows) and an
HBM output (a store), generate the kernel, run it in the interpreter and the reference VM, compare.

The builder is public (:mod:`fusegraph.codegen.testing`) so plugins test their templates the same way."""
from fusegraph.codegen.testing import Builder, V  # noqa: F401
