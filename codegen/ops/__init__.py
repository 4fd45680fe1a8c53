"""The built-in ops: one module per fused op, each holding its instruction (with its layout constraints,
argument specs, constants, prologue, emitter, PyTorch reference and tensor-parallel declaration), its lowering
from pattern matches (registered with :func:`fusegraph.codegen.registry.register_lowering`, the API a plugin
uses) and, in ``templates/``, its Jinja2 NKI templates.

Every module of this package is imported (modules whose name starts with ``_`` hold shared helpers), so a new
built-in op is one module here plus its template, and nothing central.
"""
import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
