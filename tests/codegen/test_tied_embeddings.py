"""Tied embeddings (``tie_word_embeddings=True``, the default of Gemma, Llama-3.2-1B, Qwen2.5-0.5B, Cohere2...): one
model tensor is both the embedding table (gathered by row, as the model stores it) and the lm head's weight (re-laid
out for the matmul). Each use is its own kernel argument with its own layout (``bind.weight_for_use``); an argument
still read both ways is refused at generation (the step falls back) instead of one reader seeing the other's layout.
"""
import os
import sys

import pytest
import torch

from fusegraph.codegen.errors import CodegenError
from fusegraph.patterns.embedding.lowering import Embed
from fusegraph.patterns.linear.lowering import Linear
from fusegraph.codegen.testing import Builder, V

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "matching"))
from fg_cases import decodes_in_one_kernel, hf_case  # noqa: E402

FAMILIES = ["Llama", "Gemma", "Qwen2", "Cohere2"]  # Gemma scales the gathered rows; Cohere2 scales the logits


def _tied_program(b: Builder, table: torch.Tensor, second: bool):
    """embed rows of ``table`` -> x; logits = x @ table.T: the lm head reads ``table`` as the same argument or,
    with ``second``, as a second argument holding the same tensor."""
    w = b.hbm("table", table)
    x = b.new("x", table.shape[1], table.dtype)
    b.ins.append(Embed(ids=b.ids, table=w, out=x, layer=None))
    head = b.hbm("head", table) if second else w
    y = b.new("logits", table.shape[0], table.dtype)
    b.ins.append(Linear(x=x, weight=head, out=y))
    b.store(y)


def test_one_argument_read_as_rows_and_relaid_out_is_refused():
    """The embedding gathers the table as it is; the lm head's spec re-lays the same argument out: before, the
    lm head's layout silently won and the gather read out of bounds. Now generation refuses, naming the argument."""
    b = Builder(tokens=2)
    _tied_program(b, torch.randn(256, 128), second=False)
    with pytest.raises(CodegenError, match="table"):
        b.run()


def test_a_second_argument_per_use_matches_the_reference():
    torch.manual_seed(0)
    table = torch.randn(256, 128)
    b = Builder(tokens=2)
    _tied_program(b, table, second=True)
    gen, results, ref, _ = b.run()
    assert gen.specs["table"].transform is None and gen.specs["head"].transform is not None
    expected = table[:2] @ table.T  # the Builder's ids are 0..T-1
    torch.testing.assert_close(ref["logits"], expected)
    torch.testing.assert_close(results["out_logits"], expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tied_family_runs_as_one_megakernel(family, dtype):
    case = hf_case(family, dtype=dtype, tie_word_embeddings=True)
    model = case.model
    assert model.lm_head.weight is model.get_input_embeddings().weight  # really tied
    stats = decodes_in_one_kernel(case, dtype, steps=4)
    # one model tensor, two kernel arguments: the gathered table as it is, the lm head's re-laid-out copy
    (plan,) = stats.run.plans
    by_node: dict[str, list[str]] = {}
    for name, src in plan.lowered.args.items():
        by_node.setdefault(src.node, []).append(name)
    (tied,) = [names for names in by_node.values() if len(names) > 1]
    roles = sorted(plan.generated.specs[n].role.split(":")[0] for n in tied)
    assert roles == ["linear", "rows"], roles
