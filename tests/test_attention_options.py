"""The attention templates' switches are options (``attn_*``): they reach codegen through the executor's build, and
they are part of the kernel cache key, so a warm cache never serves a kernel built with other switches (they used to
be module globals of patterns/attention/lowering.py, outside Settings and outside the key)."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from fusegraph import FusegraphWarning
from fusegraph.capture.session import last_session
from fusegraph.patterns.attention import lowering as attention
from fusegraph.executors import kernel_cache
from fusegraph.models import build_decode
from fusegraph.settings import Settings
from fusegraph.warnings import reset_warnings

STREAMED = "cache positions streamed in blocks of"  # the streamed template's comment


@pytest.fixture(scope="module", autouse=True)
def _user_config(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        yield


def test_default_settings_give_the_default_switches():
    """The options' defaults are the module's defaults (a build outside the executors generates the same kernels).
    Since 2026-12-07 the block and row groups are the cost model's choice (block 0, row groups 0, candidates up to
    8,192 positions, the scratch limit derived from the SBUF budget; docs/serving.md)."""
    sw = attention.StreamSwitches.from_settings(Settings())
    assert sw == attention.DEFAULT_SWITCHES == attention.StreamSwitches(
        stream_above=1024, block_max=8192, block=0, paged_block_max=512, scratch_max=0, sbuf_budget=0,
        ring_bytes=2 * 4 * 16 * 1024, pipeline=True, prefetch=True, kt_by_dma=False, row_groups=0)


@pytest.mark.parametrize("option, value", [
    ("attn_stream_above", 0), ("attn_block_max", 1024), ("attn_block", 2048), ("attn_paged_block_max", 256),
    ("attn_stream_scratch_kib", 32), ("attn_pipeline", False), ("attn_prefetch", False),
    ("attn_kt_by_dma", True), ("attn_row_groups", 1),
])
def test_every_switch_is_part_of_the_key(option, value):
    program, region = SimpleNamespace(instructions=[]), SimpleNamespace(matches=[])
    base = kernel_cache.cache_key(program, "trn2", Settings(), region)
    assert kernel_cache.cache_key(program, "trn2", Settings(), region) == base
    assert kernel_cache.cache_key(program, "trn2", Settings().replace(**{option: value}), region) != base


def test_generate_cached_builds_with_the_settings_switches(tmp_path):
    seen = []

    def generate(cached):
        seen.append(attention.switches())
        return SimpleNamespace(source="", program=SimpleNamespace(inputs=[], outputs=[]), constants={}, args=[],
                               name="k", stats={}, budget=None)

    s = Settings.from_options({"cache_dir": "off", "attn": {"pipeline": False, "row_groups": 2}}, env={})
    kernel_cache.generate_cached(s, "key", "k", generate)
    assert seen == [attention.StreamSwitches(pipeline=False, row_groups=2)]
    assert attention.switches() == attention.DEFAULT_SWITCHES  # only for that build


def _step(model, kv, tok, pos):
    return model(input_ids=tok, cache=kv, position_ids=pos, use_cache=True).logits


def _run(cache, **options):
    torch._dynamo.reset()
    reset_warnings()
    case = build_decode("qwen3-tiny", max_cache_len=256)
    ref = case.fork()
    step = torch.compile(_step, backend="fusegraph", dynamic=False,
                         options={"executor": "nkisim", "cache_dir": str(cache), "verify": False, **options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = step(case.model, case.cache, case.token, case.position)
            want = ref.step(ref.token, ref.position)
    s = last_session()
    plans = [p for st in s.program.execution.values() for p in st.run.plans]
    fg = [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]
    return ((got - want).abs().max() / want.abs().max()).item(), plans, fg


def test_a_warm_cache_misses_for_other_switches(tmp_path, monkeypatch):
    """Built with the defaults (single-pass attention: the tiny cache is short), then with every cache streamed
    (attn_stream_above=128): a miss with the streamed kernel, not the cached single-pass one; each right; then each
    setting hits its own entry."""
    monkeypatch.setattr("fusegraph.codegen.registry.templates_hash", lambda: "pinned-by-test_attention_options")
    cache = tmp_path / "cache"
    rel, plans, fg = _run(cache)
    assert rel <= 1e-4 and [p.cache_hit for p in plans] == [False] and not fg
    assert STREAMED not in plans[0].generated.source
    rel, plans, fg = _run(cache, attn_stream_above=128)
    assert rel <= 1e-4 and [p.cache_hit for p in plans] == [False] and not fg, fg
    assert STREAMED in plans[0].generated.source
    assert len(list(cache.glob("*.py"))) == 2
    for options, streamed in (({}, False), ({"attn_stream_above": 128}, True)):
        rel, plans, fg = _run(cache, **options)
        assert [p.cache_hit for p in plans] == [True] and rel <= 1e-4 and not fg
        assert (STREAMED in plans[0].generated.source) == streamed
