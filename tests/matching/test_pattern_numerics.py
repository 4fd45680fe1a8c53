"""Patterns compute what their reference says: every traced implementation, and every match in real programs."""
import pytest

from fg_cases import analyzed, program_values
from fusegraph.matching import registered_patterns
from fusegraph.matching.verify import verify_match, verify_pattern

BUILTIN = [p for p in registered_patterns() if p.source == "fusegraph"]


@pytest.mark.parametrize("pattern", BUILTIN, ids=[p.name for p in BUILTIN])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_implementations_agree_with_reference(pattern, dtype):
    if all(c.get("_device", "cpu") != "cpu" for i in pattern.implementations for c in (i.cases or pattern.cases)):
        pytest.skip("traced on another device only (collectives: checked across ranks in tests/tp)")
    results = verify_pattern(pattern, dtype)
    if dtype == "float32":
        assert results, "no implementation verified"
    bad = [r for r in results if not r.ok]
    assert not bad, bad


@pytest.mark.parametrize("cfg", [
    ("qwen3-moe-tiny", "eager", "batched_mm", "float32"),
    ("qwen3-moe-tiny", "sdpa", "grouped_mm", "bfloat16"),
    ("qwen3-tiny", "eager", "batched_mm", "bfloat16"),
    ("llama-tiny", "sdpa", "batched_mm", "float32"),
    ("qwen3-moe-tiny", "eager", "eager", "float32"),
], ids=lambda c: "-".join(c))
def test_every_match_recomputes_the_program(cfg):
    """The contract codegen builds on: reference(inputs read from the program, params) == the program's outputs."""
    _, cap, a = analyzed(*cfg)
    values, before = program_values(cap.program)
    results = [verify_match(m, values, before) for m in a.matches]
    bad = [r for r in results if not r.ok]
    assert not bad, bad
    assert len(results) == len(a.matches) > 30


def test_a_wrong_param_is_caught():
    """Sanity of the check above: the same verification fails when a captured param is wrong."""
    _, cap, a = analyzed("qwen3-tiny", "eager", "batched_mm", "float32")
    values, before = program_values(cap.program)
    m = a.matches_of("fusegraph.decode_attention")[0]
    m2 = type(m)(**{**m.__dict__, "params": dict(m.params, scale=m.params["scale"] * 2)})
    assert verify_match(m, values, before).ok
    assert not verify_match(m2, values, before).ok
