"""A linear projection ``x @ weight.T (+ bias)`` with the weight in HF layout ``[N, K]``.

Covers q/k/v/o, gate/up/down, fused QKV and gate_up projections (just a larger N), routers' logits and lm_head.
Four traced forms: 2-d or 3-d activations (3-d adds the flatten/unflatten reshapes aten.linear emits), with or
without bias (``addmm``).
"""
import math

import torch

from fusegraph.matching import Input, register_pattern

X2 = Input("x", "T K")
X3 = Input("x", "B S K")
W = Input("weight", "N K", kind="weight")
BIAS = Input("bias", "N", kind="weight")


def _check(m):
    x, w = m.inputs["x"], m.inputs["weight"]
    if x.shape is None or w.shape is None or len(w.shape) != 2:
        return "weight must be 2-d"
    n, k = w.shape
    if math.prod(x.shape) % k:
        return f"x {x.shape} cannot be read as rows of K={k}"
    b = m.inputs.get("bias")
    if b is not None and tuple(b.shape) != (n,):
        return f"bias {b.shape} does not match N={n}"
    return True


@register_pattern(
    "fusegraph.linear",
    template="linear",
    priority=10,
    inputs=[X2, W, BIAS],
    dims={"T": (3, 5), "B": (2, 3), "S": (3, 4), "K": (16, 40), "N": (24, 56)},
    check=_check,
)
def linear(x, weight, bias=None):
    """``torch.nn.functional.linear(x, weight, bias)``."""
    return torch.nn.functional.linear(x, weight, bias)


@linear.implementation("bias_3d", inputs=[X3, W, BIAS])
def _bias_3d(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


@linear.implementation("nobias_2d", inputs=[X2, W])
def _nobias_2d(x, weight):
    return torch.nn.functional.linear(x, weight)


@linear.implementation("nobias_3d", inputs=[X3, W])
def _nobias_3d(x, weight):
    return torch.nn.functional.linear(x, weight)
