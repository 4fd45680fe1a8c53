"""Progress lines: only on a terminal or when asked, and the layer monitor's source map."""
import io

from fusegraph.perf.progress import Progress, layer_of_lines


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_quiet_unless_a_terminal_or_asked(monkeypatch):
    monkeypatch.delenv("FUSEGRAPH_PROGRESS", raising=False)
    s = io.StringIO()
    p = Progress(stream=s)
    with p.step("capture"):
        p.update("half way")
    assert s.getvalue() == "" and not p.enabled
    t = _Tty()
    p = Progress(stream=t)
    with p.step("capture"):
        pass
    assert "capture" in t.getvalue() and p.enabled
    monkeypatch.setenv("FUSEGRAPH_PROGRESS", "1")
    s = io.StringIO()
    Progress(stream=s).note("hello")
    assert "hello" in s.getvalue()


def test_layer_of_lines():
    src = "a\n    # ======== decoder layer 0 ========\nx\n    # ======== decoder layer 1 ========\ny\n" \
          "    # ======== outside the decoder layers ========\nz\n"
    assert layer_of_lines(src) == [-1, 0, 0, 1, 1, -1, -1]
