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


# ---- input errors: one line on stderr, exit 2, nothing built or written -------------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_cli(argv, capsys):
    """``main(argv)`` as the console script runs it: the exit code (argparse exits through SystemExit)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("argv, says", [
    (["report", "--model", "nope-model"], "unknown model 'nope-model'"),
    (["report", "--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["report", "--attn", "flash"], "argument --attn: invalid choice: 'flash'"),
    (["report", "--model", "llama-tiny", "--option", "executor=banana"], "'executor' must be one of"),
    (["report", "--model", "llama-tiny", "--option", "executor"], "--option expects NAME=VALUE"),
    (["report", "--model", "no_such_module_xyz:step"], "no module named 'no_such_module_xyz'"),
    (["report", "--model", "json:no_such_function"], "module 'json' has no function 'no_such_function'"),
    (["report", "--batch", "0"], "argument --batch: expected a positive integer, got 0"),
    (["report", "--max-cache-len", "-3"], "argument --max-cache-len: expected a positive integer"),
    (["kernel", "--model", "nope-model"], "unknown model 'nope-model'"),
    (["report", "--model", "/no/such/config.json"], "no such config file"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2
    assert err.startswith("fusegraph: error: ") and err.count("\n") == 1, err
    assert says in err and "Traceback" not in err + out


def test_bench_with_an_unknown_model_fails_before_writing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(["bench", "--models", "nope-model"], capsys)
    assert rc == 2 and err.startswith("fusegraph: error: unknown model 'nope-model'")
    assert not (tmp_path / "bench-results").exists()
    rc, _, err = run_cli(["bench", "--models", "llama-tiny", "--targets", "trn9"], capsys)
    assert rc == 2 and "--targets 'trn9'" in err and not (tmp_path / "bench-results").exists()


def test_nki_run_help(capsys):
    rc, out, _ = run_cli(["nki-run", "--help"], capsys)
    assert rc == 0 and "usage: fusegraph nki-run" in out and "--verbose" in out
    rc, _, err = run_cli(["nki-run"], capsys)
    assert rc == 2 and err.startswith("fusegraph: error: nki-run: ")


def _cli(*args):
    return [sys.executable, "-c", "import sys; from fusegraph.cli import main; sys.exit(main())", *args]


def test_a_closed_pipe_ends_the_command_quietly():
    """``fusegraph options | head``: the reader closes the pipe before the command writes; no BrokenPipeError."""
    p = subprocess.Popen(_cli("options"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()  # before the child has written anything: its first flush meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert "BrokenPipeError" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_nki_run_shows_a_rule_error_in_one_line_and_the_stack_with_verbose(tmp_path, capsys):
    f = tmp_path / "bad_kernel.py"
    f.write_text("import nki\nimport nki.isa as nisa\nimport nki.language as nl\nimport numpy as np\n\n"
                 "@nki.jit\ndef k(x):\n    nl.ndarray((300, 1), dtype=nl.float32, buffer=nl.sbuf)\n    return x\n\n"
                 "k(np.zeros((4, 4), np.float32))\n")
    rc, _, err = run_cli(["nki-run", str(f)], capsys)
    lines = err.splitlines()
    assert rc == 1 and lines[0].startswith("fusegraph nki-run: NkiValidationError: [partition-dim] ")
    assert f"{f}:8" in lines[0] and "Traceback" not in err and "--verbose" in lines[1]
    rc, _, err = run_cli(["nki-run", str(f), "--verbose"], capsys)
    assert rc == 1 and err.splitlines()[0].startswith("fusegraph nki-run: NkiValidationError: [partition-dim] ")
    assert "Traceback" in err
    rc, _, err = run_cli(["-v", "nki-run", str(f)], capsys)
    assert rc == 1 and "Traceback" in err


# ---- --model: an HF family or a config.json ------------------------------------------------------------------------
def _check_against_eager(data):
    check = data["check"]
    assert check["max_abs_diff_vs_eager"] == 0.0  # the first call is verified and returns eager's values
    assert check["step2_max_abs_diff_vs_eager"] <= 1e-4 * check["logit_scale"]
    assert check["kv_cache_max_abs_diff"] <= 1e-5


def test_report_accepts_an_hf_family_name(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc, text, _ = run_cli(["report", "--model", "qwen2", "--json", str(out)], capsys)
    assert rc == 0 and "model qwen2 (qwen2, torch.float32" in text
    data = json.loads(out.read_text())
    assert data["layers"] == 2
    _check_against_eager(data)


def test_report_accepts_a_config_json(tmp_path, capsys):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
           "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "bos_token_id": 1, "eos_token_id": 31999}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "r.json"
    rc, text, _ = run_cli(["report", "--model", str(path), "--json", str(out)], capsys)
    assert rc == 0 and "(llama, torch.float32" in text
    data = json.loads(out.read_text())
    assert data["layers"] == 2
    _check_against_eager(data)


def test_tiny_size_keeps_the_family_structure():
    from fusegraph.models.custom import custom_spec

    c = custom_spec("qwen3_moe", "tiny").make_config()
    assert c.num_hidden_layers == 2 and c.hidden_size == 256 and c.num_experts == 8
    assert c.num_experts_per_tok == 2 and c.moe_intermediate_size == 128
    assert c.num_key_value_heads < c.num_attention_heads  # GQA stays GQA
    mha = custom_spec("qwen2", "tiny").config  # Qwen2's default config is multi-head: it stays so
    assert mha["num_key_value_heads"] == mha["num_attention_heads"]
    full = custom_spec("llama", "full")
    assert full.meta and full.config["hidden_size"] == 4096 and full.dtype == "bfloat16"
