"""Traced pattern graphs are cached on disk by content; a changed pattern gets a new key."""
import torch

from fusegraph.matching import Input, Pattern, compile_pattern
from fusegraph.matching import pattern_cache
from fusegraph.matching.trace import _structure_key


def _scaled_exp(x, *, scale):
    return torch.exp(x) * scale


def _pattern(**kw):
    return Pattern(name="cachetest.scaled_exp", fn=_scaled_exp, inputs=[Input("x", "T H")],
                   params=kw.get("params", {"scale": 2.0}), dtypes=("float32",))


def test_round_trip_and_invalidation(tmp_path):
    p = _pattern()
    traced = compile_pattern(p, str(tmp_path))
    files = list((tmp_path / "patterns").glob("*.pkl"))
    assert len(files) == 1
    q = _pattern()  # a fresh object: nothing in memory
    loaded = compile_pattern(q, str(tmp_path))
    assert [_structure_key(v) for v in loaded] == [_structure_key(v) for v in traced]
    assert all(v.pattern is q for v in loaded)
    assert pattern_cache.pattern_key(_pattern(params={"scale": 3.0})) != pattern_cache.pattern_key(p)
    assert compile_pattern(_pattern(), "off") is not None and len(list((tmp_path / "patterns").glob("*.pkl"))) == 1


def test_a_corrupt_entry_is_a_miss(tmp_path):
    p = _pattern()
    key = pattern_cache.pattern_key(p)
    root = tmp_path / "patterns"
    root.mkdir()
    (root / f"{key}-float32.pkl").write_bytes(b"not a pickle")  # one entry per traced dtype
    assert compile_pattern(p, str(tmp_path))  # traced again


def test_only_the_dtypes_a_program_needs_are_traced(tmp_path):
    p = Pattern(name="cachetest.scaled_exp2", fn=_scaled_exp, inputs=[Input("x", "T H")], params={"scale": 2.0},
                dtypes=("float32", "bfloat16", "float16"))
    fp32 = compile_pattern(p, str(tmp_path), {"float32"})
    assert set(p._compiled) == {"float32"} and len(list((tmp_path / "patterns").glob("*.pkl"))) == 1
    both = compile_pattern(p, str(tmp_path), {"float32", "float16"})
    assert set(p._compiled) == {"float32", "float16"} and len(both) > len(fp32)
    assert len(compile_pattern(p, "off")) > len(both)  # all dtypes
