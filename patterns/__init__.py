"""Built-in fusion patterns (installed as ``fusegraph.patterns``), one fusion per module.

They use only the public API (:mod:`fusegraph.matching`), exactly like a third-party plugin would; importing this
package registers them. Every module of the package is imported (modules whose name starts with ``_`` hold
shared helpers), so a new built-in pattern is one new file here and nothing else. ``docs/patterns.md``
documents the contract of each (inputs, params, outputs, template).
"""
import importlib
import pkgutil

from fusegraph.matching import REGISTRY

with REGISTRY.registering_as("fusegraph"):  # built-ins whichever import reaches this package first
    for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not _info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{_info.name}")
