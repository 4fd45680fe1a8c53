"""`backend="fusegraph"` must work in a fresh interpreter without importing fusegraph (entry point)."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    assert "fusegraph" not in sys.modules
    assert "fusegraph" in torch._dynamo.list_backends(exclude_tags=())
    f = torch.compile(lambda x: (x * 2).sin() + 1, backend="fusegraph")
    out = f(torch.ones(3))
    assert torch.allclose(out, (torch.ones(3) * 2).sin() + 1)
    assert "fusegraph.backend" in sys.modules
    try:
        torch.compile(lambda x: x + 1, backend="fusegraph", options={"no_such_option": 1})(torch.ones(2))
    except Exception as e:
        assert "no_such_option" in str(e) and "capture_rewrites" in str(e), str(e)
    else:
        raise AssertionError("unknown option accepted")
    print("OK")
    """
)


def test_entry_point_backend_in_fresh_interpreter():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
