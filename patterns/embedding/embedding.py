"""Token embedding lookup, optionally scaled (Gemma's ``ScaledWordEmbedding`` multiplies by sqrt(hidden))."""
import torch

from fusegraph.matching import Input, register_pattern

WEIGHT = Input("weight", "V H", kind="weight")
INDICES = Input("indices", "B S", dtype="int64")
SCALE = Input("scale", "")


def _check(m):
    scale = m.inputs.get("scale")
    if scale is not None and (scale.shape is None or any(d != 1 for d in scale.shape)):
        return f"scale {scale.shape} is not a single number"
    return True


@register_pattern(
    "fusegraph.embedding",
    template="embedding",
    block="embedding",
    priority=10,
    inputs=[WEIGHT, INDICES, SCALE],
    dims={"V": (32, 48), "H": (16, 24), "B": (1, 2), "S": (1, 3)},
    check=_check,
)
def embedding(weight, indices, scale=None):
    """``weight[indices]`` (``torch.nn.functional.embedding``), times ``scale`` when the model scales it."""
    out = torch.nn.functional.embedding(indices, weight)
    return out if scale is None else out * scale.to(weight.dtype)


@embedding.implementation("unscaled", inputs=[WEIGHT, INDICES])
def _unscaled(weight, indices):
    return torch.nn.functional.embedding(indices, weight)
