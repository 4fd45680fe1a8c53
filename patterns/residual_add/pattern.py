"""A residual connection: the elementwise sum of two same-shaped activations."""
from fusegraph.matching import Input, register_pattern


def _check(m):
    a, b, out = m.inputs["a"], m.inputs["b"], m.outputs["out"]
    if a.shape != b.shape or a.shape != out.shape:
        return f"operands {a.shape} and {b.shape} are not same-shaped (a broadcast, not a residual)"
    return True


@register_pattern(
    "fusegraph.residual_add",
    template="residual_add",
    priority=-10,
    inputs=[Input("a", "T H"), Input("b", "T H")],
    dims={"T": (3, 5), "H": (16, 40)},
    check=_check,
)
def residual_add(a, b):
    """``a + b``."""
    return a + b
