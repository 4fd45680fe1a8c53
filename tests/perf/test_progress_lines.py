"""Progress of the ``fusegraph`` commands: lines off a terminal (one per stage, flushed, heartbeats while a step
runs), the terminal's status line finished before a result is printed."""
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from fusegraph.perf.progress import Progress

REPO = Path(__file__).resolve().parents[2]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_cli_progress_is_line_based_off_a_terminal(monkeypatch):
    monkeypatch.delenv("FUSEGRAPH_PROGRESS", raising=False)
    s = io.StringIO()
    p = Progress.for_cli(stream=s)
    with p.step("capture"):
        p.update("layer 1/48, 1 s")
        p.update("layer 2/48, 2 s")  # the same stage up to its numbers, within a heartbeat: not repeated
        p.update("matching patterns")
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue() and "\033" not in s.getvalue()
    assert lines[0] == "[fusegraph] capture ..." and lines[1] == "[fusegraph] layer 1/48, 1 s"
    assert lines[2] == "[fusegraph] matching patterns" and lines[3].startswith("[fusegraph] capture: ")
    assert len(lines) == 4
    monkeypatch.setenv("FUSEGRAPH_PROGRESS", "0")
    s = io.StringIO()
    Progress.for_cli(stream=s).note("quiet")
    assert s.getvalue() == ""


def test_heartbeat_names_the_running_step(monkeypatch):
    monkeypatch.delenv("FUSEGRAPH_PROGRESS", raising=False)
    s = io.StringIO()
    p = Progress.for_cli(stream=s, heartbeat=0.05)
    with p.step("shape-only profile"):
        time.sleep(0.5)
    beats = [ln for ln in s.getvalue().splitlines() if ln.startswith("[fusegraph] shape-only profile ... ")
             and ln.endswith(" s")]
    assert len(beats) >= 2
    assert not any(t.name == "fusegraph-heartbeat" for t in threading.enumerate())  # stopped with the step


def test_terminal_status_line_is_finished_before_a_result():
    t = _Tty()
    p = Progress(stream=t)
    p.update("profiling (shape-only): layer 1/2, 0 s")
    p.finish()
    t.write("result\n")
    assert t.getvalue().endswith("layer 1/2, 0 s\nresult\n")
    p.finish()  # nothing pending: no empty line
    assert t.getvalue().endswith("0 s\nresult\n")


def test_kernel_command_prints_progress_lines_on_a_pipe(tmp_path):
    """``fusegraph kernel --profile`` with stderr a pipe: a line per stage, no terminal control characters, and the
    modeled result on a line of its own."""
    env = {k: v for k, v in os.environ.items() if k != "FUSEGRAPH_PROGRESS"}
    out = tmp_path / "k.py"
    cmd = [sys.executable, "-c", "import sys; from fusegraph.cli import main; sys.exit(main())", "kernel",
           "--model", "llama-tiny", "--layers", "1", "--max-cache-len", "16", "--profile", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert "\r" not in err and "\033" not in err
    lines = err.splitlines()
    assert any(ln.startswith("[fusegraph] llama-tiny: capture, match, codegen (trn2) ...") for ln in lines)
    assert any(ln.startswith("[fusegraph] llama-tiny: shape-only profile (trn2): ") for ln in lines)
    assert any(ln.startswith("modeled on trn2 (one core") for ln in lines)


def test_terminal_heartbeat_keeps_the_status_and_adds_the_time():
    t = _Tty()
    p = Progress(stream=t, heartbeat=0.05)
    with p.step("codegen"):
        p.update("lowering and generating the megakernel for trn2")
        time.sleep(0.4)
    text = t.getvalue()
    assert "\r\033[K[fusegraph] lowering and generating the megakernel for trn2 [0 s]" in text
    assert text.endswith("\n") and "[fusegraph] codegen: " in text.splitlines()[-1]
