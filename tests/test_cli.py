import json

from fusegraph.cli import main


def test_report_command_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["report", "--model", "llama-tiny", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "captured 1 graph(s)" in text and "step 1 max |diff| = 0" in text
    data = json.loads(out.read_text())
    check = data["check"]  # step 2 is the kernel's own output (the default executor runs the NKI megakernel)
    assert check["step2_max_abs_diff_vs_eager"] <= 1e-4 * check["logit_scale"]
    assert check["kv_cache_max_abs_diff"] <= 1e-5 and data["layers"] == 2


def test_models_and_options_commands(capsys):
    assert main(["models"]) == 0
    assert "qwen3-moe-tiny" in capsys.readouterr().out
    assert main(["options"]) == 0
    assert "FUSEGRAPH_TARGET" in capsys.readouterr().out


def test_report_option_writes_json(tmp_path):
    import torch

    path = tmp_path / "rep.json"
    f = torch.compile(lambda x: x.cos() * 3, backend="fusegraph", options={"report": str(path)})
    with torch.no_grad():
        f(torch.ones(3))
    assert json.loads(path.read_text())["op_count"] >= 2


def test_report_accepts_user_code(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text(
        "from fusegraph.models import build_decode\n\n"
        "def qwen_step():\n"
        "    return build_decode('qwen3-tiny', num_layers=1)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--model", "mymodels:qwen_step", "--option", "executor=eager"]) == 0
    text = capsys.readouterr().out
    assert "user code" in text and "fused-region report" in text and "KV cache max |diff| = 0" in text
