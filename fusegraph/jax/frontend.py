"""``fusegraph.jax.jit``: a JAX decode step through fusegraph's pipeline.

``jax.jit(f).lower(*args)`` gives StableHLO; :mod:`fusegraph.stablehlo` imports it as an ATen graph with the
torch path's op forms; the graph joins a capture session's program like a dynamo graph would, and the same
executor runs it (canonicalize, match, regions, one megakernel in the NKI interpreter, verified on its first
call against its region's ATen ops). On top of that the whole step's first call is checked against JAX's own
result. Whatever fails (an op the importer does not translate, a build error, a mismatch) ends in one warning
and the original JAX function, so a step never fails or returns a wrong result because of fusegraph.
"""
from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ..capture.session import CaptureSession
from ..executors.base import RETIRE_AFTER_FAILURES
from ..pipeline import compile_program, resolve_executor_name
from ..program import InputKind
from ..program.build import add_graph
from ..program.sources import layer_index
from ..report import Report, report_for_session
from ..settings import Settings
from ..stablehlo import UnsupportedOp, import_stablehlo
from ..stablehlo.ir import module_path
from ..warnings import one_line, warn
from .convert import to_jax, to_torch

log = logging.getLogger(__name__)

_KINDS = {"weight": InputKind.WEIGHT, "buffer": InputKind.BUFFER, "state": InputKind.STATE, "step": InputKind.STEP}


def _path_name(root: str, path: Sequence[Any]) -> tuple[str, str]:
    """(``params['layers'][0]['wq']``, module path ``layers.0.wq``) of a pytree leaf."""
    import jax

    key = jax.tree_util.keystr(tuple(path))
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return root + key, ".".join(parts)


@dataclass
class Compiled:
    """One specialization of the step (argument structure, shapes and dtypes, static arguments)."""

    session: CaptureSession
    index: int
    imported: Any
    runner: Callable | None
    out_tree: Any
    leaf_names: list[str]
    verified: bool = False
    fallback: Callable | None = None  # the JAX function, when fusegraph gave up on this specialization
    reason: str = ""
    weights: dict[int, tuple[int, Any, torch.Tensor]] = field(default_factory=dict)
    failures: int = 0  # calls in a row on which the fused step failed (each ran the JAX function instead)

    @property
    def program(self):
        return self.session.program

    def report(self) -> Report:
        """The fused-region report of this specialization (as for torch: coverage, regions, launches)."""
        return report_for_session(self.session)

    @property
    def launches_per_step(self) -> int | None:
        record = self.session.program.execution.get(self.index)
        return record.launches_per_call if record is not None else None


