"""A plugin whose check raises."""
import torch

from fusegraph.matching import Input, register_pattern


def _check(m):
    raise ValueError("this check is buggy")


@register_pattern("fgbadcheck.exp_add", inputs=[Input("x", "T H"), Input("y", "T H")], priority=40,
                  dtypes=("float32",), check=_check)
def exp_add(x, y):
    return torch.exp(x) + y
