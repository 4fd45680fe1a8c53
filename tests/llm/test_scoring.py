"""Honest scoring: outputs must be tensors the kernel allocated and wrote, in-place outputs the buffer it was
given, and rewards are ordered by how close an answer came (cheats and no kernel at the bottom)."""
import json

import pytest
import torch

from fusegraph.llm import evalset, outcome
from fusegraph.llm.harness import verify
from fusegraph.llm.task import KernelTask, TensorSpec
from fusegraph.llm.trajectories import export_experience, rewards_path
from fusegraph.llm.writer import WriterConfig, write_with_config

from . import kernels as K
from .eval_solutions import HEADER, SOLUTIONS
from .fake_llm import FakeLLM


def _task(name: str) -> KernelTask:
    return evalset.select([name])[0].task()


# ---- cheating kernels -----------------------------------------------------------------------------------------
TRANSPOSE_VIEW = HEADER + '''

@nki.jit
def transpose(x):
    return x.ap(pattern=[[1, 384], [384, 256]], offset=0)
'''

SCALE_INTO_INPUT = HEADER + '''

@nki.jit
def scale_matrix(x):
    for r in range(2):
        t = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="t")
        nisa.dma_copy(dst=t, src=x[nl.ds(r * 128, 128), :])
        o = nl.ndarray(shape=(128, 1024), dtype=nl.float32, buffer=nl.sbuf, name="o")
        nisa.tensor_scalar(dst=o, data=t, op0=nl.multiply, operand0=3.5)
        nisa.dma_copy(dst=x[nl.ds(r * 128, 128), :], src=o)
    return x.ap(pattern=[[1024, 256], [1, 1024]], offset=0)
'''

KV_NEW_TENSOR = HEADER + '''

@nki.jit
def kv_row_write(cache, k, pos):
    out = nl.ndarray(shape=(4, 8, 256, 64), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="out")
    nisa.dma_copy(dst=out, src=cache)
    pt = nl.ndarray(shape=(1, 4), dtype=nl.int32, buffer=nl.sbuf, name="pt")
    nisa.dma_copy(dst=pt, src=pos.ap(pattern=[[4, 1], [1, 4]], offset=0))
    for b in range(4):
        kt = nl.ndarray(shape=(8, 64), dtype=nl.bfloat16, buffer=nl.sbuf, name="kt")
        nisa.dma_copy(dst=kt, src=k[b])
        nisa.dma_copy(dst=out.ap(pattern=[[256 * 64, 8], [1, 64]], offset=b * 8 * 256 * 64,
                                 scalar_offset=pt[0:1, b:b + 1], indirect_dim=2), src=kt)
    return out
'''

KV_UNTOUCHED = HEADER + '''

@nki.jit
def kv_row_write(cache, k, pos):
    kt = nl.ndarray(shape=(8, 64), dtype=nl.bfloat16, buffer=nl.sbuf, name="kt")
    nisa.dma_copy(dst=kt, src=k[0])
    return cache
'''

TRANSPOSE_HALF = SOLUTIONS["transpose"].replace("    for r in range(2):\n", "    for r in range(1):\n")

# a compute task whose answer is a view: one dummy instruction used to get it past "computes"
TRANSPOSED_TASK = KernelTask(
    name="transposed", reference_source="def reference(x):\n    return x.t().contiguous()\n",
    reference=lambda x: x.t().contiguous(), inputs=[TensorSpec("x", (4, 64), torch.float32)],
    outputs=[TensorSpec("y", (64, 4), torch.float32)])

TRANSPOSED_DUMMY = HEADER + '''

@nki.jit
def transposed(x):
    t = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="t")
    nisa.dma_copy(dst=t, src=x)
    u = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="u")
    nisa.tensor_scalar(dst=u, data=t, op0=nl.multiply, operand0=1.0)
    return x.ap(pattern=[[1, 64], [64, 4]], offset=0)
'''