class FusedFunction:
    """What :func:`jit` returns: call it like the ``jax.jit`` function."""

    def __init__(self, fn: Callable, *, options: Mapping[str, Any] | None = None,
                 donate_argnums: int | Sequence[int] = (), static_argnums: int | Sequence[int] = (),
                 params_argnums: int | Sequence[int] = (0,)) -> None:
        self.fn = fn
        self.options = dict(options or {})
        self.settings = Settings.from_options(self.options)
        self.donate = _ints(donate_argnums)
        self.static = _ints(static_argnums)
        self.params = _ints(params_argnums)
        self._compiled: dict[Any, Compiled] = {}
        self.last: Compiled | None = None
        self.name = getattr(fn, "__name__", "step")
        try:
            self._argnames = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self._argnames = []

    # ---- the jax.jit functions this one stands in for ---------------------------------------------------------
    def _jax_jit(self, donate: bool) -> Callable:
        import jax

        return jax.jit(self.fn, static_argnums=self.static, donate_argnums=self.donate if donate else (),
                       keep_unused=True)

    def __call__(self, *args: Any) -> Any:
        c = self.compile(*args)
        if c.fallback is not None:
            return c.fallback(*args)
        try:
            out = self._run(c, args)
        except Exception as e:  # noqa: BLE001 - a failing call falls back to JAX for that call
            if self.settings.pass_through_build_failures:
                raise
            log.debug("fused step failure", exc_info=True)
            return self._failed_call(c, args, e)
        c.failures = 0
        return out

    def _failed_call(self, c: Compiled, args: Sequence[Any], e: Exception) -> Any:
        """This call runs the JAX function (JAX arrays are immutable: a failed fused call changed nothing). One
        malformed input costs that call only; a step failing on RETIRE_AFTER_FAILURES calls in a row runs the JAX
        function from then on."""
        c.failures += 1
        jitted = self._jax_jit(donate=True)
        if c.failures >= RETIRE_AFTER_FAILURES:
            warn(f"{self.name}: the fused step failed on {c.failures} calls in a row ({one_line(e)}); running the "
                 "JAX function from now on")
            c.fallback, c.reason = jitted, one_line(e)
        else:
            warn(f"{self.name}: the fused step failed ({one_line(e)}); this call runs the JAX function")
        return jitted(*args)

    # ---- compile --------------------------------------------------------------------------------------------
    def _key(self, args: Sequence[Any]) -> Any:
        import jax

        dyn = [a for i, a in enumerate(args) if i not in self.static]
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        sig = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)
        static = tuple(repr(args[i]) for i in sorted(self.static) if i < len(args))
        return tree, sig, static

    def compile(self, *args: Any) -> Compiled:
        """Lower, import and build the fused step for these arguments (cached per specialization)."""
        key = self._key(args)
        c = self._compiled.get(key)
        if c is None:
            c = self._build(args)
            self._compiled[key] = c
        self.last = c
        return c

    def _leaves(self, args: Sequence[Any]) -> tuple[list, list[str], list[str], list[str]]:
        import jax

        leaves, kinds, names, modules = [], [], [], []
        for i, a in enumerate(args):
            if i in self.static:
                continue
            root = self._argnames[i] if i < len(self._argnames) else f"arg{i}"
            kind = "weight" if i in self.params else "state" if i in self.donate else "step"
            for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
                name, module = _path_name(root, path)
                leaves.append(leaf)
                kinds.append(kind)
                names.append(name)
                modules.append(module_path(module) if kind == "weight" else
                               module_path(f"{root}.{module}") if module else root)
        return leaves, kinds, names, modules

    def _build(self, args: Sequence[Any]) -> Compiled:
        t0 = time.perf_counter()
        session = CaptureSession(settings=self.settings, name=f"jax:{self.name}")
        index = session.reserve_index()
        leaves, kinds, names, modules = self._leaves(args)
        c = Compiled(session=session, index=index, imported=None, runner=None, out_tree=None, leaf_names=names)
        try:
            lowered = self._jax_jit(donate=True).lower(*args)
            c.out_tree = lowered.out_tree
            text = lowered.as_text(debug_info=True)
            imported = import_stablehlo(text, arg_kinds=kinds, arg_names=names)
            c.imported = imported
            captured = add_graph(session.program, imported.gm, index, None, imported.stablehlo_ops)
            _classify(session, captured, imported, modules)
            c.runner = compile_program(session, index, self.settings)
            session.executors[index] = _executor_name(self.settings)
        except UnsupportedOp as e:
            if self.settings.pass_through_build_failures:
                raise
            warn(f"{self.name}: StableHLO op {e.op} is not supported"
                 + (f" ({e.detail})" if e.detail else "") + "; running the JAX function as is")
            c.fallback, c.reason = self._jax_jit(donate=True), f"unsupported op {e.op}"
        except Exception as e:  # noqa: BLE001 - a step that cannot be built runs as JAX
            if self.settings.pass_through_build_failures:
                raise
            warn(f"{self.name}: fusegraph could not build the step ({one_line(e)}); running the JAX function as is")
            log.debug("jax frontend build failure", exc_info=True)
            c.fallback, c.reason = self._jax_jit(donate=True), one_line(e)
        session.compile_seconds += time.perf_counter() - t0
        return c

    # ---- run ------------------------------------------------------------------------------------------------
    def _inputs(self, c: Compiled, leaves: list) -> list[torch.Tensor]:
        out = []
        whole: dict[int, torch.Tensor] = {}  # a split state argument, converted once for all its parts
        for pos, spec in enumerate(c.imported.inputs):
            if spec.experts:  # keras-hub's expert weights in HF's layout, converted once per array
                from ..stablehlo.importer import experts_weight

                srcs = [leaves[spec.arg]] + ([leaves[spec.experts[1]]] if spec.experts[0] == "gate_up" else [])
                cached = c.weights.get(pos)
                if cached is None or cached[0] != tuple(id(x) for x in srcs):
                    cached = (tuple(id(x) for x in srcs), srcs, experts_weight(
                        spec, *[to_torch(x, spec.dtype) for x in srcs]))
                    c.weights[pos] = cached
                out.append(cached[2])
                continue
            if spec.part is not None:
                if spec.arg not in whole:
                    whole[spec.arg] = to_torch(leaves[spec.arg], spec.dtype)
                out.append(spec.take(whole[spec.arg]))
                continue
            if spec.arg is None:
                out.append(spec.value)
                continue
            x = leaves[spec.arg]
            if spec.kind == "weight":
                cached = c.weights.get(pos)
                if cached is None or cached[0] != id(x):
                    # keep the array alive with its tensor: its id must not be reused while cached
                    cached = (id(x), x, to_torch(x, spec.dtype, transpose=spec.transpose,
                                                 contract=spec.contract))
                    c.weights[pos] = cached
                out.append(cached[2])
            else:
                out.append(to_torch(x, spec.dtype, copy=spec.kind == "state"))
        return out

    def _run(self, c: Compiled, args: Sequence[Any]) -> Any:
        import jax

        leaves, *_ = self._leaves(args)
        expected = None
        if not c.verified and self.settings.verify:
            expected = self._jax_jit(donate=False)(*args)  # before ours: nothing donated is touched by JAX
        with torch.no_grad():
            outs = c.runner(self._inputs(c, leaves))
        results = [to_jax(t, o.dtype) for t, o in zip(c.imported.results(outs), c.imported.outputs)]
        if expected is not None:
            problems = _compare(results, jax.tree_util.tree_leaves(expected), c.imported.outputs, self.settings)
            c.verified = True
            if problems:
                warn(f"{self.name}: the fused step differs from jax.jit ({problems[0]}); running the JAX function "
                     "from now on")
                c.fallback, c.reason = self._jax_jit(donate=True), problems[0]
                return expected
        return jax.tree_util.tree_unflatten(c.out_tree, results)

    def report(self):
        """The fused-region report of the most recent specialization."""
        if self.last is None:
            raise RuntimeError("call the function (or .compile(*args)) first")
        return self.last.report()


