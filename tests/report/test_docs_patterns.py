"""docs/patterns.md: the tutorial runs as written, and the built-in contract table lists every built-in pattern."""
import pathlib
import re
import warnings

import pytest

from fusegraph.matching import registered_patterns, unregister_pattern

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "patterns.md"


@pytest.fixture
def cleanup():
    yield
    unregister_pattern("mypkg.layer_norm")


def test_tutorial_code_runs(cleanup, capsys):
    text = DOC.read_text()
    section = text.split("## Write your own pattern", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 3
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for i, code in enumerate(blocks):
            exec(compile(code, f"docs/patterns.md block {i}", "exec"), ns)
    out = capsys.readouterr().out
    assert "mypkg.layer_norm" in out and "not a multiple of 64" in out


def test_contract_table_covers_the_builtins():
    text = DOC.read_text()
    table = text.split("## Built-in patterns", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(fusegraph\.[a-z_]+)` \| `([a-z_]+)` \|", table, re.M)}
    builtins = {p.name: p.template for p in registered_patterns() if p.source == "fusegraph"}
    assert rows == builtins
