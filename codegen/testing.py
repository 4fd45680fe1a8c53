"""Testing an op: small kernel programs around its instruction(s), run in the interpreter and in the reference VM,
and the op's declared test cases (what every op folder keeps beside its lowering, next to its torch reference).

**Builder.** A kernel program around one or a few instructions: activation inputs (loads), HBM arguments, and
stores of the results; :meth:`Builder.run` generates it (checked against the NKI 0.3.0 and 0.6.0 API tables), runs
it in the interpreter and in the reference VM (each instruction's ``reference``)::

    b = Builder(tokens=3)
    x = b.act("x", torch.randn(3, 384))
    y = b.new("y", 384, torch.float32)
    b.ins.append(MyNorm(x=x, weight=b.hbm("w", w), out=y, eps=1e-6, layer=0))
    b.store(y)
    gen, results, reference_env, _ = b.run()
    torch.testing.assert_close(results["out_y"], reference_env["y"])

**Declared cases.** The reference VM runs the instructions' own ``reference`` methods, written next to their
templates by the same hand: a kernel and a reference that share a misreading of the model agree with each other.
So an op also declares *cases* (:class:`OpCase`, registered with :func:`register_cases` from the op folder's
``cases.py``): each builds a kernel program around the op's instruction(s) with concrete shapes and dtypes
(:class:`CaseProgram`) and names the op's *eager* reference, plain PyTorch on the logical tensors (the op's own torch
reference: its pattern function, what the model computes), with a tolerance. :func:`check_case` runs one: the
generated kernel in the interpreter and the program in the reference VM, each compared with eager.
``tests/codegen/test_op_cases.py`` runs every declared case of every op (:func:`load_cases` finds them); a plugin's
op folder declares its cases the same way::

    # mypkg/l2norm/cases.py
    from fusegraph.codegen.api import Builder, CaseProgram, OpCase, register_cases, tol_for

    def _case(T, H, dtype):
        x, w = torch.randn(T, H).to(dtype), (1 + torch.randn(H) / 10).to(dtype)
        b = Builder(T)
        y = b.new("y", H, dtype)
        b.ins.append(L2Norm(x=b.act("x", x), weight=b.hbm("w", w), out=y, eps=1e-6))
        b.store(y)
        return CaseProgram(b, {"x": x, "w": w}, lambda t: {"y": l2norm(t["x"], t["w"], eps=1e-6)})

    register_cases(__package__, [OpCase("T3_H200_bf16", lambda: _case(3, 200, torch.bfloat16),
                                        tol_for(torch.bfloat16))])

The heavy parts (the generator, the interpreter) are imported when a program runs, not when this module is: op
folders import these names through :mod:`fusegraph.codegen.api` (cases are declared in a module nothing imports in
production; only :func:`load_cases` does).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping

import torch

from . import ir, reference
from .emitters import Context, Emitted, inst_name
from .io import Load, Store
from .lowering import ArgSource

if TYPE_CHECKING:  # pragma: no cover
    from .megakernel import GeneratedKernel

log = logging.getLogger(__name__)

V = ir.ValueKind


class Builder:
    """Builds, generates and runs a small kernel program (see the module docstring)."""

    def __init__(self, tokens: int = 1) -> None:
        self.T = tokens
        self.ins: list[ir.Instruction] = []
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.ids = self.hbm("ids", torch.arange(tokens, dtype=torch.int32), V.INPUT)

    def hbm(self, name: str, t: torch.Tensor, kind: str = V.WEIGHT) -> ir.Value:
        """A kernel argument holding ``t`` (a weight by default)."""
        v = ir.Value(name, kind, tuple(t.shape), t.dtype)
        self.inputs.append(v)
        self.tensors[name] = t
        return v

    def rows(self, name: str, t: torch.Tensor, rows: tuple[tuple[int, int], ...]) -> ir.Value:
        """A weight argument holding row ranges of ``t``, concatenated: what a lowering's ``L.hbm_rows`` gives a
        projection that reads one piece of a fused QKV / gate_up weight (taken by :meth:`ArgSource.value`, the
        executor's own slicing)."""
        part = ArgSource(name, tuple(t.shape), t.dtype, V.WEIGHT, rows=tuple(rows)).value(t)
        return self.hbm(name, part.contiguous())

    def act(self, name: str, x: torch.Tensor) -> ir.Value:
        """An activation [T, F] whose value is x (an input of the kernel, loaded to SBUF)."""
        src = self.hbm(f"in_{name}", x.clone(), V.INPUT)
        v = ir.Value(name, V.ACT, tuple(x.shape), x.dtype)
        self.ins.append(Load(src=src, out=v))
        return v

    def new(self, name: str, features: int, dtype: torch.dtype, kind: str = V.ACT) -> ir.Value:
        """A value an instruction will produce."""
        return ir.Value(name, kind, (self.T, features), dtype)

    def routing(self, name: str, k: int, dtype: torch.dtype) -> ir.Value:
        """A token-major ``[T, k]`` routing tile a router produces (its weights, or int32 expert ids)."""
        return ir.Value(name, V.ROUTING, (self.T, k), dtype)

    def store(self, v: ir.Value) -> ir.Value:
        """Store ``v`` to a kernel output ``out_<name>``."""
        out = ir.Value(f"out_{v.name}", V.OUTPUT, v.shape, v.dtype)
        self.ins.append(Store(x=v, dst=out))
        self.outputs.append(out)
        return out

    def store_routing(self, v: ir.Value) -> ir.Value:
        """Store a token-major routing tile ``[T, k]`` (a router's weights or expert ids) to a kernel output
        ``out_<name>`` (:class:`RoutingStore`): in a model the routing never leaves the kernel, a test reads it."""
        out = ir.Value(f"out_{v.name}", V.OUTPUT, v.shape, v.dtype)
        self.ins.append(RoutingStore(x=v, dst=out))
        self.outputs.append(out)
        return out

    def program(self) -> ir.KernelProgram:
        state = [v for v in self.inputs if v.kind == V.STATE]
        return ir.KernelProgram("test_kernel", self.T, list(self.ins), inputs=list(self.inputs),
                                outputs=self.outputs + state)

    def run(self, **gen_kw: Any) -> tuple["GeneratedKernel", dict[str, torch.Tensor], dict[str, torch.Tensor],
                                          dict[str, torch.Tensor]]:
        """Generate (conformance-checked), run in the interpreter and the reference VM: (kernel, kernel outputs by
        name, the reference VM's values by name, the tensors the kernel ran on)."""
        from fusegraph.nkisim.torch_io import InterpretedKernel  # deferred: the interpreter (module docstring)

        from .megakernel import generate

        prog = self.program()
        gen = generate(prog, **gen_kw)
        kernel = InterpretedKernel(gen, target=gen_kw.get("target", "trn2"))
        ref_env = {k: v.clone() for k, v in self.tensors.items()}
        reference.run(prog, ref_env)
        kern_tensors = {k: v.clone() for k, v in self.tensors.items()}
        outs = kernel(kernel.prepare(kern_tensors))
        results = dict(zip([v.name for v in prog.outputs], outs))
        return gen, results, ref_env, kern_tensors


@dataclass
class RoutingStore(ir.Instruction):
    """Store the first ``k`` columns of a token-major routing tile (``[T, k]`` weights, or the ``[T, 8]`` uint32
    expert ids ``max8`` leaves) to an HBM output ``[T, k]``: token ``t`` on partition ``t``, its ``k`` values
    contiguous (the ids converted to int32 by the DMA). :class:`Store` cannot: it reads feature layouts."""

    opcode: ClassVar[str] = "routing_store"
    x: ir.Value  # ROUTING [T, k]
    dst: ir.Value  # OUTPUT [T, k]
    output_fields: ClassVar[tuple[str, ...]] = ()

    def emit(self, ctx: Context, i: int) -> Emitted:
        T, k = self.x.shape
        e = Emitted()
        e.code("store.j2", what=self.dst.name, T=T, F=k, P=T, FT=k, dst=ctx.var(self.dst),
               x=f"{ctx.var(self.x)}[:, 0:{k}]", name=inst_name(self), pattern=[[k, T], [1, k]], contiguous=True,
               half=0, pmajor=True, only_core0=ctx.lnc == 2)
        return e

    def reference(self, env: dict[str, torch.Tensor]) -> None:
        env[self.dst.name] = env[self.x.name].reshape(self.dst.shape).clone()


def length_mask(positions: Iterable[int], length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive decode mask ``[T, length]`` of sequences at ``positions``: 0 up to and including each
    sequence's position, the most negative fp32 after it (HF's causal mask of one decode step, in ``dtype``)."""
    pos = torch.as_tensor(list(positions))
    masked = torch.arange(length)[None, :] > pos[:, None]
    return torch.zeros(len(pos), length).masked_fill(masked, torch.finfo(torch.float32).min).to(dtype)


# ---- declared test cases -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tol:
    """How close the kernel and the reference VM must be to eager: ``torch.testing.assert_close``'s ``atol`` and
    ``rtol``, on values compared in fp32 (integer outputs must be equal)."""

    atol: float
    rtol: float


#: what most cases use: fp32 a few roundings off, bf16 a few ulps (2^-8 relative each): the sums a kernel reorders
FP32_TOL = Tol(2e-5, 2e-5)
BF16_TOL = Tol(2e-2, 2e-2)
#: data movement (lookups, cache writes): bit for bit
EXACT = Tol(0.0, 0.0)


def tol_for(dtype: torch.dtype) -> Tol:
    """The default tolerance of a case computed in ``dtype``."""
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


@dataclass
class CaseProgram:
    """What an :class:`OpCase` builds: the kernel program, the logical tensors of the op's eager reference (model
    layouts: ``[B, heads, 1, D]`` queries, ``[V, H]`` tables, int64 ids, ...), and that reference.

    ``eager(tensors)`` gets clones of ``inputs`` (so an in-place reference, a KV-cache ``index_copy_``, leaves
    them alone) and returns the expected values by the name of the program value they are compared with: a stored
    activation (its kernel output ``out_<name>``) or a state argument (its value after the kernel's in-place
    writes), in the program's ``[T, F]`` / argument shapes."""

    builder: Builder
    inputs: Mapping[str, torch.Tensor]
    eager: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class OpCase:
    """One declared test case of an op: ``build()`` makes a fresh :class:`CaseProgram` (seeded inside, so a case
    is the same each run); ``gen`` are :func:`~.megakernel.generate` options (``chunk_bytes``, ``lnc``);
    ``slow`` cases run only under ``-m slow``. ``xfail``: a known bug the case exposes, in words (the shared test
    expects it to fail, strictly: once fixed the case must be un-marked). ``op`` is filled in by
    :func:`register_cases`."""

    name: str
    build: Callable[[], CaseProgram]
    tol: Tol = FP32_TOL
    gen: Mapping[str, Any] = field(default_factory=dict)
    slow: bool = False
    xfail: str = ""
    op: str = ""

    @property
    def id(self) -> str:
        """``<op>/<case>``: the test id."""
        return f"{self.op}/{self.name}"


