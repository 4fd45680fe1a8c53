"""`fusegraph export-sft`: the default sweep exports, and every record of the file re-verifies."""
import json

from fusegraph.cli import main
from fusegraph.llm import facts
from fusegraph.llm.examples import SWEEPS
from fusegraph.llm.sft import meta_path, reverify


def test_export_writes_verified_examples_that_reverify(tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    assert main(["export-sft", str(out)]) == 0
    assert f"wrote {len(SWEEPS['small'])} verified kernel example(s)" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    metas = [json.loads(x) for x in meta_path(out).read_text().splitlines()]
    assert len(lines) == len(metas) == len(SWEEPS["small"]) + len(facts.card_functions()) + 1
    kinds = {m["example"] for m in metas if m["kind"] == "kernel"}
    assert kinds == {"gated_act", "rmsnorm", "rmsnorm_heads", "linear", "rope", "attention", "router_experts", "generic"}
    for line in lines:
        rec = json.loads(line)
        assert list(rec) == ["messages"]
        assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant"]
    first = json.loads(lines[0])["messages"]
    assert "PyTorch reference:" in first[1]["content"] and first[2]["content"].startswith("```python\n")
    results = reverify(out)
    assert len(results) == len(lines)
    bad = [(i, k, v.reason) for i, k, v in results if not v.ok]
    assert bad == []
    assert sum(k == "kernel" for _, k, _ in results) == len(SWEEPS["small"])


def test_reverify_catches_a_tampered_example(tmp_path):
    out = tmp_path / "one.jsonl"
    assert main(["export-sft", str(out), "--max", "1", "--no-cards"]) == 0
    rec = json.loads(out.read_text())
    answer = rec["messages"][2]["content"]
    assert "op=nl.multiply" in answer
    rec["messages"][2]["content"] = answer.replace("op=nl.multiply", "op=nl.add")
    out.write_text(json.dumps(rec) + "\n")
    ((_, kind, verdict),) = reverify(out)
    assert kind == "kernel" and not verdict.ok and verdict.stage == "compare"


def test_max_and_seed_pick_a_subset(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["export-sft", str(a), "--max", "2", "--seed", "7", "--no-cards"]) == 0
    assert main(["export-sft", str(b), "--max", "2", "--seed", "7", "--no-cards"]) == 0
    assert len(a.read_text().splitlines()) == 2 and a.read_text() == b.read_text()
    names = [json.loads(x)["name"] for x in meta_path(a).read_text().splitlines()]
    assert names != [s[0](**s[1]).task.name for s in SWEEPS["small"][:2]]  # shuffled before the cap
