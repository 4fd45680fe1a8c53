"""A third-party pattern package, as a user would write it: only the public API, registered by entry point."""
import torch

import fusegraph


def _check(m):
    return m.inputs["x"].shape == m.outputs["out"].shape


@fusegraph.register_pattern(
    "fgtest.scaled_tanh",
    template="scaled_tanh",
    priority=40,
    inputs=[fusegraph.Input("x", "T H")],
    params={"scale": 2.0},
    dtypes=("float32",),
    check=_check,
)
def scaled_tanh(x, *, scale):
    """``tanh(x) * scale``."""
    return torch.tanh(x) * scale
