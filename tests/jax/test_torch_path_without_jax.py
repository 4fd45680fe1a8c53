"""The torch path must not import JAX (runs whether or not the jax extra is installed)."""


def test_torch_path_never_imports_jax():
    import subprocess
    import sys

    code = ("import sys, torch, fusegraph, fusegraph.backend, fusegraph.pipeline, fusegraph.cli, fusegraph.report;"
            "assert not any(m == 'jax' or m.startswith(('jax.', 'jaxlib')) for m in sys.modules), "
            "[m for m in sys.modules if 'jax' in m]")
    subprocess.run([sys.executable, "-c", code], check=True)
