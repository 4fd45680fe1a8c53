"""A functional all-gather along one dim: ``all_gather_into_tensor`` + ``wait_tensor`` + the reshaping that moves the
ranks' blocks from dim 0 (where the collective stacks them) to the gathered dim.

This is DTensor's ``Shard(d) -> Replicate`` redistribution (``funcol.all_gather_single``), as tensor parallelism
captures it: HF's ``colwise_gather_output`` ``lm_head`` (logits gathered over the vocabulary), an
``embedding_colwise`` embedding (hidden dim gathered), ``parallelize_module``'s ``ColwiseParallel(output_layouts=
Replicate())``. torch spells the reshaping three ways, one implementation each:

* ``view``: when every dim before the gathered one has size 1 (a one-token decode step), a reshape
  (``[W, 1, N] -> [1, 1, W*N]``; ``check`` verifies it is that concatenation);
* ``chunk_cat``: otherwise ``cat(chunk(g, W, dim=0), dim=d)``, one traced variant per group size W;
* ``dim0``: gathering along dim 0 needs no reshaping.

Params: ``group_size`` (the op's constant), ``gather_dim`` (negative), ``group_name`` and ``ranks`` (see
``all_reduce.py`` for why the group name is a wildcard and why the functions are traced on ``meta`` only).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fusegraph.matching import Input, register_pattern

from .all_reduce import META, group_params, placeholder_group

#: group sizes with their own traced ``chunk_cat`` variant (the number of chunks is part of the graph)
CHUNK_GROUP_SIZES = (2, 4, 8)
_OP = "_c10d_functional.all_gather_into_tensor.default"


def _gather(x: torch.Tensor, group_size: int, group_name: str | None) -> torch.Tensor:
    name = group_name if group_name is not None else placeholder_group(x)
    out = torch.ops._c10d_functional.all_gather_into_tensor(x, group_size, name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _gather_dim(m: Any) -> int | str:
    """The dim the match concatenates the ranks' blocks along (negative), or why it is not a concatenation."""
    x, out = m.inputs["x"].shape, m.outputs["out"].shape
    w = m.params.get("group_size") or m.arg(_OP, 1)
    if x is None or out is None or len(x) != len(out):
        return f"output {out} is not the input {x} gathered along one dim"
    grown = [d for d in range(len(x)) if out[d] != x[d]]
    if len(grown) != 1 or out[grown[0]] != w * x[grown[0]]:
        return f"output {out} is not the input {x} with one dim times {w}"
    d = grown[0]
    if m.variant.startswith("view") and math.prod(x[:d]) != 1:
        # a view only concatenates rank blocks when every dim before the gathered one has size 1
        return f"a reshape of gathered {x} blocks along dim {d} is not a concatenation (leading dims are not 1)"
    return d - len(x)


def _check(m: Any) -> bool | str:
    d = _gather_dim(m)
    return d if isinstance(d, str) else True


def _derive(m: Any) -> dict[str, Any]:
    out = group_params(m, _OP, 2)
    out["gather_dim"] = _gather_dim(m)
    out["group_size"] = m.arg(_OP, 1)  # the op's own statement (the resolved group has the same size)
    return out


if torch.distributed.is_available():

    @register_pattern(
        "fusegraph.all_gather",
        template="all_gather",
        priority=25,
        inputs=[Input("x", "B S N")],
        params={"group_size": 2},
        dims={"B": (2, 3), "S": (1, 2), "N": (16, 40)},
        cases=[{"group_size": w, "_device": META} for w in CHUNK_GROUP_SIZES],
        check=_check,
        derive=_derive,
        derived=("group_name", "ranks", "group_size", "gather_dim"),
    )
    def all_gather(x, *, group_size=2, group_name=None, gather_dim=-1):
        """The ranks' ``x`` concatenated along ``gather_dim`` (rank order) on every rank of the group."""
        g = _gather(x, group_size, group_name)
        return torch.cat(torch.chunk(g, group_size, dim=0), dim=gather_dim)

    @all_gather.implementation("view", cases=[{"B": 1, "S": 1, "_device": META}])
    def _view(x, *, group_size=2, group_name=None):
        g = _gather(x, group_size, group_name)
        return g.view(1, 1, group_size * x.shape[-1])

    @all_gather.implementation("dim0", cases=[{"_device": META}], inputs=[Input("x", "T N")])
    def _dim0(x, *, group_size=2, group_name=None):
        return _gather(x, group_size, group_name)
