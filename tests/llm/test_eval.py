"""`fusegraph llm-eval` against a scripted OpenAI-compatible endpoint: right, wrong and invalid answers."""
import json
import math

import pytest

from fusegraph.cli import main
from fusegraph.llm import evalset
from fusegraph.llm.evaluate import evaluate
from fusegraph.llm.experience import load
from fusegraph.llm.harness import verify
from fusegraph.llm.trajectories import export_experience, reverify_trajectories, trajectories_path

from .eval_solutions import SOLUTIONS
from .fake_llm import FakeLLM, refused_url
from .kernels import GARBAGE, answer

WRONG_LAYERNORM = SOLUTIONS["layernorm"].replace(
    "        nisa.tensor_tensor(dst=o, data1=o, data2=bt, op=nl.add)\n", "")  # forgets the bias
NUMPY_CUMSUM = SOLUTIONS["cumsum"].replace("import nki\n", "import numpy as np\nimport nki\n", 1)
INVENTED_CUMSUM = SOLUTIONS["cumsum"].replace("nisa.tensor_tensor_scan(", "nisa.tensor_cumsum(")
WRONG_TOPK = SOLUTIONS["topk"].replace("nisa.tensor_copy(dst=i32, src=i)",
                                       "nisa.tensor_scalar(dst=i32, data=i, op0=nl.add, operand0=1.0)")  # off by one


def _usage(request: dict, text: str) -> int:
    """The token count tests/llm/fake_llm.py reports for one request and its answer."""
    return sum(len(m.get("content", "")) for m in request["messages"]) // 4 + len(text) // 4


