"""A gated activation ``act(gate) * up`` (SwiGLU with silu, GeGLU with gelu/gelu_tanh...): the MLP's middle."""
from fusegraph.matching import ACTIVATIONS, Input, register_pattern


def _check(m):
    if m.inputs["gate"].shape != m.inputs["up"].shape:
        return "gate and up have different shapes"
    return True


@register_pattern(
    "fusegraph.swiglu",
    template="gated_act",
    priority=5,
    inputs=[Input("gate", "T I"), Input("up", "T I")],
    slots={"act": ACTIVATIONS},
    dims={"T": (3, 5), "I": (16, 40)},
    check=_check,
)
def swiglu(gate, up, *, act):
    """``act(gate) * up``; ``act`` is captured by name (silu, gelu, gelu_tanh, relu, ...)."""
    return act(gate) * up
