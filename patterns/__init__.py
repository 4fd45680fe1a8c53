"""The built-in ops (installed as ``fusegraph.patterns``), one folder per op: its pattern(s), instruction(s),
lowering, templates and torch reference, on the same public API a plugin uses (:mod:`fusegraph.matching`,
:mod:`fusegraph.codegen.api`). Importing this package registers them all (as ``source="fusegraph"``). Every
sub-package and module is imported (names starting with ``_`` hold shared helpers), so a new built-in op is one
new folder here and nothing central. ``docs/patterns.md`` documents the contract of each.
"""
import importlib
import pkgutil

from fusegraph.matching import REGISTRY

with REGISTRY.registering_as("fusegraph"):  # built-ins whichever import reaches this package first
    for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not _info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{_info.name}")
