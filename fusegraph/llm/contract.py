"""Static checks of the kernel contract: one ``@nki.jit`` function, the task's arity, and real NKI compute.

The known failure mode of LLM-written kernels is a kernel that "works" without computing on the device: it
computes with torch/NumPy (refused by :mod:`.safety`), returns its input, or only copies data around. Here the
source must contain, in the kernel or a helper it calls, at least one call of an NKI *compute* function (an
``nki.isa`` instruction or ``nki.language`` operation other than allocation, data movement and loop helpers),
and may not return a parameter unless the task declares that output as written in place. The run then checks
the same thing dynamically: the interpreter's profile must show compute-engine instructions.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from .safety import Finding, import_aliases, qualname
from .task import KernelTask

NON_COMPUTE: frozenset[str] = frozenset({
    # allocation, views, loops, launch queries
    "nki.language.ndarray", "nki.language.zeros", "nki.language.ones", "nki.language.full",
    "nki.language.empty_like", "nki.language.zeros_like", "nki.language.ds", "nki.language.affine_range",
    "nki.language.sequential_range", "nki.language.static_range", "nki.language.dynamic_range",
    "nki.language.program_id", "nki.language.num_programs", "nki.language.program_ndim",
    "nki.language.device_print", "nki.language.is_hbm", "nki.language.is_on_chip", "nki.language.is_psum",
    "nki.language.is_sbuf", "nki.language.no_reorder", "nki.language.shared_identity_matrix",
    "nki.language.expand_dims", "nki.language.broadcast_to",
    # pure data movement
    "nki.language.load", "nki.language.store", "nki.language.load_transpose2d", "nki.language.copy",
    "nki.isa.dma_copy", "nki.isa.dma_transpose", "nki.isa.memset", "nki.isa.iota", "nki.isa.nc_stream_shuffle",
    "nki.isa.sendrecv", "nki.isa.core_barrier", "nki.isa.get_nc_version", "nki.isa.register_alloc",
    "nki.isa.register_load", "nki.isa.register_move", "nki.isa.register_store",
    "nki.jit", "nki.simulate",
})
"""API functions that do not compute a result (everything else in ``nki.isa``/``nki.language`` does)."""

COMPUTE_MODULES = ("nki.isa.", "nki.language.")


@dataclass(frozen=True)
class KernelInfo:
    """The kernel function found in the source."""

    name: str
    params: tuple[str, ...]
    line: int


def find_kernel(tree: ast.Module) -> tuple[KernelInfo | None, list[Finding]]:
    """The single top-level ``@nki.jit`` function, or findings saying why there is not exactly one."""
    aliases = import_aliases(tree)
    kernels = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            qualname(d.func if isinstance(d, ast.Call) else d, aliases) == "nki.jit" for d in node.decorator_list
        ):
            kernels.append(node)
    nested = [
        n for top in tree.body if isinstance(top, ast.FunctionDef) for n in ast.walk(top)
        if n is not top and isinstance(n, ast.FunctionDef) and n.decorator_list
    ]
    findings = [Finding(n.lineno, f"nested function '{n.name}' is decorated; only the top-level kernel is @nki.jit")
                for n in nested]
    if not kernels:
        return None, findings + [Finding(0, "no @nki.jit kernel function found (decorate exactly one top-level "
                                            "function with @nki.jit)")]
    if len(kernels) > 1:
        names = ", ".join(k.name for k in kernels)
        return None, findings + [Finding(kernels[1].lineno, f"{len(kernels)} @nki.jit functions ({names}); write "
                                                            f"one kernel and leave helpers undecorated")]
    k = kernels[0]
    return KernelInfo(k.name, tuple(a.arg for a in k.args.args), k.lineno), findings


def _reachable(tree: ast.Module, kernel: str) -> list[ast.FunctionDef]:
    """The kernel and the module-level helpers it calls, transitively."""
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    seen, todo = [], [kernel]
    while todo:
        name = todo.pop()
        if name in (f.name for f in seen) or name not in funcs:
            continue
        fn = funcs[name]
        seen.append(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                todo.append(node.func.id)
            elif isinstance(node, ast.Name) and node.id in funcs:  # helpers passed as values
                todo.append(node.id)
    return seen


def check_contract(tree: ast.Module, task: KernelTask) -> tuple[KernelInfo | None, list[Finding]]:
    """Kernel found, arity matches the task, NKI compute is called, parameters are not returned as outputs."""
    info, findings = find_kernel(tree)
    if info is None:
        return None, findings
    kfn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == info.name)
    a = kfn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs:
        findings.append(Finding(kfn.lineno, "the kernel takes plain positional parameters only (no *args, **kwargs, "
                                            "keyword-only or positional-only markers)"))
    if len(info.params) != len(task.inputs):
        want = ", ".join(s.name for s in task.inputs)
        findings.append(Finding(kfn.lineno, f"the kernel takes {len(info.params)} parameter(s) but the task has "
                                            f"{len(task.inputs)} input(s), in this order: {want}"))
    aliases = import_aliases(tree)
    funcs = _reachable(tree, info.name)
    computes = False
    for fn in funcs:
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                q = qualname(node.func, aliases)
                if q and q.startswith(COMPUTE_MODULES) and q not in NON_COMPUTE:
                    computes = True
    findings += _check_returns(kfn, info, task)  # the more specific diagnosis first
    if not computes and not task.data_movement_only:
        findings.append(Finding(kfn.lineno, "the kernel never calls an NKI compute instruction (nisa.tensor_tensor, "
                                            "nisa.activation, nisa.nc_matmul, ...): it must compute the result with "
                                            "NKI, not only move data or return its input", cheat=True))
    return info, findings


def _check_returns(kfn: ast.FunctionDef, info: KernelInfo, task: KernelTask) -> list[Finding]:
    findings: list[Finding] = []
    returns = [n for n in ast.walk(kfn) if isinstance(n, ast.Return)]
    if not returns or all(r.value is None for r in returns):
        return [Finding(kfn.lineno, f"the kernel returns nothing; return its {len(task.outputs)} output(s) "
                                    f"allocated with nl.ndarray(..., buffer=nl.shared_hbm)")]
    params = {p: i for i, p in enumerate(info.params)}
    for r in returns:
        if r.value is None:
            continue
        elts = list(r.value.elts) if isinstance(r.value, (ast.Tuple, ast.List)) else [r.value]
        if isinstance(r.value, (ast.Tuple, ast.List)) and len(elts) != len(task.outputs):
            findings.append(Finding(r.lineno, f"the kernel returns {len(elts)} value(s) but the task has "
                                              f"{len(task.outputs)} output(s)"))
        for pos, e in enumerate(elts):
            if not (isinstance(e, ast.Name) and e.id in params):
                continue
            out = task.outputs[pos] if pos < len(task.outputs) else None
            i = params[e.id]
            expected_alias = out is not None and out.alias_of is not None and out.alias_of == (
                task.inputs[i].name if i < len(task.inputs) else None)
            if not expected_alias:
                findings.append(Finding(r.lineno, f"the kernel returns its input '{e.id}' as an output; allocate the "
                                                  f"output with nl.ndarray(..., buffer=nl.shared_hbm) and compute it",
                                        cheat=True))
    return findings