CLOBBERS_INPUT = K.GOOD.replace("    nisa.dma_copy(dst=out, src=ys)\n",
                                "    nisa.dma_copy(dst=out, src=ys)\n    nisa.dma_copy(dst=b, src=ys)\n")


@pytest.mark.parametrize("code, task, words", [
    (TRANSPOSE_VIEW, "transpose", "output 'y' is a view of the input 'x'"),
    (SCALE_INTO_INPUT, "scale_matrix", "output 0 is the input 'x' itself, with the result written into it"),
    (TRANSPOSED_DUMMY, TRANSPOSED_TASK, "output 'y' is a view of the input 'x'"),
], ids=["transpose-view", "scale-into-input", "dummy-instruction-view"])
def test_an_output_that_is_an_input_or_a_view_of_one_is_a_cheat(code, task, words):
    task = _task(task) if isinstance(task, str) else task
    v = verify(code, task)
    assert not v.ok and v.stage == "computes" and words in v.reason, v.reason
    assert v.cheat and outcome.reached(v.stage, v.cheat, v.close) == "cheat"
    assert "nl.ndarray(..., buffer=nl.shared_hbm)" in v.detail  # the repair round says what to do


def test_the_reference_solutions_of_the_same_tasks_pass():
    for name in ("transpose", "scale_matrix", "kv_row_write"):
        v = verify(SOLUTIONS[name], _task(name))
        assert v.ok, (name, v.reason)


def test_an_in_place_output_must_be_the_buffer_the_kernel_was_given():
    task = _task("kv_row_write")
    v = verify(KV_NEW_TENSOR, task)  # right values, but in a new tensor: the cache itself is never written
    assert not v.ok and v.stage == "computes" and not v.cheat
    assert "output 'cache' must be the input 'cache' written in place" in v.reason and "a new tensor" in v.reason
    assert outcome.reached(v.stage, v.cheat, v.close) == "contract"
    v = verify(KV_UNTOUCHED, task)  # returns the buffer, but never writes the rows: its contents are compared
    assert not v.ok and v.stage == "compare" and "output 'cache'" in v.reason


def test_writing_an_input_that_is_not_declared_in_place_is_rejected():
    v = verify(CLOBBERS_INPUT, K.scaled_add_task())
    assert not v.ok and v.stage == "computes" and "wrote its input 'b'" in v.reason and not v.cheat


def test_an_output_not_written_in_full_is_wrong():
    v = verify(TRANSPOSE_HALF, _task("transpose"))  # only the first 128 of 256 columns
    assert not v.ok and v.stage == "compare" and "non-finite" in v.reason and not v.cheat
    assert "49152 of them NaN" in v.detail and "never wrote those elements" in v.detail  # 384 x 128 never written


# ---- the reward ladder ----------------------------------------------------------------------------------------
SYNTAX_ERROR = "def scaled_add(x, b:\n    return x\n"
WRONG_ARITY = K.GOOD.replace("def scaled_add(x, b):", "def scaled_add(x, b, c):")
RULE_ERROR = K.GOOD.replace('shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="xs"',
                            'shape=(129, 64), dtype=nl.float32, buffer=nl.sbuf, name="xs"')
CLOSE = K.GOOD.replace("operand0=2.0", "operand0=2.001")
LADDER = [  # (answer, level), worst first
    (K.answer(K.RETURNS_INPUT), "cheat"),
    (K.GARBAGE, "none"),
    (K.answer(SYNTAX_ERROR), "code"),
    (K.answer(K.TORCH_FALLBACK), "parse"),
    (K.answer(K.INVENTED_API), "allow-list"),
    (K.answer(WRONG_ARITY), "conformance"),
    (K.answer(RULE_ERROR), "contract"),
    (K.answer(K.WRONG), "computes"),
    (K.answer(CLOSE), "close"),
    (K.answer(K.GOOD), "correct"),
]


