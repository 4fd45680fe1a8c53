"""The prompt: rules, the region, its interface, table-generated API facts, verified examples."""
import pytest
import torch

from fusegraph.llm import facts, prompt
from fusegraph.llm.examples import PROMPT_EXAMPLE_KINDS, prompt_example
from fusegraph.llm.harness import verify
from fusegraph.llm.task import KernelTask, TensorSpec
from fusegraph.nkiapi import load_table
from fusegraph.nkiapi.conformance import check_source

from . import kernels as K


def test_messages_carry_the_region_and_its_interface():
    task = KernelTask("softmax rows", "def reference(x, idx):\n    return torch.softmax(x, -1)[idx]\n",
                      lambda x, idx: x, [TensorSpec("x", (8, 32), torch.bfloat16, value_range=(-3, 3)),
                                         TensorSpec("idx", (2,), torch.int64, index=True, value_range=(0, 8))],
                      [TensorSpec("y", (2, 32), torch.bfloat16)], model="qwen3-tiny", context="router softmax")
    msgs = prompt.build_messages(task)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert prompt.rules_text().strip() in msgs[0]["content"]
    user = msgs[-1]["content"]
    assert task.reference_source.strip() in user and "qwen3-tiny" in user and "router softmax" in user
    assert "- `x`: bfloat16 [8, 32], values in [-3, 3]" in user
    assert "- `idx`: int32 [2] (int64 in the reference), indices in [0, 8)" in user
    assert "- `y`: bfloat16 [2, 32], a new nl.shared_hbm tensor" in user
    assert "Write `@nki.jit def softmax_rows(x, idx)`." in user
    for name in ("nisa.tensor_reduce(", "nisa.reciprocal(", "nisa.activation("):
        assert name in user
    assert "nisa.nc_matmul(" not in user  # not needed by a softmax
    assert len("".join(m["content"] for m in msgs)) < 20_000


def test_repair_message_is_bounded():
    msg = prompt.repair_message("compare", "x" * 10_000)
    assert "rejected (compare)" in msg and "[... truncated]" in msg and len(msg) < 4_300


def test_fact_signatures_conform_to_both_tables():
    t3, t6 = load_table("0.3.0"), load_table("0.6.0")
    for q in facts.card_functions():
        sig = facts.signature(q)
        module, _, name = q.rpartition(".")
        names = [p.split("=")[0] for p in sig[sig.index("(") + 1:-1].split(", ") if p]
        for tab in (t3, t6):
            fn = tab.function(module, name)
            assert all(fn.param(n) is not None for n in names), (q, tab.version)
        # a keyword call written from the signature conforms to both versions
        call = f"{facts.short_name(q)}(" + ", ".join(f"{n}={n}" for n in names if "=" not in n) + ")"
        src = "import nki\nimport nki.language as nl\nimport nki.isa as nisa\n" + call + "\n"
        assert check_source(src) == [], (q, check_source(src))
    assert "priority" not in facts.signature("nki.isa.dma_copy")  # 0.6-only parameter left out
    with pytest.raises(KeyError):
        facts.signature("nki.isa.topk")  # 0.6 only


@pytest.mark.parametrize("kind", PROMPT_EXAMPLE_KINDS)
def test_prompt_examples_are_verified(kind):
    ex = prompt_example(kind)
    v = verify(ex.source, ex.task)
    assert v.ok, v.detail


def test_example_choice_follows_the_region():
    lin = K.scaled_add_task()
    lin.reference_source = "def reference(x, b):\n    return F.linear(x, b)\n"
    assert [e.kind for e in prompt.pick_examples(lin)] == ["linear"]
    assert [e.kind for e in prompt.pick_examples(K.scaled_add_task())] == ["gated_act"]
    norm = K.scaled_add_task()
    norm.reference_source = "def reference(x, b):\n    return b @ (x * torch.rsqrt(x.pow(2).mean(-1)))\n"
    assert [e.kind for e in prompt.pick_examples(norm)] == ["linear", "rmsnorm"]
