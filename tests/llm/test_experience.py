"""Experience data: the writer records its conversations; export-sft turns them into repair trajectories and
reward records that re-verify."""
import json

import pytest

from fusegraph.cli import main
from fusegraph.llm import write_kernel
from fusegraph.llm.experience import default_dir, load, request_messages, task_from_json, task_to_json
from fusegraph.llm.trajectories import (export_experience, reverify_trajectories, rewards_path,
                                        trajectories_meta_path, trajectories_path)
from fusegraph.llm.writer import WriterConfig, write_with_config

from . import kernels as K
from .fake_llm import FakeLLM, refused_url


def test_writer_records_each_answer_the_error_sent_back_and_the_next_answer(llm_settings, tmp_path):
    with FakeLLM([K.answer(K.WRONG), K.answer(K.GOOD)]) as fake:
        result = write_kernel(K.scaled_add_task(), llm_settings(fake.url, max_rounds=1))
    assert result.accepted and result.experience_path
    ((path, rec),) = list(load(default_dir(str(tmp_path / "cache"))))
    assert str(path) == result.experience_path
    assert rec["accepted"] and rec["llm_model"] == "fake-nki-coder" and rec["origin"] == "compile"
    first, second = rec["attempts"]
    assert first["answer"] == K.answer(K.WRONG) and first["code"] == K.WRONG and first["stage"] == "compare"
    assert "max |kernel - reference|" in first["detail"]
    # the feedback is exactly the repair turn the model received, and the requests are reconstructible
    assert first["feedback"] == fake.requests[1]["messages"][-1]["content"]
    assert "rejected (compare)" in first["feedback"]
    assert request_messages(rec, 0) == fake.requests[0]["messages"]
    assert request_messages(rec, 1) == fake.requests[1]["messages"]
    assert second["accepted"] and second["code"] == K.GOOD and second["feedback"] == ""
    # the report view stays free of model text
    assert set(result.to_dict()["attempts"][0]) == {"round", "accepted", "reason", "stage", "tokens", "prompt_tokens",
                                                    "completion_tokens", "seconds", "max_abs_diff", "level"}


def test_cache_hits_and_dead_endpoints_record_nothing(llm_settings, tmp_path):
    with FakeLLM([K.answer(K.GOOD)]) as fake:
        s = llm_settings(fake.url)
        write_kernel(K.scaled_add_task(), s)
        hit = write_kernel(K.scaled_add_task(), s)
    dead = write_kernel(K.scaled_add_task(rows=8), llm_settings(refused_url()))
    assert hit.from_cache and not hit.experience_path and not dead.experience_path
    assert len(list(load(default_dir(str(tmp_path / "cache"))))) == 1


def test_task_json_round_trip_keeps_constants_and_reference():
    import torch

    from fusegraph.llm.examples import rmsnorm

    task = rmsnorm(T=1, F=256, dtype=torch.float32).task
    back = task_from_json(json.loads(json.dumps(task_to_json(task))))
    assert back.inputs == task.inputs and back.outputs == task.outputs and back.cases == task.cases
    assert torch.equal(back.inputs[-1].fixed, task.inputs[-1].fixed)
    x = [torch.randn(s.shape).to(s.dtype) if s.is_float else torch.zeros(s.shape, dtype=s.dtype) for s in task.inputs]
    x[-1] = task.inputs[-1].fixed
    assert torch.equal(back.reference(*x), task.reference(*x))