@dataclass(frozen=True)
class OpCases:
    """The cases one op folder declared, or why it declares none (a host-side op: nothing runs in a kernel)."""

    package: str
    cases: tuple[OpCase, ...]
    why_none: str = ""

    @property
    def op(self) -> str:
        return op_name(self.package)


BUILTIN_PACKAGE = "fusegraph.patterns"
_LOCK = threading.RLock()
_CASES: dict[str, OpCases] = {}


def op_name(package: str) -> str:
    """The op of an op folder's package: its folder name for a built-in (``fusegraph.patterns.norm`` ->
    ``norm``), the whole package name for a plugin's (``mypkg.l2norm``)."""
    prefix = BUILTIN_PACKAGE + "."
    return package[len(prefix):] if package.startswith(prefix) else package


def register_cases(package: str, cases: Iterable[OpCase] = (), *, why_none: str = "") -> None:
    """Declare the test cases of the op folder ``package`` (call it from the folder's ``cases.py`` with
    ``__package__``). An op whose work never runs in a kernel (host-side) declares none and says why
    (``why_none``); an op with an instruction must declare at least one (``test_op_cases.py`` checks it). A
    package registering again (its module re-imported) replaces its entry."""
    cases = tuple(cases)
    if not cases and not why_none:
        raise ValueError(f"{package}: declare at least one case, or say why there is none (why_none=)")
    if cases and why_none:
        raise ValueError(f"{package}: cases and why_none exclude each other")
    op = op_name(package)
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{package}: case names declared twice: {dup}")
    bad = [n for n in names if not n or "/" in n or " " in n]
    if bad:
        raise ValueError(f"{package}: case names must be non-empty, without '/' or spaces: {bad}")
    with _LOCK:
        _CASES[package] = OpCases(package, tuple(_with_op(c, op) for c in cases), why_none)
    log.debug("registered %d test cases of %s", len(cases), package)


