"""``fusegraph kernel`` / ``bench`` / ``report --html`` (small models, few layers)."""
import json
import os
import textwrap

from fusegraph.cli import main


def test_kernel_command_writes_source(tmp_path, capsys):
    out = tmp_path / "k.py"
    assert main(["kernel", "--model", "qwen3-moe-tiny", "--layers", "1", "--out", str(out), "--profile"]) == 0
    src = out.read_text()
    assert "@nki.jit" in src and "nisa.nc_matmul" in src
    assert "modeled on trn2" in capsys.readouterr().err


def test_kernel_command_accepts_module_function(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodel.py").write_text(textwrap.dedent("""
        from fusegraph.models import build_decode

        def step():
            return build_decode("llama-tiny", num_layers=1, max_cache_len=16)
    """))
    monkeypatch.chdir(tmp_path)
    assert main(["kernel", "--model", "mymodel:step"]) == 0
    assert "@nki.jit" in capsys.readouterr().out


def test_bench_command(tmp_path, capsys):
    out = tmp_path / "perf.json"
    assert main(["bench", "--models", "qwen3-moe-tiny", "--targets", "trn3", "--layers", "1", "--cache-len", "32",
                 "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "(c) megakernel ms" in text and "qwen3-moe-tiny" in text
    # off a terminal the progress is lines on stderr: one per model and per stage (it used to be silent)
    progress = captured.err.splitlines()
    assert "[fusegraph] model 1/1: qwen3-moe-tiny on trn3" in progress
    assert any(ln.startswith("[fusegraph] qwen3-moe-tiny: capture and match: ") for ln in progress)
    assert "\r" not in captured.err
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert row["status"] == "run"
    assert row["megakernel_launches"] == 1 and row["megakernel_ms"] < row["per_op_ms"]
    assert data["like_for_like"] == []  # no published figures for the tiny model


def test_bench_reports_a_kernel_the_pipeline_refuses_as_not_run(tmp_path, capsys, monkeypatch):
    """A 32 KiB SBUF budget (``FUSEGRAPH_SBUF_BUDGET``): the kernel needs more on every target, so both rows are
    not run (no kernel built some other way, no traceback), and the same bench without the budget runs."""
    out = tmp_path / "perf.json"
    monkeypatch.setenv("FUSEGRAPH_SBUF_BUDGET", str(32 * 1024))
    assert main(["bench", "--models", "llama-tiny", "--targets", "trn2,trn3", "--layers", "1",
                 "--no-per-op", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    rows = {r["target"]: r for r in json.loads(out.read_text())["rows"]}
    for t in ("trn2", "trn3"):
        assert rows[t]["status"] == "not run" and rows[t]["stage"] == "codegen"
        assert rows[t]["reason"].startswith("BudgetError: the kernel needs ")
        assert f"SBUF per partition but {t} has 32.0 KiB" in rows[t]["reason"] and "\n" not in rows[t]["reason"]
        assert "megakernel_ms" not in rows[t]
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("llama-tiny  trn2")]
    assert len(lines) == 2 and all("not run: BudgetError: the kernel needs " in ln for ln in lines)  # both tables
    monkeypatch.delenv("FUSEGRAPH_SBUF_BUDGET")
    assert main(["bench", "--models", "llama-tiny", "--targets", "trn3", "--layers", "1", "--no-per-op",
                 "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "run" and row["megakernel_ms"] > 0


def test_report_html_flag(tmp_path):
    path = tmp_path / "r.html"
    assert main(["report", "--model", "llama-tiny", "--layers", "1", "--html", str(path)]) == 0
    text = path.read_text()
    assert 'id="program-graph"' in text and 'id="region-table"' in text


def test_kernel_command_accepts_a_config_json_at_full_size(tmp_path, capsys):
    """``--model config.json --size full``: the user's config as written, on the meta device (one layer here)."""
    cfg = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
           "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "k.py"
    assert main(["kernel", "--model", str(path), "--size", "full", "--layers", "1", "--max-cache-len", "64",
                 "--out", str(out)]) == 0
    src = out.read_text()
    assert "@nki.jit" in src and "1536" in src  # the config's hidden size, not a tiny one


def test_kernel_profile_shows_an_interpreter_rule_error_in_one_line(monkeypatch, capsys):
    """A rule error of the shape-only run: the one-line message first, the interpreter's stack only with
    --verbose (the error is injected: fusegraph's own kernels pass the interpreter)."""
    import fusegraph.modelperf.cli as perf_cli
    from fusegraph.nkisim import NkiValidationError

    def rejected(*args, **kwargs):
        raise NkiValidationError("nisa.tensor_copy: dst must be in SBUF", rule="buffer", location="kernel.py:12")

    monkeypatch.setattr(perf_cli, "profile_shape_only", rejected)
    argv = ["kernel", "--model", "llama-tiny", "--layers", "1", "--max-cache-len", "16", "--profile", "--out",
            os.devnull]
    assert main(argv) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if not ln.startswith("[fusegraph]")]
    assert errors[0] == "fusegraph: kernel error: [buffer] nisa.tensor_copy: dst must be in SBUF (at kernel.py:12)"
    assert "Traceback" not in err and "--verbose" in errors[1]
    assert main([*argv, "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "fusegraph: kernel error: [buffer]" in err and "Traceback" in err


def test_kernel_of_a_model_without_a_region_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("FUSEGRAPH_SBUF_BUDGET", str(32 * 1024))  # the kernel needs more: codegen refuses it
    assert main(["kernel", "--model", "llama-tiny", "--layers", "1", "--out", os.devnull]) == 1
    err = capsys.readouterr().err
    assert "fusegraph: kernel error: the kernel needs " in err and "Traceback" not in err