def _record(answers, exp_dir, rounds=1):
    with FakeLLM(answers) as fake:
        cfg = WriterConfig(url=fake.url, model="fake-nki-coder", max_rounds=rounds, timeout_s=10, max_tokens=512,
                           run_timeout_s=30, run_memory_mb=4096, cache_dir="", target="trn2", use_cache=False,
                           experience_dir=str(exp_dir))
        return write_with_config(K.scaled_add_task(), cfg)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Five recorded conversations exported through the CLI: three repairs, one first-try success, one failure."""
    root = tmp_path_factory.mktemp("experience")
    exp = root / "exp"
    assert _record([K.answer(K.WRONG), K.answer(K.GOOD)], exp).accepted                 # compare -> fixed
    assert _record([K.answer(K.INVENTED_API), K.answer(K.GOOD)], exp).accepted          # conformance -> fixed
    assert _record([K.GARBAGE, K.answer(K.GOOD)], exp).accepted                         # extract -> fixed
    assert _record([K.answer(K.GOOD)], exp, rounds=0).accepted                          # right first time
    assert not _record([K.answer(K.TORCH_FALLBACK), K.answer(K.WRONG)], exp).accepted   # never fixed
    out = root / "sft.jsonl"
    assert main(["export-sft", str(out), "--max", "0", "--no-cards", "--experience", str(exp)]) == 0
    return out, exp


def test_export_writes_one_trajectory_per_successful_repair(exported):
    out, _ = exported
    lines = trajectories_path(out).read_text().splitlines()
    metas = [json.loads(x) for x in trajectories_meta_path(out).read_text().splitlines()]
    assert len(lines) == len(metas) == 3
    assert [m["failed_stage"] for m in metas] == ["compare", "conformance", "extract"]
    for line, meta in zip(lines, metas):
        msgs = json.loads(line)["messages"]
        roles = [m["role"] for m in msgs]
        assert roles[0] == "system" and roles[-3:] == ["assistant", "user", "assistant"]
        assert f"rejected ({meta['failed_stage']})" in msgs[-2]["content"]
        assert K.GOOD.strip() in msgs[-1]["content"]
        # only the corrected kernel is a training target
        assert [m["weight"] for m in msgs if m["role"] == "assistant"][-1] == 1
        assert all(m["weight"] == 0 for m in msgs[:-1] if m["role"] == "assistant")
        assert all("weight" not in m for m in msgs if m["role"] != "assistant")
    assert "fused_scale_add" in json.loads(lines[1])["messages"][-3]["content"]


def test_exported_trajectories_reverify(exported):
    out, _ = exported
    checks = reverify_trajectories(trajectories_path(out))
    assert len(checks) == 3
    assert all(c.ok for c in checks), [(c.line, c.fixed.reason, c.failed_stage, c.recorded_stage) for c in checks]
    assert [c.failed_stage for c in checks] == ["compare", "conformance", "extract"]
    assert all(c.fixed.stage == "accepted" for c in checks)


def test_reverify_catches_tampered_trajectories(exported, tmp_path):
    out, _ = exported
    lines = trajectories_path(out).read_text().splitlines()
    metas = trajectories_meta_path(out).read_text().splitlines()
    bad_fix = json.loads(lines[0])
    bad_fix["messages"][-1]["content"] = K.answer(K.WRONG)  # the "corrected" kernel is wrong
    bad_fail = json.loads(lines[1])
    bad_fail["messages"][-3]["content"] = K.answer(K.GOOD)  # the "failing" answer passes
    t = tmp_path / "t.trajectories.jsonl"
    t.write_text(json.dumps(bad_fix) + "\n" + json.dumps(bad_fail) + "\n")
    trajectories_meta_path(tmp_path / "t.jsonl").write_text(metas[0] + "\n" + metas[1] + "\n")
    first, second = reverify_trajectories(t)
    assert not first.ok and first.fixed.stage == "compare"
    assert not second.ok and second.fixed.ok and second.failed_stage == "accepted"
    assert second.recorded_stage == "conformance"


def test_reward_records_one_per_answer(exported):
    out, _ = exported
    recs = [json.loads(x) for x in rewards_path(out).read_text().splitlines()]
    assert len(recs) == 9  # 2 + 2 + 2 + 1 + 2 answers
    by_stage = {}
    for r in recs:
        by_stage.setdefault(r["stage"], []).append(r)
        assert r["messages"][-1]["role"] == "user" and r["completion"]
        assert r["valid"] == (r["stage"] in ("compare", "accepted")) and r["correct"] == (r["stage"] == "accepted")
    assert sorted(by_stage) == ["accepted", "compare", "conformance", "extract", "safety"]
    # rewards follow the level ladder (fusegraph/llm/outcome.py); a correct one grows with the modeled speedup
    assert all(r["reward"] == pytest.approx(0.9 + 0.1 * r["speedup"] / (1 + r["speedup"]), abs=1e-4)
               for r in by_stage["accepted"])
    assert {(r["level"], r["reward"]) for r in by_stage["compare"]} == {("computes", 0.6)}  # 2.5 x for 2.0 x
    assert {(r["level"], r["reward"]) for r in by_stage["conformance"]} == {("allow-list", 0.3)}
    assert {(r["level"], r["reward"]) for r in by_stage["safety"]} == {("parse", 0.2)}
    assert {(r["level"], r["reward"]) for r in by_stage["extract"]} == {("none", 0.0)}
    assert all(r["source"] == "compile" and r["benchmark"] is None for r in recs)
    assert all(r["speedup"] > 0 for r in by_stage["accepted"])
    assert all(r["speedup"] is None for s, rs in by_stage.items() if s != "accepted" for r in rs)
    # the first answers of the five conversations answered the same request: one prompt id
    firsts = [r for r in recs if r["round"] == 1]
    assert len(firsts) == 5 and len({r["prompt_id"] for r in firsts}) == 1


def test_export_skips_records_that_no_longer_reproduce(exported, tmp_path):
    _, exp = exported
    paths = [p for p, _ in load(exp)]
    work = tmp_path / "exp"
    work.mkdir()
    rec = json.loads(paths[0].read_text())  # WRONG -> GOOD
    rec["attempts"][1]["code"] = K.WRONG  # the recorded accepted kernel is not what passed
    (work / paths[0].name).write_text(json.dumps(rec))
    rec = json.loads(paths[1].read_text())  # INVENTED_API -> GOOD
    rec["attempts"][0]["answer"] = K.answer(K.GOOD)  # the recorded failure would pass now
    (work / paths[1].name).write_text(json.dumps(rec))
    stats = export_experience(work, tmp_path / "o.jsonl")
    assert (stats.records, stats.trajectories) == (2, 0)
    reasons = " ".join(r for _, r in stats.skipped)
    assert "no longer passes" in reasons and "now stops at accepted, recorded conformance" in reasons
