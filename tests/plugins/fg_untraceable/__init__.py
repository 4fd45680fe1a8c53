"""A plugin whose pattern cannot be traced (data-dependent Python control flow)."""
from fusegraph.matching import Input, Pattern


def _bad(x):
    if x.sum() > 0:  # needs real data: not traceable with fake tensors
        return x * 2
    return x


def make_patterns():
    return [Pattern(name="fguntraceable.branchy", fn=_bad, inputs=[Input("x", "T H")], dtypes=("float32",))]
