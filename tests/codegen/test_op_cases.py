"""Every op's declared test cases (issue 26: an op's cases live beside it, in its folder's ``cases.py``): each case's
kernel program is generated, run in the interpreter and in the reference VM, and both are compared with the op's
eager torch reference within the case's tolerance (:func:`fusegraph.codegen.testing.check_case`).

Also: every op folder with an instruction declares cases that exercise each of its instructions (a new op without
cases fails here, naming its folder), host-side folders say why they declare none, and the check can fail (a
perturbed eager reference, a wrong reference VM, a wrong kernel).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fusegraph.codegen import testing
from fusegraph.codegen.testing import Builder, CaseProgram, OpCase, check_case, load_cases

DECLARED = load_cases()
CASES = [c for entry in sorted(DECLARED.values(), key=lambda e: e.op) for c in entry.cases]


def _marks(case: OpCase) -> list:
    marks = [pytest.mark.slow] if case.slow else []
    if case.xfail:  # a known bug, strictly: the case passing means the bug is fixed and the mark must go
        marks.append(pytest.mark.xfail(reason=case.xfail, strict=True))
    return marks


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_declared_case(case: OpCase) -> None:
    check_case(case)


def test_every_op_folder_with_an_instruction_declares_cases_that_run_each_instruction() -> None:
    """A built-in op folder that registers an instruction must declare cases, and together they must build a
    program with each of its instruction classes (built, not run: cheap)."""
    missing, unexercised = [], []
    for package, classes in sorted(testing.instruction_packages().items()):
        if not package.startswith(testing.BUILTIN_PACKAGE + "."):
            continue  # a plugin another test registered; its own tests run its cases
        entry = DECLARED.get(package)
        if entry is None or not entry.cases:
            missing.append(f"{package} (instructions {sorted(c.__name__ for c in classes)})")
            continue
        seen = {type(ins) for case in entry.cases for ins in case.build().builder.ins}
        if classes - seen:
            unexercised.append(f"{package}: {sorted(c.__name__ for c in classes - seen)}")
    assert not missing, "op folders with an instruction but no declared cases (add a cases.py):\n  " + \
        "\n  ".join(missing)
    assert not unexercised, "instructions no declared case of their folder runs:\n  " + "\n  ".join(unexercised)


def test_every_builtin_op_folder_declares_cases_or_why_not() -> None:
    folders = {p for p in testing.op_packages() if p.startswith(testing.BUILTIN_PACKAGE + ".")}
    undeclared = sorted(folders - set(DECLARED))
    assert not undeclared, f"op folders without a cases.py (declare cases, or why_none=...): {undeclared}"
    for package in folders:
        entry = DECLARED[package]
        assert entry.cases or entry.why_none, package
    host = {p: DECLARED[p].why_none for p in folders if not DECLARED[p].cases}
    assert set(host) >= {f"{testing.BUILTIN_PACKAGE}.{op}" for op in ("rope_tables", "causal_mask", "cache_position")}
    assert all("host" in why for why in host.values()), host


def test_default_cases_cover_bf16_and_two_shapes_per_op() -> None:
    """At least two cases per op in the default run, and one computing in bf16 for every op (each supports it):
    a value of the built program is bf16, whatever the case is called."""
    for entry in DECLARED.values():
        fast = [c for c in entry.cases if not c.slow]
        if not entry.cases:
            continue
        assert len(fast) >= 2, f"{entry.op}: {len(fast)} default case(s)"
        dtypes = {v.dtype for c in fast for ins in c.build().builder.ins for v in ins.reads() + ins.writes()}
        assert torch.bfloat16 in dtypes, f"{entry.op}: no bf16 case among {[c.name for c in fast]}"


def _first(op: str) -> OpCase:
    return next(c for c in CASES if c.op == op)


def test_a_perturbed_eager_reference_fails() -> None:
    """The same case with eager's output moved by a few times the tolerance fails, on both sides, naming the
    value: the comparison is not vacuous."""
    case = _first("residual_add")
    check_case(case)

    def build() -> CaseProgram:
        built = case.build()
        eager = built.eager

        def perturbed(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = dict(eager(t))
            name = next(iter(out))
            y = out[name]
            bump = torch.zeros_like(y)
            bump.view(-1)[y.numel() // 2] = 1.0  # one element, far outside any tolerance
            out[name] = y + bump
            return out

        return dataclasses.replace(built, eager=perturbed)

    with pytest.raises(AssertionError, match=r"residual_add/.*\(interpreter\)"):
        check_case(dataclasses.replace(case, build=build))


def _add_case(ins_cls: type, scale: float = 1.0) -> OpCase:
    """``y = a + b`` through ``ins_cls``, against eager ``scale * (a + b)``."""
    from fusegraph.patterns.residual_add.pattern import residual_add

    def build() -> CaseProgram:
        g = torch.Generator().manual_seed(0)
        a, c = torch.randn(2, 256, generator=g), torch.randn(2, 256, generator=g)
        b = Builder(2)
        y = b.new("y", 256, torch.float32)
        b.ins.append(ins_cls(a=b.act("a", a), b=b.act("b", c), out=y))
        b.store(y)
        return CaseProgram(b, {"a": a, "b": c}, lambda t: {"y": scale * residual_add(t["a"], t["b"])})

    return OpCase("probe", build, op="probe")


def test_a_wrong_reference_vm_fails_on_the_reference_side() -> None:
    """A kernel that is right with an instruction whose ``reference`` is wrong: the interpreter side passes, the
    reference VM side fails (each is compared with eager, not with the other)."""
    from fusegraph.patterns.residual_add.lowering import Add

    @dataclasses.dataclass
    class WrongReferenceAdd(Add):
        def reference(self, env: dict[str, torch.Tensor]) -> None:
            env[self.out.name] = env[self.a.name] - env[self.b.name]

    check_case(_add_case(Add))
    with pytest.raises(AssertionError, match=r"probe/probe: y \(reference VM\)"):
        check_case(_add_case(WrongReferenceAdd))


def test_a_wrong_kernel_fails() -> None:
    """Eager that is not what the instruction computes (``2 (a + b)``): the interpreter side fails first."""
    from fusegraph.patterns.residual_add.lowering import Add

    with pytest.raises(AssertionError, match=r"probe/probe: y \(interpreter\)"):
        check_case(_add_case(Add, scale=2.0))


def test_registration_rejects_empty_and_duplicate_declarations() -> None:
    with pytest.raises(ValueError, match="why_none"):
        testing.register_cases("fgprobe.op")
    dup = OpCase("a", lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="twice"):
        testing.register_cases("fgprobe.op", [dup, dup])
    assert "fgprobe.op" not in testing.declared_cases()


PLUGIN_INIT = '''
from dataclasses import dataclass
from typing import ClassVar

from fusegraph.codegen.api import register_lowering
from fusegraph.patterns.residual_add.lowering import Add


@dataclass
class PluginAdd(Add):
    opcode: ClassVar[str] = "fgcases_add"


@register_lowering("fgcases_add", instructions=[PluginAdd])
def lower(L, m):
    raise NotImplementedError
'''

PLUGIN_CASES = '''
import torch

from fusegraph.codegen.api import Builder, CaseProgram, OpCase, register_cases

from . import PluginAdd


def _case():
    a, c = torch.ones(1, 256), torch.arange(256.0)[None]
    b = Builder(1)
    y = b.new("y", 256, torch.float32)
    b.ins.append(PluginAdd(a=b.act("a", a), b=b.act("b", c), out=y))
    b.store(y)
    return CaseProgram(b, {"a": a, "b": c}, lambda t: {"y": t["a"] + t["b"]})


register_cases(__package__, [OpCase("T1_H256_f32", _case)])
'''


def test_a_plugin_folder_declares_cases_the_same_way(tmp_path, monkeypatch) -> None:
    """A plugin laid out as a folder (its lowering registered from the package, ``cases.py`` beside it): the
    registry walk finds its cases (by the package of its registered lowering), they run like the built-ins'."""
    import sys

    from fusegraph.codegen import registry

    pkg = tmp_path / "fgcases_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGIN_INIT)
    (pkg / "cases.py").write_text(PLUGIN_CASES)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        __import__("fgcases_plugin")
        declared = load_cases()
        (case,) = declared["fgcases_plugin"].cases
        assert case.id == "fgcases_plugin/T1_H256_f32"
        check_case(case)
        assert "fgcases_plugin" in testing.instruction_packages()
    finally:
        registry.unregister_lowering("fgcases_add")
        testing.unregister_cases("fgcases_plugin")
        for name in [m for m in sys.modules if m.startswith("fgcases_plugin")]:
            del sys.modules[name]
