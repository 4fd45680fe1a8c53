"""A functional all-reduce: ``wait_tensor(all_reduce(x, reduce_op, group))``, what tensor parallelism puts after
every row-parallel linear (``o_proj``, ``down_proj``, MoE experts) and after a vocab-parallel embedding.

Both ways the captured steps spell it reach this form: DTensor's ``Partial -> Replicate`` redistribution is the
functional op pair itself; HF's inference path all-reduces the linear's output in place (``dist.all_reduce(out)``,
which dynamo rewrites to the functional pair + ``copy_`` into ``out``) and canonicalization folds that ``copy``.

The process group is not part of the math: the captured op names it by torch's group name, which the match records
(``params["group_name"]``, with ``group_size`` and ``ranks`` resolved in this process). The pattern is traced with
a placeholder group name that differs between the two example traces, so the matcher treats the name as a
wildcard. ``reduce_op`` is one traced variant per reduction. The functions run only inside a process group
(traced on ``meta``: the single-process ``verify_pattern`` cannot run them; ``tests/tp`` checks matches against the
real collective on every rank).
"""
from __future__ import annotations

from typing import Any

import torch

from fusegraph.matching import Input, register_pattern

#: reductions traced as variants (funcol's names; "product"/"band"... are not seen in TP decode steps)
REDUCE_OPS = ("sum", "avg", "max", "min")
#: every variant is traced on meta: the functions need the group they name to run on real tensors
META = "meta"


def placeholder_group(x: torch.Tensor) -> str:
    """A group name for tracing that changes with the example size, so matching does not compare group names."""
    return f"fusegraph.patterns.group{x.shape[-1]}"


def group_params(m: Any, op: str, arg: int) -> dict[str, Any]:
    """``group_name`` (the matched op's constant), plus ``group_size`` and ``ranks`` of that group in this
    process (None when it does not know the group: then the executors could not run it either)."""
    from fusegraph.program.distributed import resolve_group

    name = m.arg(op, arg)
    info = resolve_group(str(name))
    out: dict[str, Any] = {"group_name": name, "ranks": info.ranks}
    if info.size is not None:
        out["group_size"] = info.size
    return out


def _derive(m: Any) -> dict[str, Any]:
    return group_params(m, "_c10d_functional.all_reduce.default", 2)


if torch.distributed.is_available():

    @register_pattern(
        "fusegraph.all_reduce",
        template="all_reduce",
        priority=25,
        inputs=[Input("x", "T H")],
        dims={"T": (1, 3), "H": (16, 40)},
        cases=[{"reduce_op": r, "_device": META} for r in REDUCE_OPS],
        derive=_derive,
        derived=("group_name", "ranks", "group_size"),
    )
    def all_reduce(x, *, reduce_op="sum", group_name=None):
        """``x`` reduced elementwise (``reduce_op``) over the ranks of a process group: every rank gets the result."""
        name = group_name if group_name is not None else placeholder_group(x)
        out = torch.ops._c10d_functional.all_reduce(x, reduce_op, name)
        return torch.ops._c10d_functional.wait_tensor(out)