def test_levels_and_rewards_are_ordered_by_how_close_a_kernel_came():
    rewards = [outcome.reward(lv) for lv in outcome.LEVELS]
    assert rewards == sorted(rewards) and rewards[0] == rewards[1] == 0.0  # cheat = no kernel, the floor
    assert len(set(rewards[1:])) == len(rewards) - 1
    # correct: above every wrong answer, and faster = more
    assert outcome.reward("close") < outcome.reward("correct") == 0.9 < outcome.reward("correct", 0.5) \
        < outcome.reward("correct", 1.0) < outcome.reward("correct", 4.0) <= 1.0
    assert outcome.reached("contract", cheat=True) == outcome.reached("computes", cheat=True) == "cheat"
    assert outcome.reached("compare", close=True) == "close" and outcome.reached("reference") is None


def test_reward_records_follow_the_ladder(tmp_path):
    """One conversation with every kind of answer; the exported rewards rise with each level."""
    cfg = WriterConfig(url="", model="fake", max_rounds=len(LADDER) - 1, timeout_s=10, max_tokens=256,
                       run_timeout_s=30, run_memory_mb=4096, cache_dir="", target="trn2", use_cache=False,
                       record_experience=True, experience_dir=str(tmp_path / "exp"))
    with FakeLLM([a for a, _ in LADDER]) as fake:
        result = write_with_config(K.scaled_add_task(), WriterConfig(**{**cfg.__dict__, "url": fake.url}))
    assert result.accepted and [a.level for a in result.attempts] == [lv for _, lv in LADDER], \
        [(a.stage, a.level, a.reason) for a in result.attempts]
    stats = export_experience(tmp_path / "exp", tmp_path / "out.jsonl")
    assert stats.rewards == len(LADDER) and stats.skipped == []
    recs = [json.loads(x) for x in rewards_path(tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["level"] for r in recs] == [lv for _, lv in LADDER]
    got = [r["reward"] for r in recs]
    assert got[0] == got[1] == 0.0 and all(a < b for a, b in zip(got[1:], got[2:])), got
    assert recs[0]["reward"] < 0.6 / 2  # "return the input" earns less than an honest rule error
    assert [r["valid"] for r in recs] == [lv in ("computes", "close", "correct") for _, lv in LADDER]


# ---- provenance ---------------------------------------------------------------------------------------------
def test_export_sft_leaves_benchmark_records_out_unless_asked(tmp_path, capsys):
    from fusegraph.cli import main

    exp = tmp_path / "exp"
    base = dict(model="fake", max_rounds=0, timeout_s=10, max_tokens=256, run_timeout_s=30, run_memory_mb=4096,
                cache_dir="", target="trn2", use_cache=False, record_experience=True, experience_dir=str(exp))
    with FakeLLM([K.answer(K.GOOD), K.answer(K.GOOD)]) as fake:
        assert write_with_config(K.scaled_add_task(), WriterConfig(url=fake.url, **base)).accepted  # a compile
        bench = {"evalset_version": evalset.EVALSET_VERSION, "problem": "scaled_add"}
        assert write_with_config(K.scaled_add_task(), WriterConfig(url=fake.url, origin="llm-eval v1",
                                                                   benchmark=bench, **base)).accepted
    out = tmp_path / "out.jsonl"
    assert main(["export-sft", str(out), "--max", "0", "--no-cards", "--experience", str(exp)]) == 0
    assert "1 llm-eval (benchmark) record(s) left out" in capsys.readouterr().out
    recs = [json.loads(x) for x in rewards_path(out).read_text().splitlines()]
    assert [(r["source"], r["benchmark"]) for r in recs] == [("compile", None)]
    assert main(["export-sft", str(out), "--max", "0", "--no-cards", "--experience", str(exp),
                 "--include-benchmark"]) == 0
    recs = [json.loads(x) for x in rewards_path(out).read_text().splitlines()]
    assert [(r["source"], r["benchmark"]) for r in recs] == [("compile", None), ("llm-eval", bench)]
