"""A scalar sigmoid gate on a branch: ``sigmoid(gate_logit) * x`` (Qwen2-MoE / DeepSeek shared-expert gate)."""
import torch

from fusegraph.matching import Input, register_pattern


def _check(m):
    g, x = m.inputs["gate"].shape, m.inputs["x"].shape
    if g is None or x is None or g[-1] != 1 or g[:-1] != x[:-1]:
        return f"gate {g} is not one logit per row of x {x}"
    return True


@register_pattern(
    "fusegraph.sigmoid_gate",
    template="sigmoid_gate",
    priority=6,
    inputs=[Input("gate", "T 1"), Input("x", "T H")],
    dims={"T": (3, 5), "H": (16, 40)},
    check=_check,
)
def sigmoid_gate(gate, x):
    """``torch.sigmoid(gate) * x`` with one gate logit per row."""
    return torch.sigmoid(gate) * x
