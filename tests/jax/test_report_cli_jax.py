"""`fusegraph report --frontend jax`: the JAX step's capture summary and fused-region report, checked against
jax.jit, with the same JSON schema as the torch command."""
import json

import pytest

pytest.importorskip("jaxlib")  # not "jax": tests/jax itself would satisfy that

from fusegraph.cli import main  # noqa: E402


def test_report_frontend_jax(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["report", "--frontend", "jax", "--model", "llama-tiny", "--option", "executor=nkisim",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fused-region report" in text and "kernel launches per step: 1" in text
    data = json.loads(out.read_text())
    assert data["check"]["max_abs_diff_vs_jax"] < 1e-4
    assert [r["kind"] for r in data["regions"]] == ["decoder_stack"]


def test_report_frontend_jax_refuses_an_unknown_model(tmp_path, capsys):
    """An unknown model is an error (exit 2, one line), not a silent run of llama-tiny."""
    out = tmp_path / "r.json"
    try:
        rc = main(["report", "--frontend", "jax", "--model", "nope-model", "--json", str(out)])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fusegraph: error: unknown JAX model 'nope-model'") and not out.exists()