def _executor_name(settings: Settings) -> str:
    return resolve_executor_name(settings)


def _classify(session: CaptureSession, captured: Any, imported: Any, modules: list[str]) -> None:
    """Input classes from the JAX side (parameters, donated state, per-step arguments, constants), the way
    dynamo's sources classify them on the torch path; the program's own state analysis has the last word."""
    G = session.program.graph
    for pin, spec in zip(captured.inputs, imported.inputs):
        module = modules[spec.arg] if spec.arg is not None else None
        pin.source = spec.name
        pin.module = module
        if pin.kind != InputKind.STATE:
            pin.kind = _KINDS[spec.kind] if spec.kind != "state" else InputKind.STEP
        d = G.nodes[pin.node]
        d.update(input_kind=pin.kind, source=spec.name, module=module, layer=layer_index(module))


def _compare(got: list, expected: list, outputs: list, settings: Settings) -> list[str]:
    import numpy as np

    problems = []
    if len(got) != len(expected):
        return [f"{len(got)} results, JAX has {len(expected)}"]
    for k, (g, e, o) in enumerate(zip(got, expected, outputs)):
        a = np.asarray(g, dtype=np.float64) if o.dtype != "i1" else np.asarray(g)
        b = np.asarray(e, dtype=np.float64) if o.dtype != "i1" else np.asarray(e)
        if a.shape != b.shape:
            problems.append(f"result {k}: shape {a.shape}, JAX has {b.shape}")
            continue
        if o.dtype.startswith(("i", "ui")):
            if not np.array_equal(a, b):
                problems.append(f"result {k}: {int((a != b).sum())} elements differ")
            continue
        if not np.isfinite(a).all() and np.isfinite(b).all():
            problems.append(f"result {k}: non-finite values")
            continue
        tol = settings.verify_tolerance if o.dtype in ("f32", "f64") else max(settings.verify_tolerance, 2e-2)
        scale = max(float(np.abs(b[np.isfinite(b)]).max()) if np.isfinite(b).any() else 0.0, 1e-6)
        finite = np.isfinite(b)
        err = float(np.abs(a[finite] - b[finite]).max()) if finite.any() else 0.0
        if err > tol * scale:
            problems.append(f"result {k}: max |diff| {err:.3g} > {tol:g} x {scale:.3g}")
    return problems


def _ints(v: int | Sequence[int]) -> tuple[int, ...]:
    return (v,) if isinstance(v, int) else tuple(v)


def jit(fn: Callable, *, options: Mapping[str, Any] | None = None, donate_argnums: int | Sequence[int] = (),
        static_argnums: int | Sequence[int] = (), params_argnums: int | Sequence[int] = (0,)) -> FusedFunction:
    """A drop-in for ``jax.jit(fn, donate_argnums=..., static_argnums=...)`` that runs ``fn`` through fusegraph.

    ``options`` are the torch backend's options (``executor``, ``verify``, ``report``...). Arguments in
    ``params_argnums`` (default: the first) are the model's weights; donated arguments whose buffers a result
    reuses (the KV cache) are state, written in place; every other argument is a per-step input.
    """
    return FusedFunction(fn, options=options, donate_argnums=donate_argnums, static_argnums=static_argnums,
                         params_argnums=params_argnums)
