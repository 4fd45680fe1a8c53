"""The hand-written GPT-OSS-20B megakernel (KevGomes1403/nki-moe-megakernel, ``megakernels/gpt_oss``) runs unmodified
in the interpreter, shape-only, as one rank of its TP=8 x LNC=1 deployment (fusegraph.perf.against_specs_gpt_oss).

Needs checkouts: ``MK_GPTOSS`` (or ``MK``) holding the kernel -- commit 9a3c4b5 is the tree the published exp-7 profile ran --
and ``NKILIB`` holding nki-library's ``nkilib``; skipped without them. Two layers run in a few seconds."""
import os

import pytest

SPEC = "fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel"
KERNEL = "megakernels/gpt_oss/transformer_gpt_oss.py"
US = 1e6
#: weight bytes one rank reads per layer: fused QKV [3072, 640] + O [512, 3072] + router [3072, 32] + 4 of the 32
#: experts' gate/up [3072, 2, 384] and down [384, 3072], bf16 (biases, norms and KV caches are < 0.3 MB more)
WEIGHT_BYTES_PER_LAYER = 2 * (3072 * 640 + 512 * 3072 + 3072 * 32 + 4 * (3072 * 2 * 384 + 384 * 3072))


def _checkout() -> str | None:
    """The checkout the spec reads: MK_GPTOSS when set, else MK."""
    path = os.environ.get("MK_GPTOSS") or os.environ.get("MK")
    return path if path and os.path.exists(os.path.join(path, KERNEL)) else None


def test_spec_says_which_checkout_is_missing(monkeypatch):
    from fusegraph.perf.against_specs_gpt_oss import gpt_oss_megakernel

    monkeypatch.delenv("MK_GPTOSS", raising=False)
    monkeypatch.delenv("MK", raising=False)
    with pytest.raises(RuntimeError, match="MK_GPTOSS"):
        gpt_oss_megakernel(layers=1)


@pytest.fixture(scope="module")
def two_layers():
    if _checkout() is None or not os.path.isdir(os.path.join(os.environ.get("NKILIB", ""), "nkilib")):
        pytest.skip("set MK_GPTOSS (or MK) to a nki-moe-megakernel checkout with megakernels/gpt_oss, and NKILIB")
    from fusegraph.perf.against import load_spec, run_spec
    from fusegraph.perf.costmodel import estimate_kernel
    from fusegraph.perf.kernelview import view_from_trace
    from fusegraph.perf.params import load_params

    spec = load_spec(SPEC, layers=2)
    prof = run_spec(spec)
    est = estimate_kernel(view_from_trace(prof.trace[(0, 0)], filename=spec.name), load_params("trn3"))
    return spec, prof, est


def test_kernel_runs_from_the_checkout_with_layers_attributed(two_layers):
    spec, prof, est = two_layers
    assert spec.shard == (8, 1) and spec.lnc == 1 and spec.layers == 2
    body = spec.kernel.func.__globals__["_multilayer_body"].__code__.co_filename
    assert os.path.realpath(body) == os.path.realpath(os.path.join(_checkout(), KERNEL))
    events = prof.trace[(0, 0)]
    assert len(events) > 2000  # ~1,400 instructions per layer, most of them the experts' matmuls
    assert sorted(k for k in est.layers if isinstance(k, int)) == [0, 1]
    assert sum(1 for e in events if e.layer is None) < 50  # only the residual load/store and masks outside layers
    files = {os.path.basename(e.file) for e in events}
    assert {"transformer_gpt_oss.py", "attention_tkg.py", "selective_expert_impl.py"} <= files
    for layer in (0, 1):
        b = est.layers[layer]
        assert b.wall > 0 and b.busy["tensor"] > 0 and b.busy.get("sync", 0) > 0


def test_top4_experts_are_read_not_all_32(two_layers):
    _, prof, _ = two_layers
    per_layer = prof.hbm_read_bytes / 2
    assert WEIGHT_BYTES_PER_LAYER <= per_layer <= 1.05 * WEIGHT_BYTES_PER_LAYER


def test_two_all_reduces_per_layer_over_eight_ranks(two_layers):
    _, prof, est = two_layers
    for layer in (0, 1):
        b = est.layers[layer]
        assert b.cc_count == 2 and b.cc_bytes == 2 * 3072 * 2  # attention and MoE outputs, [128, 24] bf16 each
        assert b.busy["cc"] > 0
    assert {(c["op"], c["group_size"]) for c in prof.collectives} == {("all_reduce", 8)}
    assert sum(c["count"] for c in prof.collectives) == 4
