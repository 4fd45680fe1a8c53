"""Third-party patterns through the ``fusegraph.patterns`` entry point; broken plugins warn once and are skipped."""
import json
import sys
import warnings

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.matching import REGISTRY, registered_patterns

PLUGINS = {
    "fgtest": "fg_testplugin",
    "broken_import": "fg_broken_import",
    "untraceable": "fg_untraceable:make_patterns",
    "bad_check": "fg_badcheck",
    "sysexit": "fg_sysexit",
}


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A dist-info directory on sys.path declaring the entry points (what pip would install)."""
    dist = tmp_path / "fg_test_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fg-test-plugins\nVersion: 0.1\n")
    lines = ["[fusegraph.patterns]"] + [f"{k} = {v}" for k, v in PLUGINS.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    REGISTRY.reload_plugins()
    yield
    monkeypatch.undo()
    for mod in [m for m in sys.modules if m.startswith(("fg_testplugin", "fg_broken", "fg_untraceable", "fg_badcheck", "fg_sysexit"))]:
        del sys.modules[mod]
    REGISTRY.reload_plugins()
    for p in registered_patterns():  # the next test sees the built-ins only
        assert p.source == "fusegraph", p


def _step(x, y):
    a = torch.tanh(x) * 3.0
    b = torch.exp(x) + y
    return a + b


def test_plugins_are_discovered_matched_and_broken_ones_warn_once(plugins, tmp_path):
    path = tmp_path / "report.json"
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(_step, backend="fusegraph", options={"report": str(path), "executor": "eager"})
        with torch.no_grad():
            out = f(x, y)
    torch.testing.assert_close(out, _step(x, y))  # the compile went on
    msgs = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    for name in ("broken_import", "fguntraceable.branchy", "fgbadcheck.exp_add"):
        hits = [m for m in msgs if name in m]
        assert len(hits) == 1, (name, msgs)
    assert any("broken_import" in m and "failed to load" in m for m in msgs)
    # a plugin that exits at import (module-level argparse) is contained: one warning, the process goes on
    assert len([m for m in msgs if "'sysexit'" in m and "failed to load" in m and "SystemExit" in m]) == 1, msgs
    assert any("fguntraceable.branchy" in m and "could not be traced" in m for m in msgs)
    assert any("fgbadcheck.exp_add" in m and "check/derive" in m for m in msgs)

    report = json.loads(path.read_text())
    assert report["pattern_counts"].get("fgtest.scaled_tanh") == 1
    (m,) = [m for m in report["matches"] if m["pattern"] == "fgtest.scaled_tanh"]
    assert m["params"]["scale"] == 3.0 and m["template"] == "scaled_tanh"
    sources = {p["name"]: p["source"] for p in report["patterns"]}
    assert sources["fgtest.scaled_tanh"] == "fgtest" and sources["fusegraph.rmsnorm"] == "fusegraph"
    assert "broken_import" in report["plugin_errors"]
    assert "fguntraceable.branchy" in report["pattern_errors"]
    assert "fgbadcheck.exp_add" in report["disabled_patterns"]
    assert "fgbadcheck.exp_add" not in report["pattern_counts"]


def test_plugin_patterns_can_be_disabled(plugins):
    from fusegraph import capture_step
    from fusegraph.matching import analyze
    from fusegraph.settings import Settings

    cap = capture_step(_step, torch.randn(4, 8), torch.randn(4, 8), options={"executor": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = analyze(cap.program, Settings(disabled_patterns=("fgtest.*", "fgbadcheck.*"), generic_lowering=False))
    assert not a.matches_of("fgtest.scaled_tanh")
