"""Generic lowering: unmatched elementwise chains and feature reductions run as NKI, equal to eager."""
from dataclasses import dataclass, field

import pytest
import torch

from fusegraph import capture_step
from fusegraph.codegen import lowering
from fusegraph.codegen.generic import find_pieces, supports
from fusegraph.codegen.megakernel import generate
from fusegraph.nkisim.torch_io import InterpretedKernel


@dataclass(frozen=True)
class _Pat:
    name: str = "fusegraph.generic"
    template: str = "generic"


@dataclass
class _Match:
    params: dict
    nodes: frozenset
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    layer: int | None = 0
    module: str | None = "test"
    pattern: _Pat = _Pat()


@dataclass
class _B:
    node: str


@dataclass
class _Region:
    matches: list
    outputs: list
    id: int = 0
    glue_nodes: tuple = ()


class Custom(torch.nn.Module):
    def __init__(self, F):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(F) * 0.1 + 1)

    def forward(self, x):
        act = x * torch.sigmoid(1.702 * x)  # quick-gelu: no pattern covers it
        var = x.float().pow(2).mean(-1, keepdim=True)  # a norm written by hand, with a twist
        y = (x.float() / torch.sqrt(var + 1e-5)).to(x.dtype) * (1.0 + self.w)
        return act - 0.5 * y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2])
def test_generic_piece_matches_eager(dtype, T):
    torch.manual_seed(0)
    mod = Custom(256).to(dtype)
    x = torch.randn(T, 1, 256, dtype=dtype)
    with torch.no_grad():
        expected = mod(x)
    cap = capture_step(mod, x, options={"executor": "eager"})
    G = cap.program.graph
    ops = [n for n, d in G.nodes(data=True) if d["kind"] == "op"]
    assert all(supports(G, n) for n in ops), [G.nodes[n]["op"] for n in ops if not supports(G, n)]
    pieces = find_pieces(G, set(ops))
    assert len(pieces) == 1
    piece = pieces[0]
    out_node = cap.program.graphs[0].outputs[0].node
    region = _Region([_Match(params={"piece": piece}, nodes=frozenset(piece.nodes))], [_B(out_node)])
    low = lowering.lower_region(cap.program, region, tokens=T)
    gen = generate(low.program)
    k = InterpretedKernel(gen)
    tensors = {}
    for name, src in low.args.items():
        d = G.nodes[src.node]
        pos = d["position"]
        tensors[name] = [mod.w.detach(), x][0 if d["input_kind"].value == "weight" else 1]
        assert pos in (0, 1)
    outs = k(k.prepare(tensors))
    got = outs[0].reshape(expected.shape)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
