"""The typed pattern-to-lowering contract (``codegen/contract.py``): a lowering registered with the pattern objects
it lowers may read only what they declare, checked when its module is imported; built-in ops register that way."""
from __future__ import annotations

import importlib.util
import sys
import textwrap
import warnings

import pytest
import torch

from fusegraph.codegen import registry
from fusegraph.matching import Input, analyze, register_pattern, unregister_pattern


PATTERN_SRC = """
from fusegraph.codegen.api import register_lowering
from fusegraph.matching import Input, Pattern


def _pattern(**kw):
    base = dict(name="fgcontract.norm", fn=lambda x, weight, *, eps: x, template="fgcontract_norm",
                inputs=[Input("x", "T H"), Input("weight", "H", kind="weight")], params={"eps": 1e-6})
    base.update(kw)
    return Pattern(**base)
"""
HDR_LINES = PATTERN_SRC.count("\n")


def _import_op(tmp_path, body: str):
    """Write ``body`` as a module and import it (what a plugin's import does)."""
    path = tmp_path / "fgcontract_op.py"
    path.write_text(PATTERN_SRC + textwrap.dedent(body))
    spec = importlib.util.spec_from_file_location("fgcontract_op", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fgcontract_op"] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop("fgcontract_op", None)
        registry.unregister_lowering("fgcontract_norm")
    return path


@pytest.mark.parametrize("read", ['L.input(m, "scale")', 'm.inputs["scale"]', 'm.inputs.get("scale")',
                                  '"scale" in m.inputs', 'L.views(m, "scale")'])
def test_an_undeclared_input_fails_at_import_naming_file_and_line(tmp_path, read):
    with pytest.raises(TypeError) as e:
        _import_op(tmp_path, f"""
            @register_lowering(_pattern())
            def lower(L, m):
                x = L.input(m, "x")
                y = {read}
        """)
    msg = str(e.value)
    assert f"fgcontract_op.py:{HDR_LINES + 5}" in msg and "'scale'" in msg and "fgcontract.norm" in msg


@pytest.mark.parametrize("read", ['m.params["epsilon"]', 'm.params.get("epsilon", 1e-5)', '"epsilon" in m.params'])
def test_an_undeclared_param_fails_at_import(tmp_path, read):
    with pytest.raises(TypeError, match="reads param 'epsilon'"):
        _import_op(tmp_path, f"""
            @register_lowering(_pattern())
            def lower(L, m):
                y = {read}
        """)


def test_check_and_tokens_functions_are_checked_too(tmp_path):
    with pytest.raises(TypeError, match="_check reads input 'bias'"):
        _import_op(tmp_path, """
            def _check(m, graph, tokens):
                return m.inputs.get("bias") is None

            @register_lowering(_pattern(), check=_check)
            def lower(L, m):
                pass
        """)


def test_declared_names_pass_params_slots_derived_and_keywords(tmp_path):
    _import_op(tmp_path, """
        @register_lowering(_pattern(derived=("dim",), fn=lambda x, weight, *, eps, offset=0.0: x))
        def lower(L, m):
            x, w = L.input(m, "x"), m.inputs["weight"]
            eps, dim, off = m.params["eps"], m.params.get("dim"), m.params.get("offset")
            out = L.output(m, "out")
    """)


def test_a_bare_template_name_is_not_checked(tmp_path):
    _import_op(tmp_path, """
        @register_lowering("fgcontract_norm")
        def lower(L, m):
            y = m.inputs["anything"]
    """)


def test_register_lowering_refuses_what_is_neither_pattern_nor_name():
    with pytest.raises(TypeError, match="takes patterns"):
        registry.register_lowering(object())


def test_derive_returning_an_undeclared_param_disables_the_pattern():
    """The other half of the contract: the names a lowering was checked against are the ones its matches get."""
    from fusegraph.models import build_decode
    import fusegraph

    @register_pattern("fgcontract.rmsnorm", template="rmsnorm", priority=99, inputs=[Input("x", "T H"),
                      Input("weight", "H", kind="weight")], params={"eps": 1e-6}, dims={"T": (3, 5), "H": (16, 40)},
                      derive=lambda m: {"surprise": 1}, derived=("declared",))
    def fg_rmsnorm(x, weight, *, eps):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    try:
        case = build_decode("llama-tiny")
        cap = fusegraph.capture_step(case.step, case.token, case.position, options={"executor": "eager"})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            result = analyze(cap.program)
        msgs = [str(x.message) for x in w]
        assert any("fgcontract.rmsnorm" in s and "'surprise'" in s and "derived=" in s for s in msgs), msgs
        assert not any(m.pattern.name == "fgcontract.rmsnorm" for m in result.matches)
        assert any(m.pattern.name == "fusegraph.rmsnorm" for m in result.matches)  # the built-in took its place
    finally:
        unregister_pattern("fgcontract.rmsnorm")


def test_every_builtin_lowering_is_registered_with_its_patterns():
    """Built-in ops use the typed form; the exceptions are the ops no pattern makes (``generic``: unmatched ops;
    ``generic_host``: unmatched ops on step metadata, computed on the host; ``llm_island``: the LLM fallback's
    verified islands) and template aliases of a typed lowering."""
    lows = registry.lowerings()
    builtin = {t: low for t, low in lows.items() if low.source.startswith(("fusegraph.patterns", "fusegraph.codegen"))}
    untyped = {t for t, low in builtin.items() if not low.patterns}
    assert untyped <= {"generic", "generic_host", "llm_island"}, untyped
    for t, low in builtin.items():
        assert all(p.source == "fusegraph" for p in low.patterns), t


def test_builtin_patterns_are_fusegraph_whichever_import_comes_first():
    """A test or a user importing one op folder first (its lowering, say) must not make the built-ins "user"
    patterns: the plugin tests and the report's source column rely on it (a CI run broke on this order)."""
    import subprocess
    import sys

    code = ("import fusegraph.patterns.kv_cache.lowering\n"
            "from fusegraph.matching import REGISTRY\n"
            "print(sorted({p.source for p in REGISTRY.patterns() if p.name.startswith('fusegraph.')}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['fusegraph']", out.stdout + out.stderr
