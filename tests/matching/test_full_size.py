"""Full-size Qwen3-30B-A3B decode step on the meta device: 48 layers in one region, matched within the time target."""
import time

import pytest

from fusegraph import capture_step
from fusegraph.matching import analyze
from fusegraph.models import build_decode

from fg_cases import EAGER


@pytest.mark.slow
def test_qwen3_30b_a3b_full_size():
    case = build_decode("qwen3-30b-a3b", max_cache_len=4096)
    cap = capture_step(case.step, case.token, case.position, options=EAGER)
    analyze(cap.program)  # patterns traced (or loaded) once
    t0 = time.perf_counter()
    a = analyze(cap.program)
    elapsed = time.perf_counter() - t0
    assert elapsed <= 5.0, a.timings
    assert cap.program.layers() == list(range(48))
    assert a.coverage == 1.0 and len(a.regions) == 1 and a.regions[0].kind == "decoder_stack"
    counts = a.pattern_counts()
    assert counts["fusegraph.rmsnorm"] == 48 * 4 + 1 and counts["fusegraph.moe_experts"] == 48
    assert counts["fusegraph.linear"] == 48 * 4 + 1 and counts["fusegraph.decode_attention"] == 48
    assert all(a.pattern_counts(layer) == a.pattern_counts(0) for layer in range(48))