def unregister_cases(package: str) -> OpCases | None:
    """Forget what ``package`` declared (a plugin unloaded; tests)."""
    with _LOCK:
        return _CASES.pop(package, None)


def _with_op(case: OpCase, op: str) -> OpCase:
    return replace(case, op=op)


def declared_cases() -> dict[str, OpCases]:
    """Package -> what it declared, for every op registered so far (see :func:`load_cases`)."""
    with _LOCK:
        return dict(_CASES)


def op_packages() -> set[str]:
    """Every op folder the registries know: the built-in folders (``fusegraph.patterns.<op>``) and the package of
    every registered lowering and instruction class (a plugin laid out as a folder)."""
    from . import registry

    registry.ensure_builtins()
    found: set[str] = set()
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    for info in pkgutil.iter_modules(list(spec.submodule_search_locations or []) if spec else []):
        if info.ispkg and not info.name.startswith("_"):
            found.add(f"{BUILTIN_PACKAGE}.{info.name}")
    modules = [low.source for low in registry.lowerings().values()]
    modules += [cls.__module__ for cls in registry.instruction_classes().values()]
    for module in modules:
        package = _package_of(module)
        if package and not package.startswith("fusegraph.codegen"):
            found.add(package)
    return found


def _package_of(module: str) -> str:
    """The op folder a module belongs to: the module itself when it is a package (a plugin registering from its
    ``__init__``), else its parent package ("" for a top-level single-file module: no folder)."""
    mod = sys.modules.get(module)
    if mod is not None and hasattr(mod, "__path__"):
        return module
    return module.rpartition(".")[0]


