"""The Python reference VM: run a :class:`~.ir.KernelProgram` instruction by instruction in PyTorch.

Each instruction implements its own ``reference(env)`` (next to its template, in its op folder ``fusegraph.patterns.<op>``)
with the same dtype chain as the HF code it replaces, on logical values (activations ``[T, F]``, HBM tensors in
model shapes). Two uses: template tests compare the generated kernel with it, and
:mod:`fusegraph.codegen.bisect` compares it (and the kernel) with eager values op by op.
"""
from __future__ import annotations

from typing import Callable

import torch

from fusegraph.matching.activations import ALIASES, TABLE

from . import ir

#: slot activation name -> torch callable (from the one activation table)
ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {a.name: a.fn for a in TABLE if a.slot}
ACT_FNS.update({alias: ACT_FNS[name] for alias, name in ALIASES.items()})


def run(program: ir.KernelProgram, env: dict[str, torch.Tensor],
        on_instruction: Callable[[int, ir.Instruction, dict], None] | None = None) -> dict[str, torch.Tensor]:
    """Execute every instruction; ``env`` maps value names to tensors (HBM inputs in model layout, state is
    updated in place). Returns ``env`` with every produced value."""
    for i, ins in enumerate(program.instructions):
        ins.reference(env)
        if on_instruction is not None:
            on_instruction(i, ins, env)
    return env


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
