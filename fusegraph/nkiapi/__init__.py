"""The official NKI API surface (tables for NKI 0.3.0 / 0.6.0) and a static conformance checker.

``tables``: :func:`load_table` gives typed access to the bundled API tables.
``conformance``: :func:`check_source` / :func:`assert_conforms` check kernel source against them.
"""

from .conformance import ConformanceError, Violation, assert_conforms, check_source
from .tables import MODULES, SUPPORTED_VERSIONS, ApiTable, ClassInfo, FunctionSig, Param, load_table

__all__ = [
    "ApiTable",
    "ClassInfo",
    "ConformanceError",
    "FunctionSig",
    "MODULES",
    "Param",
    "SUPPORTED_VERSIONS",
    "Violation",
    "assert_conforms",
    "check_source",
    "load_table",
]