def load_cases() -> dict[str, OpCases]:
    """Import the ``cases`` module of every op folder (:func:`op_packages`; each registers its cases on import)
    and return every declaration (:func:`declared_cases`), including ones registered by other means."""
    for package in sorted(op_packages()):
        name = f"{package}.cases"
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # the package is a plain module (a single-file plugin): no folder
            spec = None
        if spec is not None:
            importlib.import_module(name)
    return declared_cases()


def instruction_packages() -> dict[str, set[type]]:
    """Op folder package -> the instruction classes registered from it (an op folder with an instruction must
    declare cases; the core's own Load/Store/Guard/Elementwise are not an op folder's)."""
    from . import registry

    out: dict[str, set[type]] = {}
    for cls in registry.instruction_classes().values():
        package = _package_of(cls.__module__)
        if package and not package.startswith("fusegraph.codegen"):
            out.setdefault(package, set()).add(cls)
    return out


@dataclass
class CaseRun:
    """One run of a case: the kernel, and per expected value (eager's), the kernel's and the reference VM's."""

    case: OpCase
    kernel: "GeneratedKernel"
    program: ir.KernelProgram
    expected: dict[str, torch.Tensor]
    got_kernel: dict[str, torch.Tensor]
    got_reference: dict[str, torch.Tensor]


def run_case(case: OpCase) -> CaseRun:
    """Build ``case``, run its program in the interpreter and the reference VM, and its eager reference."""
    built = case.build()
    b = built.builder
    gen, results, ref_env, kern_tensors = b.run(**dict(case.gen))
    expected = dict(built.eager({k: v.clone() for k, v in built.inputs.items()}))
    if not expected:
        raise ValueError(f"{case.id}: its eager reference returned nothing to compare")
    got_k, got_r = {}, {}
    for name in expected:
        if f"out_{name}" in results:
            got_k[name] = results[f"out_{name}"]
        elif name in kern_tensors and any(v.name == name and v.kind == V.STATE for v in b.inputs):
            got_k[name] = kern_tensors[name]  # state written in place
        else:
            raise KeyError(f"{case.id}: eager returns {name!r}, which the program neither stores nor holds as state "
                           f"(outputs: {sorted(results)})")
        got_r[name] = ref_env[name]
    return CaseRun(case, gen, b.program(), expected, got_k, got_r)


def compare(got: torch.Tensor, want: torch.Tensor, tol: Tol, what: str) -> None:
    """``got`` within ``tol`` of ``want`` (same floating dtype; integers equal), else AssertionError naming
    ``what``."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, eager {tuple(want.shape)}")
    if want.dtype.is_floating_point or got.dtype.is_floating_point:
        if got.dtype != want.dtype:
            raise AssertionError(f"{what}: dtype {got.dtype}, eager {want.dtype}")
        try:
            torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol)
        except AssertionError as e:
            raise AssertionError(f"{what} differs from eager (atol={tol.atol}, rtol={tol.rtol}):\n{e}") from None
    elif not torch.equal(got.long(), want.long()):
        bad = int((got.long() != want.long()).sum())
        raise AssertionError(f"{what}: {bad} of {want.numel()} integers differ from eager\n got {got}\nwant {want}")


def check_case(case: OpCase) -> CaseRun:
    """Run ``case`` (:func:`run_case`) and compare the interpreter's and the reference VM's values with eager's
    within the case's tolerance; AssertionError naming the case, the value and which side is off."""
    run = run_case(case)
    for name, want in run.expected.items():
        compare(run.got_kernel[name], want, case.tol, f"{case.id}: {name} (interpreter)")
        compare(run.got_reference[name], want, case.tol, f"{case.id}: {name} (reference VM)")
    return run


__all__ = [
    "BF16_TOL", "Builder", "CaseProgram", "CaseRun", "EXACT", "FP32_TOL", "OpCase", "OpCases", "RoutingStore",
    "Tol", "V", "check_case", "compare", "declared_cases", "instruction_packages", "length_mask", "load_cases",
    "op_name", "op_packages", "register_cases", "run_case", "tol_for", "unregister_cases",
]