@pytest.fixture
def no_user_cache(tmp_path, monkeypatch):
    """Point the default kernel cache at an empty directory: an eval must neither read nor write it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_eval_counts_right_wrong_and_invalid_answers(no_user_cache, tmp_path):
    script = [
        answer(SOLUTIONS["row_softmax"]),                     # right first time
        answer(WRONG_LAYERNORM), answer(SOLUTIONS["layernorm"]),  # wrong numbers, repaired
        answer(NUMPY_CUMSUM), answer(INVENTED_CUMSUM),         # invalid twice: allow-list, then conformance
        GARBAGE, answer(WRONG_TOPK),                           # no code, then valid NKI with wrong indices
    ]
    texts = list(script)
    with FakeLLM(script) as fake:
        report = evaluate(fake.url, "fake-coder", rounds=1, problems=["row_softmax", "layernorm", "cumsum", "topk"],
                          experience_dir=str(tmp_path / "exp"))
    by = {r.problem: r for r in report.results}
    assert list(by) == ["row_softmax", "layernorm", "cumsum", "topk"]
    sm, ln, cs, tk = by["row_softmax"], by["layernorm"], by["cumsum"], by["topk"]
    assert (sm.valid, sm.correct, sm.first_valid, sm.first_correct, sm.requests, sm.repair_rounds) == \
        (True, True, True, True, 1, 0)
    assert (ln.valid, ln.correct, ln.first_valid, ln.first_correct, ln.requests, ln.repair_rounds) == \
        (True, True, True, False, 2, 1)
    assert [a["stage"] for a in ln.attempts] == ["compare", "accepted"]
    assert (cs.valid, cs.correct, cs.stage, cs.reached) == (False, False, "conformance", "allow-list")
    assert [a["stage"] for a in cs.attempts] == ["safety", "conformance"]
    assert (tk.valid, tk.correct, tk.first_valid, tk.stage, tk.reached) == (True, False, False, "compare", "computes")
    assert "'indices'" in tk.reason
    # tokens are the endpoint's usage, request by request
    assert len(fake.requests) == 7
    expected = [_usage(req, text) for req, text in zip(fake.requests, texts)]
    got = [a["tokens"] for r in report.results for a in r.attempts]
    assert got == expected and all(t > 0 for t in got)
    # the modeled speedup exists exactly for the correct problems
    assert sm.speed.speedup > 0 and ln.speed.speedup > 0
    assert cs.speed.speedup is None and tk.speed.speedup is None
    assert sm.speed.kernel_s > 0 and sm.speed.baseline_s > 0
    t = report.totals()
    assert (t["problems"], t["valid"], t["correct"], t["first_try_valid"], t["first_try_correct"]) == (4, 3, 2, 2, 1)
    assert (t["requests"], t["repair_rounds"], t["tokens"], t["endpoint_errors"]) == (7, 3, sum(expected), 0)
    assert t["modeled_speedup_geomean"] == pytest.approx(math.sqrt(sm.speed.speedup * ln.speed.speedup), rel=1e-3)
    table = report.format()
    assert "total (4)" in table and "3/4" in table and "2/4" in table and "modeled" in table
    json.dumps(report.to_dict())
    # no kernel cache was read or written; every conversation was recorded as experience
    assert not (no_user_cache / "fusegraph").exists()
    recs = [rec for _, rec in load(tmp_path / "exp")]
    assert sorted(r["task"]["name"] for r in recs) == ["cumsum", "layernorm", "row_softmax", "topk"]
    assert {r["origin"] for r in recs} == {f"llm-eval v{evalset.EVALSET_VERSION}"}
    # every record names its benchmark problem
    assert {r["source"] for r in recs} == {"llm-eval"}
    assert sorted(r["benchmark"]["problem"] for r in recs) == ["cumsum", "layernorm", "row_softmax", "topk"]
    assert {r["benchmark"]["evalset_version"] for r in recs} == {evalset.EVALSET_VERSION}
    # the benchmark is the test set: by default nothing of it is exported for training
    stats = export_experience(tmp_path / "exp", tmp_path / "default.jsonl")
    assert (stats.records, stats.trajectories, stats.rewards, stats.benchmark_excluded) == (4, 0, 0, 4)
    assert "llm-eval (benchmark) record(s) left out" in stats.summary()
    assert trajectories_path(tmp_path / "default.jsonl").read_text() == ""
    # ... explicitly included: layernorm's repair is a trajectory that re-verifies, every answer a reward
    # record, each marked with its provenance
    stats = export_experience(tmp_path / "exp", tmp_path / "sft.jsonl", include_benchmark=True)
    assert (stats.records, stats.trajectories, stats.rewards, stats.skipped) == (4, 1, 7, [])
    (check,) = reverify_trajectories(trajectories_path(tmp_path / "sft.jsonl"))
    assert check.ok and check.recorded_stage == "compare" and check.fixed.ok
    out = tmp_path / "sft.jsonl"
    meta = [json.loads(x) for x in out.with_name("sft.trajectories.meta.jsonl").read_text().splitlines()]
    rewards = [json.loads(x) for x in out.with_name("sft.rewards.jsonl").read_text().splitlines()]
    assert [(m["source"], m["benchmark"]["problem"]) for m in meta] == [("llm-eval", "layernorm")]
    assert {r["source"] for r in rewards} == {"llm-eval"} and all(r["benchmark"]["problem"] == r["task"]
                                                                  for r in rewards)


def test_rounds_zero_is_the_model_alone_and_no_cache_is_reused(no_user_cache):
    with FakeLLM([answer(WRONG_TOPK), answer(SOLUTIONS["topk"]), answer(SOLUTIONS["topk"])]) as fake:
        wrong = evaluate(fake.url, "m", rounds=0, problems=["topk"])
        first = evaluate(fake.url, "m", rounds=0, problems=["topk"])
        again = evaluate(fake.url, "m", rounds=0, problems=["topk"])  # same task, same model: asked again
    assert len(fake.requests) == 3  # one request per run: no repair round, no cache hit
    assert (wrong.results[0].requests, wrong.results[0].correct, wrong.results[0].valid) == (1, False, True)
    assert first.results[0].correct and again.results[0].correct
    assert not (no_user_cache / "fusegraph").exists()


def test_cli_writes_json_and_a_table(no_user_cache, tmp_path, capsys):
    out = tmp_path / "eval.json"
    with FakeLLM([answer(SOLUTIONS["topk"])]) as fake:
        code = main(["llm-eval", "--url", fake.url, "--model", "fake-coder", "--rounds", "0", "--problems", "topk",
                     "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "fusegraph llm-eval v1: fake-coder" in text and "topk" in text and "total (1)" in text
    data = json.loads(out.read_text())
    assert data["evalset_version"] == evalset.EVALSET_VERSION and data["rounds"] == 0
    assert data["totals"]["correct"] == 1 and data["totals"]["valid"] == 1
    (row,) = data["problems"]
    assert row["problem"] == "topk" and row["correct"] and row["modeled_speedup"] > 0
    assert row["modeled_kernel_us"] > 0 and row["modeled_baseline_us"] > 0
    assert "answer" not in row["attempts"][0]  # answers stay out of the report


def test_cli_list_unknown_problem_and_dead_endpoint(capsys):
    assert main(["llm-eval", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(n in listed for n in evalset.problem_names())
    assert main(["llm-eval", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--problems", "softmax"]) == 2
    assert "unknown problem" in capsys.readouterr().err
    assert main(["llm-eval", "--problems", "topk"]) == 2  # no endpoint given
    assert main(["llm-eval", "--url", refused_url(), "--model", "m", "--problems", "topk,cumsum"]) == 1
    text = capsys.readouterr().out
    assert "2 endpoint error(s)" in text and "0/2" in text


def test_lnc2_problems_are_launched_as_kernel_2():
    lnc2, lnc1 = evalset.row_softmax(2), evalset.row_softmax(1)
    v = verify(SOLUTIONS["row_softmax_lnc2"], lnc2)
    assert v.ok, v.detail
    assert v.profile["lnc"] == 2 and v.profile["program_instructions"][0] == v.profile["program_instructions"][1] > 0
    # the same kernel launched with one program computes only program 0's rows
    v1 = verify(SOLUTIONS["row_softmax_lnc2"], lnc1)
    assert not v1.ok and v1.stage == "compare"


def test_lnc2_prompt_and_cache_key():
    from fusegraph.llm.cache import cache_key
    from fusegraph.llm.prompt import task_message

    msg = task_message(evalset.rmsnorm(2))
    assert "`rmsnorm_lnc2[2](...)`" in msg and "nl.program_id(axis=0)" in msg
    assert "[2](...)" not in task_message(evalset.rmsnorm(1))
    a, b = evalset.rmsnorm(1), evalset.rmsnorm(2)
    b.name = a.name
    assert cache_key(a, "m", "v", "trn2") != cache_key(b, "m", "v", "trn2")
